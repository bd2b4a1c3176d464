"""Issue 9 item 10: a full disk or a read-only OUT: one Error line, exit 1, nothing complete-looking.

Uses small tmpfs mounts (size= for bytes, nr_inodes= for "no more files"), skipped with a
reason where mounting is not permitted; every mount is unmounted in a finally.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import shardprep
from shardprep.format.errors import WriteError
from tests.conftest import write_class_folders
from tests.faults.helpers import error_lines, invoke, tree_hashes
from tests.filesystems import tmpfs


def _raw(tmp_path: Path) -> Path:
    return write_class_folders(tmp_path / "raw", {"a": 30, "b": 20}, repeat=200)


def _hidden_partials(out: Path) -> list[str]:
    return [n for n in os.listdir(out) if n.endswith(".partial")] if out.exists() else []


def test_disk_full_while_writing_shards(tmp_path: Path) -> None:
    raw = _raw(tmp_path)
    with tmpfs(tmp_path / "disk", "size=256k") as disk:
        out = disk / "out"
        result = invoke("build", str(raw), str(out), "-n", "4", "-j", "2", "-q")
        assert result.exit_code == 1
        [line] = error_lines(result)
        assert line.startswith("Error: shard ")
        assert "no space left on the device" in line
        assert line.endswith(
            f"{_kept(out)}: fix the cause, then run the same command with --resume"
        )
        assert not (out / "manifest.json").exists()
        assert _hidden_partials(out) == []  # the temp files of unfinished shards are removed
        assert (out / ".shardprep-build.json").exists()  # so --resume can continue


def _kept(out: Path) -> str:
    """What the advice says OUT keeps (was: nothing said, or "are kept" with none there)."""
    kept = len(list(out.glob("shard-*.tar")))
    return f"the {kept} finished shard(s) are kept" if kept else "no shard was finished"


def test_disk_full_in_python_names_resume_true(tmp_path: Path) -> None:
    """shardprep.build is told its keyword (was: "run the same command with --resume")."""
    raw = _raw(tmp_path)
    with tmpfs(tmp_path / "disk", "size=256k") as disk:
        out = disk / "out"
        with pytest.raises(WriteError) as caught:
            shardprep.build(str(raw), str(out), shards=4, workers=2, progress=False)
        message = str(caught.value)
        assert message.startswith("shard ") and "no space left on the device" in message
        assert message.endswith(
            f"{_kept(out)}: fix the cause, then call shardprep.build again with the same "
            "arguments and resume=True"
        ), message


@pytest.mark.parametrize(
    ("inodes", "what", "advice"),
    [
        (1, "OUT", "cannot create or clear the output folder: choose a writable OUT"),
        (2, "journal", "cannot start the build: fix the cause, then run the same command again"),
        (
            2 + 1 + 2 * 4,  # the root, OUT, the journal, a shard and an index per shard
            "manifest",
            "every shard is written and kept: fix the cause, then run the same command with "
            "--resume to write the manifest",
        ),
    ],
)
def test_no_space_for_out_journal_or_manifest(
    tmp_path: Path, inodes: int, what: str, advice: str
) -> None:
    """A tmpfs that runs out of inodes right where OUT, the journal or the manifest is created."""
    raw = _raw(tmp_path)
    with tmpfs(tmp_path / "disk", f"size=8m,nr_inodes={inodes}") as disk:
        out = disk / "out"
        result = invoke("build", str(raw), str(out), "-n", "4", "-j", "1", "-q")
        assert result.exit_code == 1
        path = {
            "OUT": out,
            "journal": out / ".shardprep-build.json",
            "manifest": out / "manifest.json",
        }
        assert error_lines(result) == [
            f"Error: {path[what]}: no space left on the device; {advice}"
        ]
        assert not (out / "manifest.json").exists()
        assert _hidden_partials(out) == []
        if what == "manifest":  # the advice works once there is room
            grow = ["mount", "-o", f"remount,nr_inodes={inodes + 4}", str(disk)]
            subprocess.run(grow, check=True)
            result = invoke("build", str(raw), str(out), "-n", "4", "-j", "1", "-q", "--resume")
            assert result.exit_code == 0, result.output
            clean = tmp_path / "clean"
            assert invoke("build", str(raw), str(clean), "-n", "4", "-j", "1", "-q").exit_code == 0
            assert tree_hashes(out) == tree_hashes(clean)


def test_read_only_parent_of_out(tmp_path: Path) -> None:
    raw = _raw(tmp_path)
    with tmpfs(tmp_path / "ro", "ro,size=64k") as parent:
        out = parent / "out"
        result = invoke("build", str(raw), str(out), "-n", "2", "-q")
        assert result.exit_code == 1
        assert error_lines(result) == [
            f"Error: {out}: Read-only file system; cannot create or clear the output folder: "
            "choose a writable OUT"
        ]
        assert result.stderr.count("\n") == 1
