"""Interrupted builds: what a killed build leaves behind, and ``resume=True`` finishing it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shardprep
from shardprep.builder import JOURNAL_NAME, _fingerprint
from shardprep.config import BuildConfig
from shardprep.destination import LocalDestination
from shardprep.format.errors import InputError, ManifestError
from shardprep.scan import scan
from shardprep.weighting import select_samples
from tests.conftest import payload
from tests.stalled_build import kill_stalled_build, names_in

SHARDS = 8
PER_SHARD = 40  # samples per shard
CLASSES = {"ant": 170, "bee": 100, "cat": 50}  # 320 = 8 x 40
OPTIONS = {"shards": SHARDS, "progress": False}


def _make_raw(root: Path) -> Path:
    index = 0
    for label, (cls, count) in enumerate(sorted(CLASSES.items())):
        (root / cls).mkdir(parents=True)
        for _ in range(count):
            (root / cls / f"{index:05d}.bin").write_bytes(payload(label, index) * 12)
            index += 1
    return root


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_raw(tmp_path_factory.mktemp("resume") / "raw")


@pytest.fixture(scope="module")
def clean(raw: Path) -> Path:
    """An uninterrupted build of ``raw`` with the options every test here uses."""
    out = raw.parent / "clean"
    shardprep.build(str(raw), str(out), workers=1, **OPTIONS)
    return out


def _scratch_here(folder: Path) -> dict[str, str]:
    """The environment of a build that is killed: its scratch folder (TMPDIR) in the test's tmp."""
    return {**os.environ, "TMPDIR": str(folder)}


