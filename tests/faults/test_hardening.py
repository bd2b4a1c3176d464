"""Issue 23, item 7: builder-side findings, each refused or repaired with a message that names
the file, shard or key and says what to do.

- size fields of a manifest entry that no shard can have (a loader would allocate by them);
- class folders and file names that are not UTF-8 (refused at scan, before OUT is touched);
- ``--resume`` over a finished shard damaged after the kill (rewritten, with a notice);
- staging and scratch folders of killed builds (swept by the next build, only ours).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loader import ShardDataset
from shardprep.format.errors import ManifestError
from shardprep.verify import verify_output
from tests.faults.helpers import error_lines, invoke, tree_hashes
from tests.faults.shard_surgery import copy_output, edit_manifest_json, index_of
from tests.processes import run_bounded
from tests.stalled_build import kill_stalled_build, names_in

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


# --- item 4: --resume checks the shards it reuses ------------------------------------------

SHARDS = 6
PER_SHARD = 20


def _kill_stalled_build(raw: Path, out: Path, tmpdir: Path, finished: int) -> None:
    """A real build with 1 worker process that stalls (as on a hung disk), killed with SIGKILL
    once ``finished`` shards and a partial one are there."""

    def stuck() -> bool:
        names = names_in(out)
        done = [n for n in names if n.startswith("shard-") and n.endswith(".tar")]
        return len(done) == finished and any(n.endswith(".partial") for n in names)

    stall_after = finished * PER_SHARD + PER_SHARD // 2
    kill_stalled_build(raw, out, stall_after, {"shards": SHARDS, "workers": 1}, stuck, tmpdir)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _payload_byte(out: Path) -> None:
    _flip(out / "shard-00001.tar", int(index_of(out, 1).member_offset[3]) + 5)


def _header_byte(out: Path) -> None:  # the mtime field of sample 3's header
    _flip(out / "shard-00001.tar", int(index_of(out, 1).sample_offset[3]) + 140)


def _truncated(out: Path) -> None:
    path = out / "shard-00001.tar"
    path.write_bytes(path.read_bytes()[:-512])


def _index_byte(out: Path) -> None:  # a byte of the index's checksum of member 0
    path = out / "shard-00001.idx"
    data = path.read_bytes()
    (head_len,) = struct.unpack_from("<Q", data, 8)
    offset = json.loads(data[16 : 16 + head_len])["arrays"]["member_hash"][1]
    _flip(path, 16 + head_len + offset)


@pytest.mark.parametrize("damage", [_payload_byte, _header_byte, _truncated, _index_byte])
def test_resume_rewrites_a_finished_shard_damaged_after_the_kill(
    tmp_path: Path, damage: Any
) -> None:
    raw = tmp_path / "raw"
    for label, cls in enumerate(("a", "b", "c")):
        (raw / cls).mkdir(parents=True)
        for i in range(SHARDS * PER_SHARD // 3):
            (raw / cls / f"{i:04d}.bin").write_bytes(bytes([label, i % 256]) * (300 + i))
    clean = tmp_path / "clean"
    result = _build_cli(str(raw), str(clean), "-n", str(SHARDS), "--workers", "1")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    _kill_stalled_build(raw, out, tmp_path, finished=2)
    damage(out)
    result = _build_cli(str(raw), str(out), "-n", str(SHARDS), "--workers", "1", "--resume")
    assert result.returncode == 0, result.stderr
    notices = [line for line in result.stderr.splitlines() if "damaged" in line]
    assert len(notices) == 1 and notices[0].startswith(
        f"{out / 'shard-00001.tar'}: damaged since the interrupted build ("
    ), result.stderr
    assert notices[0].endswith("); writing it again")
    assert tree_hashes(out) == tree_hashes(clean)  # rewritten: byte-identical to a clean build


# --- item 5: folders of killed builds in TMPDIR are swept, only ours ---------------------


def _raw_for_kill(tmp_path: Path) -> Path:
    raw = tmp_path / "raw"
    for label, cls in enumerate(("a", "b", "c")):
        (raw / cls).mkdir(parents=True)
        for i in range(SHARDS * PER_SHARD // 3):
            (raw / cls / f"{i:04d}.bin").write_bytes(bytes([label, i % 256]) * (300 + i))
    return raw


def _decoys(tmp: Path) -> Any:
    """Make folders a sweep must leave alone; returns the open file that holds one 'live'
    build's lock."""
    import fcntl

    def folder(name: str, lock: bool) -> Path:
        (tmp / name).mkdir()
        (tmp / name / "data").write_text(name)
        if lock:
            (tmp / name / "shardprep.lock").write_text("")
        return tmp / name

    folder("shardprep-build-nolock01", lock=False)  # our name, no lock file
    folder("shardprep-staging-livebuild", lock=True)  # a suffix of 9: not mkdtemp's
    folder("shardprep-staging-live0001", lock=True)
    holder = open(tmp / "shardprep-staging-live0001" / "shardprep.lock", "rb")  # noqa: SIM115
    fcntl.flock(holder, fcntl.LOCK_EX)  # a live build holds it
    folder("other-build-abcdefgh", lock=True)  # not our prefix
    target = folder("elsewhere", lock=True)
    os.symlink(target, tmp / "shardprep-build-symlink1")  # a link, never followed
    (tmp / "shardprep-build-plainfil").write_text("a file")
    return holder


