"""After a --map failure the message says the command that works, and claims shards are kept
only when some are; following it to the letter finishes the build. Messages name the CLI's
flags for `shardprep build` and the Python keywords for `shardprep.build(...)`. A map whose
exception cannot even be printed is still reported in one line naming the key and its type.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

import shardprep
from shardprep.format.errors import BuildInterrupted, PlanError
from shardprep.format.shardformat import decode_index
from tests.faults.helpers import example_raw, map_reference, tree_bytes
from tests.integration import map_functions
from tests.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
SHARDS = 6
FAILING_SHARD = 4
HALF = "tests.integration.map_functions:half_size"
BROKEN_ENV = "SHARDPREP_TEST_MAP_BROKEN"  # the maps below fail while this is set
HERE = "tests.faults.test_map_advice"


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def unprintable(sample: dict[str, Any]) -> dict[str, Any]:
    raise UnprintableError


def broken_everywhere(sample: dict[str, Any]) -> dict[str, Any]:
    """Fails on every sample while BROKEN_ENV is set ("fixed" when it is not)."""
    if os.environ.get(BROKEN_ENV):
        raise ValueError("not yet")
    return sample


INTERRUPT_ENV = "SHARDPREP_TEST_MAP_CTRL_C_KEY"  # ctrl_c_at raises Ctrl-C on this sample


def ctrl_c_at(sample: dict[str, Any]) -> dict[str, Any]:
    """A Ctrl-C as the sample with key INTERRUPT_ENV is written (with one worker: in the build's
    own process, exactly as a SIGINT landing there)."""
    if sample["__key__"] == os.environ.get(INTERRUPT_ENV):
        raise KeyboardInterrupt
    return sample


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return example_raw(tmp_path_factory, "map-advice", 60)


@pytest.fixture(scope="module")
def reference(raw: Path) -> Path:
    return map_reference(raw, SHARDS, HALF)


def _cli(*args: str, env: dict[str, str] | None = None) -> Any:
    base = {
        k: v for k, v in os.environ.items() if k not in (BROKEN_ENV, map_functions.FAIL_KEY_ENV)
    }
    return run_bounded(
        [sys.executable, "-m", "shardprep", "build", *args],
        timeout=180,
        cwd=REPO,
        env={**base, **(env or {})},
    )


def _error_line(result: Any) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # one line, no traceback
    line: str = lines[0]
    return line


def test_cli_advice_after_a_map_error_is_the_command_that_works(
    raw: Path, reference: Path, tmp_path: Path
) -> None:
    """Was: "fix the function and run again" (which fails: OUT is not empty)."""
    key = decode_index((reference / f"shard-{FAILING_SHARD:05d}.idx").read_bytes()).key(0)
    out = tmp_path / "out"
    command = [str(raw), str(out), "-n", str(SHARDS), "-j", "1", "-q", "--map", HALF]
    failed = _cli(*command, env={map_functions.FAIL_KEY_ENV: key})
    assert failed.returncode == 1, failed.stderr
    line = _error_line(failed)
    assert line.startswith(f"Error: shard {FAILING_SHARD}: map {HALF} on sample {key!r} (from ")
    assert line.endswith(
        f". The {FAILING_SHARD} finished shard(s) are kept: fix the function, keeping its name "
        f"{HALF}, and run the same command with --resume"
    ), line
    assert sorted(p.name for p in out.glob("shard-*.tar")) == [
        f"shard-{s:05d}.tar" for s in range(FAILING_SHARD)
    ]
    fixed = _cli(*command, "--resume")  # exactly what the message says, the function fixed
    assert fixed.returncode == 0, fixed.stderr
    assert tree_bytes(out) == tree_bytes(reference)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_cli_claims_no_kept_shard_when_none_finished_and_resume_still_works(
    raw: Path, tmp_path: Path, workers: str
) -> None:
    """Was: "The finished shards are kept" when none were."""
    out = tmp_path / "out"
    spec = f"{HERE}:broken_everywhere"
    command = [str(raw), str(out), "-n", str(SHARDS), "-j", workers, "-q", "--map", spec]
    failed = _cli(*command, env={BROKEN_ENV: "1"})
    assert failed.returncode == 1, failed.stderr
    line = _error_line(failed)
    assert "raised ValueError: not yet (at " in line
    assert line.endswith(
        f". No shard was finished: fix the function, keeping its name {spec}, and run the "
        "same command with --resume"
    ), line
    assert not list(out.glob("shard-*"))
    fixed = _cli(*command, "--resume")
    assert fixed.returncode == 0, fixed.stderr
    clean = tmp_path / "clean"
    assert _cli(*[str(clean) if a == str(out) else a for a in command]).returncode == 0
    assert tree_bytes(out) == tree_bytes(clean)


def test_cli_advice_after_overwrite_says_resume_instead(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    spec = f"{HERE}:broken_everywhere"
    command = [str(raw), str(out), "-n", "2", "-j", "1", "-q", "--map", spec]
    assert _cli(*command).returncode == 0
    failed = _cli(*command, "--overwrite", env={BROKEN_ENV: "1"})
    assert failed.returncode == 1, failed.stderr
    assert _error_line(failed).endswith(
        "No shard was finished: fix the function, keeping its name "
        f"{spec}, and run the same command with --resume instead of --overwrite"
    )
    assert _cli(*command, "--resume").returncode == 0


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_exception_whose_str_raises_is_one_line_naming_the_key_and_type(
    raw: Path, tmp_path: Path, workers: str
) -> None:
    """Was: a RuntimeError traceback from formatting the message."""
    out = tmp_path / "out"
    spec = f"{HERE}:unprintable"
    result = _cli(str(raw), str(out), "-n", "2", "-j", workers, "-q", "--map", spec)
    assert result.returncode == 1, result.stderr
    line = _error_line(result)
    assert line.startswith(f"Error: shard 0: map {spec} on sample '") or line.startswith(
        f"Error: shard 1: map {spec} on sample '"
    ), line
    assert (
        " raised UnprintableError (its message cannot be shown: str() raised RuntimeError) (at "
        in line
    ), line
    assert line.endswith("run the same command with --resume"), line


def test_a_module_whose_import_error_cannot_be_printed_is_named(tmp_path: Path) -> None:
    module = tmp_path / "unprintable_import.py"
    module.write_text(
        "class E(Exception):\n    def __str__(self):\n        raise RuntimeError('x')\nraise E\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(PlanError) as info:
            shardprep.BuildConfig(shards=1, map="unprintable_import:fn")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("unprintable_import", None)
    assert str(info.value).startswith(
        "map='unprintable_import:fn': cannot import it (E (its message cannot be shown: str() "
        "raised RuntimeError)); "
    ), str(info.value)


@pytest.mark.parametrize(
    ("options", "python", "cli"),
    [
        ({"shards": 0}, "shards= must be at least 1 (got 0)", None),
        ({"seed": -1}, "seed= must be a non-negative integer (got -1)", None),
        (
            {"overwrite": True, "resume": True},
            "overwrite= and resume= exclude each other",
            (["--overwrite", "--resume"], "--overwrite and --resume exclude each other"),
        ),
        (
            {"ray_address": "auto"},
            "ray_address= needs engine='ray'",
            (["--ray-address", "auto"], "--ray-address needs --engine ray"),
        ),
        (
            {"keep_all": True},
            "num_samples=, keep_all= and weights_only= need class_weights=",
            (["--keep-all"], "--num-samples, --keep-all and --weights-only need --class-weights"),
        ),
        ({"compression": "gz"}, "compression= must be one of none, zstd", None),
    ],
)
def test_python_errors_name_keywords_and_cli_errors_name_flags(
    raw: Path,
    tmp_path: Path,
    options: dict[str, Any],
    python: str,
    cli: tuple[list[str], str] | None,
) -> None:
    """Was: shardprep.build(shards=0) said "--shards must be at least 1"."""
    with pytest.raises(PlanError) as info:
        shardprep.build(str(raw), str(tmp_path / "out"), **{"shards": 2, **options})
    assert str(info.value) == python
    if cli is not None:  # (the others click refuses itself, naming the flag)
        flags, message = cli
        result = _cli(str(raw), str(tmp_path / "out"), "-n", "2", *flags)
        assert result.returncode == 2, result.stderr
        assert f"Error: {message}" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shard", [0, FAILING_SHARD])
def test_a_ctrl_c_while_writing_counts_the_kept_shards(
    raw: Path, reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard: int
) -> None:
    """Was: "the finished shards are kept" also when none were. Shards are written in order
    (one worker): a Ctrl-C at the first sample of ``shard`` leaves exactly ``shard`` of them."""
    key = decode_index((reference / f"shard-{shard:05d}.idx").read_bytes()).key(0)
    monkeypatch.setenv(INTERRUPT_ENV, key)
    out = tmp_path / "out"
    options: dict[str, Any] = {"shards": SHARDS, "workers": 1, "progress": False}
    with pytest.raises(BuildInterrupted) as info:
        shardprep.build(str(raw), str(out), map=f"{HERE}:ctrl_c_at", **options)
    kept = f"the {shard} finished shard(s) are kept" if shard else "no shard was finished"
    assert str(info.value) == (
        f"interrupted; {kept} in {out}: call shardprep.build again with the same arguments and "
        "resume=True to finish the build"
    )
    assert len(list(out.glob("shard-*.tar"))) == shard
    monkeypatch.delenv(INTERRUPT_ENV)
    summary = shardprep.build(str(raw), str(out), map=f"{HERE}:ctrl_c_at", resume=True, **options)
    assert summary.reused_shards == shard and summary.num_shards == SHARDS