def _kill_mid_build(raw: Path, out: Path, extra: dict[str, object] | None = None) -> None:
    """A real build with 2 worker processes, each stalled (as on a hung disk) halfway through
    its second shard, killed with SIGKILL once it has finished and half-written shards at once."""

    def stuck() -> bool:
        names = names_in(out)
        finished = [n for n in names if n.startswith("shard-") and ".tar" in n]
        partial = [n for n in names if n.endswith(".partial")]
        return len(finished) == 2 and len(partial) == 2  # both workers are stuck

    options = {"shards": SHARDS, "workers": 2, **(extra or {})}
    kill_stalled_build(raw, out, PER_SHARD + PER_SHARD // 2, options, stuck, out.parent, timeout=60)


def test_killed_build_then_resume_is_byte_identical(raw: Path, clean: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _kill_mid_build(raw, out)
    names = set(os.listdir(out))
    # what a killed build leaves: no manifest, the journal, complete shards with their
    # index, and hidden partial files; never a shard-*.tar without its .idx
    assert "manifest.json" not in names
    assert JOURNAL_NAME in names
    tars = sorted(n for n in names if n.startswith("shard-") and n.endswith(".tar"))
    assert len(tars) == 2
    for name in tars:
        idx = name.replace(".tar", ".idx")
        assert idx in names
        assert (out / name).read_bytes() == (clean / name).read_bytes()
        assert (out / idx).read_bytes() == (clean / idx).read_bytes()
    assert len([n for n in names if n.startswith(".shard-") and n.endswith(".tar.partial")]) == 2
    with pytest.raises(ManifestError, match="did not finish"):
        shardprep.read_manifest(str(out))
    journal = json.loads((out / JOURNAL_NAME).read_text())
    assert journal["options"]["shards"] == SHARDS
    assert len(journal["input_fingerprint"]) == 64

    summary = shardprep.build(str(raw), str(out), resume=True, workers=2, **OPTIONS)
    assert summary.reused_shards == 2
    assert summary.num_samples == 320
    assert _hashes(out) == _hashes(clean)  # same files, same bytes; no journal, no partials

    again = shardprep.build(str(raw), str(out), resume=True, workers=1, **OPTIONS)
    assert again.already_complete and again.reused_shards == summary.num_shards
    assert _hashes(out) == _hashes(clean)  # a resume of a complete build changes nothing


def test_resume_with_other_options_or_input_is_refused(
    raw: Path, clean: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    _kill_mid_build(raw, out, {"compression": "zstd"})
    before = _hashes(out)
    for changed in ({"seed": 1}, {"compression": "none"}, {"zstd_level": 4}):
        options = {"compression": "zstd", **OPTIONS, **changed}
        with pytest.raises(InputError, match="used other input or options") as info:
            shardprep.build(str(raw), str(out), resume=True, workers=1, **options)
        assert str(out) in str(info.value)
    with pytest.raises(InputError, match="used other input or options"):
        shardprep.build(str(raw), str(out), resume=True, workers=1, **{**OPTIONS, "shards": 7})
    other = tmp_path / "other"
    shutil.copytree(raw, other)
    (other / "cat" / "00319.bin").write_bytes(b"a different size")
    with pytest.raises(InputError, match="used other input or options"):
        shardprep.build(str(other), str(out), resume=True, workers=1, compression="zstd", **OPTIONS)
    assert _hashes(out) == before  # refusals touch nothing
    # the right options finish it
    summary = shardprep.build(
        str(raw), str(out), resume=True, workers=1, compression="zstd", **OPTIONS
    )
    assert summary.reused_shards == 2
    reference = tmp_path / "reference"
    shardprep.build(str(raw), str(reference), workers=1, compression="zstd", **OPTIONS)
    assert _hashes(out) == _hashes(reference)


def test_resume_with_nothing_to_resume_is_refused(raw: Path, clean: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no interrupted build to resume here"):
        shardprep.build(str(raw), str(empty), resume=True, workers=1, **OPTIONS)
    assert os.listdir(empty) == []
    with pytest.raises(InputError, match="no interrupted build to resume here"):
        shardprep.build(str(raw), str(tmp_path / "absent"), resume=True, workers=1, **OPTIONS)
    done = tmp_path / "done"
    shutil.copytree(clean, done)
    summary = shardprep.build(str(raw), str(done), resume=True, workers=1, **OPTIONS)
    assert summary.already_complete
    assert (summary.num_shards, summary.reused_shards, summary.num_samples) == (
        OPTIONS["shards"],
        OPTIONS["shards"],
        320,
    )
    with pytest.raises(InputError) as info:  # complete, but not this build: not "resumed"
        shardprep.build(str(raw), str(done), resume=True, workers=1, **{**OPTIONS, "seed": 5})
    assert str(info.value) == (
        f"{done}: already holds a complete build, of other input or options, so there is "
        "nothing to resume: pass overwrite=True instead to rebuild it from this input"
    )
    assert _hashes(done) == _hashes(clean)


def _write_journal(raw: Path, out: Path, **options: object) -> None:
    config = BuildConfig(**{**OPTIONS, **options})  # type: ignore[arg-type]
    inventory = scan(str(raw))
    fingerprint = _fingerprint(inventory, config, select_samples(inventory, config))
    LocalDestination(str(out), config).start_journal(fingerprint)


@pytest.mark.parametrize("remove_index", [True, False])
def test_resume_rewrites_a_missing_shard(
    raw: Path, clean: Path, tmp_path: Path, remove_index: bool
) -> None:
    """Simulated interruption: one shard and the manifest gone, the journal back."""
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    os.remove(out / "shard-00003.tar")
    if remove_index:
        os.remove(out / "shard-00003.idx")
    os.remove(out / "manifest.json")
    _write_journal(raw, out)
    summary = shardprep.build(str(raw), str(out), resume=True, workers=1, **OPTIONS)
    assert summary.reused_shards == SHARDS - 1
    assert _hashes(out) == _hashes(clean)


def test_resume_after_the_manifest_was_written(raw: Path, clean: Path, tmp_path: Path) -> None:
    """Killed between writing the manifest and removing the journal: resume finishes it."""
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    _write_journal(raw, out)
    summary = shardprep.build(str(raw), str(out), resume=True, workers=1, **OPTIONS)
    assert summary.reused_shards == SHARDS
    assert _hashes(out) == _hashes(clean)


def test_journal_is_what_build_writes(raw: Path, clean: Path, tmp_path: Path) -> None:
    """The simulated journal above equals the one a killed real build leaves."""
    out = tmp_path / "out"
    _kill_mid_build(raw, out)
    real = (out / JOURNAL_NAME).read_bytes()
    (out / JOURNAL_NAME).unlink()
    _write_journal(raw, out)
    assert (out / JOURNAL_NAME).read_bytes() == real


def test_kill_at_first_shard_of_an_unmodified_build(tmp_path: Path) -> None:
    """No stall: kill a plain 2-worker build as soon as a shard appears; resume completes it."""
    raw = tmp_path / "raw"
    for label in range(4):
        (raw / f"c{label}").mkdir(parents=True)
        for i in range(240):
            (raw / f"c{label}" / f"{i:04d}.bin").write_bytes(payload(label, i) * 16)
    shards = 48
    out = tmp_path / "out"
    code = (
        "import sys, shardprep; "
        f"shardprep.build(sys.argv[1], sys.argv[2], shards={shards}, workers=2, progress=False)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(raw), str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=_scratch_here(out.parent),
    )
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and any(n.endswith(".tar") for n in os.listdir(out))):
            assert proc.poll() is None, proc.stderr.read().decode()  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.001)  # polling interval only
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()  # type: ignore[union-attr]
    names = set(os.listdir(out))
    tars = {n for n in names if n.startswith("shard-") and n.endswith(".tar")}
    assert tars
    assert all(n.replace(".tar", ".idx") in names for n in tars)
    clean = tmp_path / "clean"
    shardprep.build(str(raw), str(clean), shards=shards, workers=1, progress=False)
    for n in tars:  # every complete-looking shard IS complete
        assert (out / n).read_bytes() == (clean / n).read_bytes()
    if "manifest.json" in names:  # the build won the race; nothing to check beyond this
        assert JOURNAL_NAME not in names or len(tars) == shards
        return
    assert len(tars) < shards
    summary = shardprep.build(
        str(raw), str(out), shards=shards, resume=True, workers=2, progress=False
    )
    assert summary.reused_shards == len(tars)
    assert _hashes(out) == _hashes(clean)
