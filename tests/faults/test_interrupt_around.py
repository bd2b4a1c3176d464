"""A Ctrl-C that lands around the build, not inside it: as ``build()`` begins (before its own
handling is set up) or as it returns (after its clean-up). Seen once in the random-timing test
(tests/faults/test_interrupt.py): the CLI said a bare "interrupted" for an output that was
complete. The advice now comes from what OUT holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import shardprep.builder
from shardprep.format.manifest import JOURNAL_NAME
from tests.faults.helpers import class_folders, invoke, tree_hashes

AGAIN = "interrupted before any shard was written: run the same command again"


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    return class_folders(tmp_path / "raw", seed=5, per_class=12)


def _last_line(result: Any) -> str:
    return result.stderr.strip().splitlines()[-1]


def test_a_ctrl_c_as_the_build_returns_says_the_output_is_complete(
    raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = tmp_path / "reference"
    assert invoke("build", str(raw), str(reference), "-n", "3", "-q").exit_code == 0
    real = shardprep.builder.build

    def returns_then_interrupted(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise KeyboardInterrupt  # as if SIGINT arrived on the way back to the CLI

    monkeypatch.setattr(shardprep.builder, "build", returns_then_interrupted)
    out = tmp_path / "out"
    result = invoke("build", str(raw), str(out), "-n", "3", "-q")
    assert result.exit_code == 130
    assert _last_line(result) == f"interrupted after the build finished: {out} is complete"
    assert tree_hashes(out) == tree_hashes(reference)


def test_a_ctrl_c_as_the_build_begins_says_run_it_again(
    raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted_at_once(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(shardprep.builder, "build", interrupted_at_once)
    result = invoke("build", str(raw), str(tmp_path / "out"), "-n", "3", "-q")
    assert result.exit_code == 130
    assert _last_line(result) == AGAIN


def test_a_ctrl_c_around_a_resumable_build_says_resume_and_an_old_output_is_left_as_it_was(
    raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    assert invoke("build", str(raw), str(out), "-n", "3", "-q").exit_code == 0
    before = tree_hashes(out)

    def interrupted_at_once(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(shardprep.builder, "build", interrupted_at_once)
    result = invoke("build", str(raw), str(out), "-n", "3", "-q", "--overwrite")
    assert _last_line(result) == f"interrupted: {out} holds the complete output it held before"
    assert tree_hashes(out) == before
    (out / JOURNAL_NAME).write_text("{}")  # a build stopped while writing left its journal
    result = invoke("build", str(raw), str(out), "-n", "3", "-q", "--overwrite")
    assert result.exit_code == 130
    assert _last_line(result) == (
        f"interrupted; the 3 finished shard(s) are kept in {out}: run the same command "
        "with --resume instead of --overwrite to finish the build"
    )
    for shard in out.glob("shard-*"):  # was: "the finished shards are kept" with none there
        shard.unlink()
    result = invoke("build", str(raw), str(out), "-n", "3", "-q")
    assert result.exit_code == 130
    assert _last_line(result) == (
        f"interrupted; no shard was finished in {out}: run the same command with --resume to "
        "finish the build"
    )


@pytest.mark.parametrize("where", ["sweep_stale", "open_destination"])
def test_a_ctrl_c_as_a_url_build_makes_its_client_says_run_it_again(
    raw: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A URL OUT is not looked at after a Ctrl-C, so one that landed before the build's own
    handling (s3fs's client takes ~0.5 s to make) said a bare "interrupted" (a fault hunt: 6 of
    100 signals). The build's handling now begins before the client is made: nothing was written."""

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt  # as if SIGINT arrived while it ran

    monkeypatch.setattr(shardprep.builder, where, interrupted)
    result = invoke("build", str(raw), "s3://no-such-bucket/out", "-n", "3", "-q")
    assert result.exit_code == 130
    assert _last_line(result) == AGAIN
    assert "Traceback" not in result.stderr
