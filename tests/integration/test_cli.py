"""The ``shardprep`` command line via click's CliRunner: output, exit codes and messages."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import shardprep
from shardprep.cli import cli
from shardprep.example import class_sizes
from shardprep.format.errors import InputError, PlanError
from shardprep.format.manifest import JOURNAL_NAME
from tests.processes import run_bounded


def _invoke(*args: str) -> Result:
    result = CliRunner().invoke(cli, list(args))
    # expected errors are one message, never a traceback
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


@pytest.fixture
def raw(make_class_folders: Callable[..., Path]) -> Path:
    return make_class_folders({"cat": 9, "dog": 5, "eel": 2})


def test_build_prints_a_summary(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = _invoke("build", str(raw), str(out), "--shards", "4", "-j", "1", "--quiet")
    assert result.exit_code == 0
    assert result.output == ""  # --quiet: no bars, no summary
    out2 = tmp_path / "out2"
    result = _invoke("build", str(raw), str(out2), "-n", "4", "-j", "1")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0] == f"wrote 4 shards to {out2}"
    assert lines[1].split() == ["input", "class-folders", "(auto-detected)"]
    assert lines[2].split() == ["samples", "16", "(4-4", "per", "shard),", "3", "classes"]
    assert lines[3].strip().startswith("bytes")
    assert lines[4].strip().startswith("time")
    assert len(lines) == 5
    assert sorted(os.listdir(out2)) == sorted(os.listdir(out))


def test_build_json(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = _invoke(
        "build",
        str(raw),
        str(out),
        "-n",
        "3",
        "-j",
        "2",
        "--seed",
        "5",
        "--compress",
        "zstd",
        "--zstd-level",
        "9",
        "--json",
    )
    assert result.exit_code == 0
    assert result.stderr == ""  # --json implies no progress bars
    data = json.loads(result.stdout)
    assert data["num_samples"] == 16
    assert data["num_classes"] == 3
    assert data["num_shards"] == 3
    assert (data["min_shard_samples"], data["max_shard_samples"]) == (5, 6)
    assert data["out"] == str(out)
    assert data["reused_shards"] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["seed"] == 5
    assert manifest["options"]["compression"] == "zstd"
    assert manifest["options"]["zstd_level"] == 9
    assert sorted(p.name for p in out.glob("*.zst")) == [f"shard-0000{i}.tar.zst" for i in range(3)]


def test_build_input_options(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    (root / "img").mkdir(parents=True)
    rows = ["file,y,note"]
    for i in range(6):
        (root / "img" / f"{i}.jpg").write_bytes(b"%d" % i)
        rows.append(f"img/{i}.jpg,{i % 2},n{i}")
    (root / "list.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    result = _invoke(
        "build",
        str(root / "list.csv"),
        str(out),
        "-n",
        "2",
        "-j",
        "1",
        "--json",
        "--format",
        "listing",
        "--path-column",
        "file",
        "--label-column",
        "y",
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["num_classes"] == 2
    result = _invoke("build", str(root / "list.csv"), str(tmp_path / "o2"), "-n", "2", "-q")
    assert result.exit_code == 1
    assert "no 'path' column" in result.output


def test_inspect(built: Path) -> None:
    result = _invoke("inspect", str(built))
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert (
        lines[0] == f"{built}: 103 samples in 8 shards, {_size(built):,} bytes (compression: none)"
    )
    assert lines[1].strip().startswith("samples per shard 12-13")
    assert lines[2] == "  classes: 0=a (60), 1=b (30), 2=c (13)"
    rows = [line.split() for line in lines[4:]]
    assert [r[0] for r in rows] == [f"shard-{i:05d}.tar" for i in range(8)]
    assert sum(int(r[1]) for r in rows) == 103
    result = _invoke("inspect", "--json", str(built))
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["totals"]["num_samples"] == 103
    assert [c["count"] for c in data["classes"]] == [60, 30, 13]
    assert len(data["shards"]) == 8
    assert set(data["shards"][0]) == {"file", "num_samples", "num_bytes", "class_counts"}


def _size(out: Path) -> int:
    return sum(p.stat().st_size for p in out.glob("shard-*.tar"))


def test_inspect_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _invoke("inspect", str(empty))
    assert result.exit_code == 1
    assert f"{empty / 'manifest.json'}: no manifest" in result.output
    (empty / "manifest.json").write_text('{"format": "shardprep-manifest", "version": 99}')
    result = _invoke("inspect", str(empty))
    assert result.exit_code == 1
    assert "manifest version 99 is not supported" in result.output
    result = _invoke("inspect", str(tmp_path / "missing"))
    assert result.exit_code == 2


def test_verify(built: Path, tmp_path: Path) -> None:
    result = _invoke("verify", str(built), "-q")
    assert result.exit_code == 0
    assert result.output == "ok: 8 shards, 103 samples verified\n"
    result = _invoke("verify", str(tmp_path))
    assert result.exit_code == 1
    assert "no manifest" in result.output


def test_example_then_build_then_verify(tmp_path: Path) -> None:
    raw = tmp_path / "example"
    result = _invoke("example", str(raw), "--samples", "60", "--classes", "4", "--seed", "3")
    assert result.exit_code == 0
    counts = class_sizes(60, 4)
    assert sum(counts) == 60 and counts == sorted(counts, reverse=True)
    assert result.output == f"wrote 60 samples in 4 class folders to {raw}: {counts}\n"
    assert [len(os.listdir(raw / f"class-{k}")) for k in range(4)] == counts
    out = tmp_path / "out"
    assert _invoke("build", str(raw), str(out), "-n", "5", "-j", "1", "-q").exit_code == 0
    assert _invoke("verify", str(out), "-q").output == "ok: 5 shards, 60 samples verified\n"
    # the same example again is a no-op; another one refuses the non-empty folder
    before = sorted(p.relative_to(raw) for p in raw.rglob("*"))
    result = _invoke("example", str(raw), "--samples", "60", "--classes", "4", "--seed", "3")
    assert result.exit_code == 0
    assert result.output == f"wrote 60 samples in 4 class folders to {raw}: {counts}\n"
    assert sorted(p.relative_to(raw) for p in raw.rglob("*")) == before
    for other in (["--seed", "4"], ["--samples", "61"], []):
        result = _invoke("example", str(raw), "--samples", "60", "--classes", "4", *other)
        assert result.exit_code == 1
        assert f"{raw}: not empty" in result.output
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "data.txt").write_text("x")
    result = _invoke("example", str(tmp_path / "mine"))
    assert result.exit_code == 1
    assert f"{tmp_path / 'mine'}: not empty" in result.output
    result = _invoke("example", str(tmp_path / "few"), "--samples", "2", "--classes", "3")
    assert result.exit_code == 1
    assert "need at least one sample per class" in result.output


# --- exit codes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shards", "0"], "0 is not in the range x>=1"),
        (["--shards", "17"], "cannot make 17 shard(s) from 16 sample(s)"),
        (["--shards", "2", "--compress", "gz"], "'gz' is not one of 'none', 'zstd'"),
        (["--shards", "2", "--zstd-level", "23"], "--zstd-level"),
        (["--shards", "2", "--seed", "-1"], "--seed"),
        (["--shards", "2", "--format", "orc"], "'orc' is not one of"),
        (["--shards", "2", "--workers", "0"], "--workers"),
        (["--shards", "2", "--overwrite", "--resume"], "--overwrite and --resume exclude"),
        ([], "Missing option '--shards'"),
    ],
)
def test_usage_errors_exit_2(raw: Path, tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "out"
    result = _invoke("build", str(raw), str(out), "-q", *args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Usage: " in result.output
    assert not out.exists()


def test_missing_raw_exits_2(tmp_path: Path) -> None:
    """A path argument that does not exist is a usage error (click's convention), as for inspect."""
    missing = tmp_path / "no-such-raw"
    out = tmp_path / "out"
    result = _invoke("build", str(missing), str(out), "-n", "2", "-q")
    assert result.exit_code == 2
    assert f"Error: Invalid value for 'RAW': Path '{missing}' does not exist." in result.output
    assert not out.exists()


def test_empty_raw_exits_1(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _invoke("build", str(empty), str(tmp_path / "out"), "-n", "2", "-q")
    assert result.exit_code == 1
    assert f"Error: {empty}: the folder is empty" in result.output


def test_non_empty_out_exits_1(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    result = _invoke("build", str(raw), str(out), "-n", "2", "-q")
    assert result.exit_code == 1
    assert f"Error: {out}: the output folder is not empty" in result.output
    assert "'keep.txt'" in result.output
    assert os.listdir(out) == ["keep.txt"]
    result = _invoke("build", str(raw), str(out), "-n", "2", "-q", "-j", "1", "--overwrite")
    assert result.exit_code == 0
    assert "keep.txt" in os.listdir(out)


def test_bad_input_exits_1_naming_the_file(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    (raw / "cat").mkdir(parents=True)
    (raw / "cat" / "a.jpg").write_bytes(b"a")
    (raw / "cat" / "noext").write_bytes(b"b")
    result = _invoke("build", str(raw), str(tmp_path / "out"), "-n", "1", "-q")
    assert result.exit_code == 1
    assert f"{raw / 'cat' / 'noext'}: file has no extension" in result.output


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("name,label\nx.jpg,1\n", "no 'path' column"),
        ("path\nmissing.jpg\n", "cannot stat"),
        ("path\n../outside.jpg\n", "outside the listing's folder"),
    ],
)
def test_bad_listing_exits_1(tmp_path: Path, content: str, message: str) -> None:
    listing = tmp_path / "data" / "list.csv"
    listing.parent.mkdir()
    listing.write_text(content)
    result = _invoke("build", str(listing), str(tmp_path / "out"), "-n", "1", "-q")
    assert result.exit_code == 1
    assert str(listing) in result.output
    assert message in result.output


def test_duplicate_keys_exit_1(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    (raw / "cat").mkdir(parents=True)
    (raw / "cat" / "a.jpg").write_bytes(b"1")
    (raw / "cat" / "a.png").write_bytes(b"2")
    (raw / "cat" / "b.png").write_bytes(b"2")
    result = _invoke(
        "build", str(raw), str(tmp_path / "out"), "-n", "1", "-q", "--format", "class-folders"
    )
    assert result.exit_code == 1
    assert "duplicate sample key 'cat__a'" in result.output
    assert "'cat/a.jpg'" in result.output and "'cat/a.png'" in result.output


def test_python_dash_m_help() -> None:
    result = run_bounded([sys.executable, "-m", "shardprep", "--help"], timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage: shardprep [OPTIONS] COMMAND [ARGS]...")
    for command in ("build", "inspect", "verify", "example"):
        assert f"  {command} " in result.stdout
    assert result.stderr == ""


def test_version() -> None:
    result = _invoke("--version")
    assert result.exit_code == 0
    assert "0.1.0" in result.output


MARKER_ENV = "SHARDPREP_TEST_MARKER"


def slow_after_marker(sample: dict[str, bytes]) -> dict[str, bytes]:
    """A --map that writes the marker file as it first runs, then takes 20 ms a sample (the
    build is then certainly writing when the test sends its signals)."""
    marker = Path(os.environ[MARKER_ENV])
    if not marker.exists():
        marker.write_text("writing")
    time.sleep(0.02)  # the map's own work, not synchronization
    return sample


def test_two_ctrl_c_at_once_end_in_the_interrupted_advice(raw: Path, tmp_path: Path) -> None:
    """Was: a second SIGINT while the first was being reported ended in click's "Aborted!"
    (exit 1) or a bare KeyboardInterrupt."""
    out, marker = tmp_path / "out", tmp_path / "marker"
    repo = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "shardprep", "build", str(raw), str(out), "-n", "4", "-j", "2",
               "-q", "--map", "tests.integration.test_cli:slow_after_marker"]  # fmt: skip
    process = subprocess.Popen(
        command,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        cwd=repo,
        env={**os.environ, MARKER_ENV: str(marker)},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():  # the marker: a write task has started
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the map never ran"
            time.sleep(0.01)  # polling interval only
        os.kill(process.pid, signal.SIGINT)
        os.kill(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "Aborted!" not in stderr, stderr
    kept = len(list(out.glob("shard-*.tar")))  # counted in the message (was: "the finished")
    finished = f"the {kept} finished shard(s) are kept" if kept else "no shard was finished"
    assert stderr.strip().splitlines()[-1] in (
        f"interrupted; {finished} in {out}: run the same command with --resume to finish the build",
        f"interrupted after the build finished: {out} is complete",
    ), stderr


def test_out_refusals_name_keywords_from_python_and_flags_from_the_cli(
    raw: Path, tmp_path: Path
) -> None:
    """Was: "pass --overwrite", "run without --resume" and "start over with --overwrite" for
    shardprep.build(...) too."""
    out, absent = tmp_path / "out", tmp_path / "absent"
    out.mkdir()
    (out / "notes.txt").write_text("not a build")
    refusals = [  # (OUT, options, the message from Python, the message from the CLI)
        (
            out,
            {},
            "pass overwrite=True to replace a previous build, resume=True to finish",
            "pass --overwrite to replace a previous build, --resume to finish",
        ),
        (
            absent,
            {"resume": True},
            f"{absent}: no interrupted build to resume here; call shardprep.build without "
            "resume=True",
            f"{absent}: no interrupted build to resume here; run without --resume",
        ),
    ]
    for where, options, python, cli_words in refusals:
        with pytest.raises(InputError) as info:
            shardprep.build(str(raw), str(where), shards=2, progress=False, **options)
        assert python in str(info.value), str(info.value)
        flags = ["--resume"] if options else []
        result = _invoke("build", str(raw), str(where), "-n", "2", "-q", *flags)
        assert result.exit_code == 1
        assert cli_words in result.stderr.strip().splitlines()[-1], result.stderr
    (out / JOURNAL_NAME).write_text("{}")  # an interrupted build of other input or options
    with pytest.raises(InputError) as info:
        shardprep.build(str(raw), str(out), shards=2, progress=False, resume=True)
    assert str(info.value).endswith("start over with overwrite=True"), str(info.value)
    result = _invoke("build", str(raw), str(out), "-n", "2", "-q", "--resume")
    assert result.stderr.strip().endswith("start over with --overwrite"), result.stderr
    assert not absent.exists() and sorted(os.listdir(out)) == sorted([JOURNAL_NAME, "notes.txt"])


# A real SIGINT raised in the process (the kernel delivers it; Python's own handler turns it
# into KeyboardInterrupt at the next instruction) as click reads the command line: argv[1] is
# the command whose arguments are being read ("shardprep" for the group's own).
CTRL_C_WHILE_PARSING = """
import signal, sys, click
from shardprep.cli import main
parse_args = click.Command.parse_args
def interrupted(self, ctx, args):
    if ctx.info_name == sys.argv[1]:
        signal.raise_signal(signal.SIGINT)
    return parse_args(self, ctx, args)
click.Command.parse_args = interrupted
main(sys.argv[2:])
"""


@pytest.mark.parametrize(
    ("parsing", "message"),
    [
        ("build", "interrupted before the build began; nothing was written"),
        ("shardprep", "interrupted before the command began; nothing was written"),
    ],
)
def test_a_ctrl_c_while_the_command_line_is_read_exits_130_with_one_line(
    raw: Path, tmp_path: Path, parsing: str, message: str
) -> None:
    """Was: click's "Aborted!" and exit status 1."""
    out = tmp_path / "out"
    command = [sys.executable, "-c", CTRL_C_WHILE_PARSING, parsing]
    result = run_bounded([*command, "build", str(raw), str(out), "-n", "2"], timeout=60)
    assert result.returncode == 130, result.stderr
    assert result.stderr == f"{message}\n"
    assert result.stdout == ""
    assert not out.exists()


def test_too_many_shards_names_the_keyword_from_python(raw: Path, tmp_path: Path) -> None:
    """Was: "choose --shards between 1 and 16" for shardprep.build(...) too."""
    with pytest.raises(PlanError) as info:
        shardprep.build(str(raw), str(tmp_path / "out"), shards=17, progress=False)
    assert (
        str(info.value)
        == "cannot make 17 shard(s) from 16 sample(s): choose shards= between 1 and 16"
    )
    result = _invoke("build", str(raw), str(tmp_path / "out"), "-n", "17", "-q")
    assert result.exit_code == 2
    assert "choose --shards between 1 and 16" in result.output