def _tmp_state(tmp: Path) -> dict[str, object]:
    """What ``tmp`` holds: folders' entries, links' targets, files' text."""
    return {
        p.name: os.readlink(p)
        if p.is_symlink()
        else sorted(os.listdir(p))
        if p.is_dir()
        else p.read_text()
        for p in tmp.iterdir()
    }


def test_a_killed_local_build_leaves_scratch_the_next_build_sweeps(tmp_path: Path) -> None:
    raw, out, tmp = _raw_for_kill(tmp_path), tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    _kill_stalled_build(raw, out, tmp, finished=2)
    left = [p.name for p in tmp.iterdir()]
    assert len(left) == 1 and left[0].startswith("shardprep-build-"), left
    assert (tmp / left[0] / "shardprep.lock").is_file()
    holder = _decoys(tmp)
    decoys = {k: v for k, v in _tmp_state(tmp).items() if k != left[0]}
    try:
        result = _build_cli(
            str(raw), str(out), "-n", str(SHARDS), "--workers", "1", "--resume", tmpdir=tmp
        )
        assert result.returncode == 0, result.stderr
        assert _tmp_state(tmp) == decoys  # the killed build's folder alone is gone
    finally:
        holder.close()


def test_a_killed_s3_build_leaves_staging_the_next_build_sweeps(tmp_path: Path) -> None:
    pytest.importorskip("s3fs")
    from tests.s3 import S3Server

    raw, tmp = _raw_for_kill(tmp_path), tmp_path / "tmp"
    tmp.mkdir()
    with S3Server() as s3:
        s3.create_bucket("own")
        url = "s3://own/out"
        env = {**os.environ, **s3.environment(), "TMPDIR": str(tmp)}

        def staged() -> bool:
            return any(
                p.name.startswith("shardprep-staging-") and any(p.glob(".*.partial"))
                for p in tmp.iterdir()
            )

        options = {"shards": SHARDS, "workers": 1}
        kill_stalled_build(raw, url, PER_SHARD * 2, options, staged, tmp, s3.environment())
        left = sorted(p.name for p in tmp.iterdir())
        assert [name[:-8] for name in left] == ["shardprep-build-", "shardprep-staging-"], left
        holder = _decoys(tmp)
        decoys = {k: v for k, v in _tmp_state(tmp).items() if k not in left}
        try:
            result = run_bounded(
                [sys.executable, "-m", "shardprep", "build", str(raw), url, "-n", str(SHARDS)]
                + ["--workers", "1", "--resume", "--quiet"],
                timeout=120,
                env=env,
            )
            assert result.returncode == 0, result.stderr
            assert _tmp_state(tmp) == decoys  # both folders of the killed build are gone
        finally:
            holder.close()
