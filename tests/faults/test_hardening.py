"""Issue 23, item 7: builder-side findings, each refused or repaired with a message that names
the file, shard or key and says what to do.

- size fields of a manifest entry that no shard can have (a loader would allocate by them);
- class folders and file names that are not UTF-8 (refused at scan, before OUT is touched);
- ``--resume`` over a finished shard damaged after the kill (rewritten, with a notice);
- staging and scratch folders of killed builds (swept by the next build, only ours).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loader import ShardDataset
from shardprep.errors import ManifestError
from shardprep.verify import verify_output
from tests.faults.helpers import error_lines, invoke
from tests.faults.shard_surgery import copy_output, edit_manifest_json, index_of
from tests.processes import run_bounded

# --- item 3: sizes in the manifest ------------------------------------------------------


def _set_shard(shard: int, field: str, value: int) -> Any:
    """Set one size of one shard, and the totals to agree (only the bounds can refuse it)."""

    def edit(m: dict[str, Any]) -> None:
        m["shards"][shard][field] = value
        if field == "tar_bytes" and m["options"]["compression"] == "none":
            m["shards"][shard]["num_bytes"] = value
        nbytes = [s["num_bytes"] for s in m["shards"]]
        m["totals"]["num_bytes"] = sum(nbytes)
        m["totals"]["tar_bytes"] = sum(s["tar_bytes"] for s in m["shards"])
        m["totals"]["shard_bytes_ratio"] = round(max(nbytes) / max(1, min(nbytes)), 6)

    return edit


@pytest.mark.parametrize(
    ("fixture", "field", "fragment"),
    [
        ("built", "index_bytes", "index_bytes 1125899906842624 is outside 16.."),
        ("built", "index_bytes", "index_bytes 3 is outside 16.."),
        ("built_zstd", "num_bytes", "num_bytes 1125899906842624 is above the maximum"),
        ("built", "tar_bytes", "tar_bytes 1125899906842624 is above the maximum"),
    ],
)
def test_impossible_sizes_are_refused_naming_shard_and_field(
    request: pytest.FixtureRequest, tmp_path: Path, fixture: str, field: str, fragment: str
) -> None:
    built: Path = request.getfixturevalue(fixture)
    out = copy_output(built, tmp_path / "out")
    value = 3 if "index_bytes 3 " in fragment else 1 << 50
    edit_manifest_json(out, _set_shard(3, field, value))
    name = "shard-00003.tar.zst" if fixture == "built_zstd" else "shard-00003.tar"
    where = f"shard 3 ('{name}'): "
    with pytest.raises(ManifestError) as info:
        ShardDataset(str(out))
    assert where + fragment in str(info.value)
    with pytest.raises(ManifestError) as info:
        verify_output(str(out))
    assert where + fragment in str(info.value)
    result = invoke("verify", str(out), "--quiet")
    assert result.exit_code != 0
    lines = error_lines(result)
    assert len(lines) == 1 and where + fragment in lines[0], result.output


# --- item 1: names that are not UTF-8 -----------------------------------------------------


def _build_cli(*args: str, tmpdir: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TMPDIR": str(tmpdir)} if tmpdir is not None else None
    return run_bounded(
        [sys.executable, "-m", "shardprep", "build", *args, "--quiet"], timeout=120, env=env
    )


def test_class_folder_not_utf8_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for name in (b"cat", b"caf\xe9"):
        folder = os.path.join(os.fsencode(raw), name)
        os.makedirs(folder)
        for i in range(3):
            with open(os.path.join(folder, b"%d.jpg" % i), "wb") as f:
                f.write(b"x" * 100)
    out = tmp_path / "out"
    message = (
        f"Error: {os.fsencode(raw) + b'/caf' + bytes([0xE9])!r}: the class folder's name "
        "b'caf\\xe9' is not valid UTF-8, and class names are written to manifest.json as text; "
        "nothing was written: rename the folder to a UTF-8 name (e.g. convmv -f latin1 -t utf8) "
        "and run the same command again"
    )
    result = _build_cli(str(raw), str(out), "--shards", "2", "--workers", "1")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert [ln for ln in result.stderr.splitlines() if ln.startswith("Error:")] == [message]
    assert not out.exists()  # refused at scan: OUT was never made
    # What an older shardprep left (a journal and shards) is refused the same way on --resume.
    out.mkdir()
    (out / ".shardprep-build.json").write_text("{}")
    result = _build_cli(str(raw), str(out), "--shards", "2", "--workers", "1", "--resume")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert [ln for ln in result.stderr.splitlines() if ln.startswith("Error:")] == [message]
    assert os.listdir(out) == [".shardprep-build.json"]


def test_file_name_not_utf8_builds_with_a_safe_key(tmp_path: Path) -> None:
    """A file name is only a source: its key is made of safe ASCII, its path kept as bytes."""
    raw = tmp_path / "raw"
    (raw / "cat").mkdir(parents=True)
    with open(os.path.join(os.fsencode(raw / "cat"), b"b\xff.jpg"), "wb") as f:
        f.write(b"payload")
    (raw / "cat" / "c.jpg").write_bytes(b"other")
    out = tmp_path / "out"
    result = _build_cli(str(raw), str(out), "--shards", "1", "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert verify_output(str(out)).problems == []
    samples = {s["__key__"]: bytes(s["jpg"]) for s in ShardDataset(str(out), shuffle=False)}
    assert samples == {"cat__b_": b"payload", "cat__c": b"other"}
    assert index_of(out, 0).source(0) == "cat/b\udcff.jpg"
