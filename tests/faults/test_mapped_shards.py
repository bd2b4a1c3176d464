"""Mapped shards (loader/read/reader.py): local plain shards are read through ``mmap``.

A window's bytes are views of a read-only mapping of the shard, handed out exactly as the
``read()`` path hands them out. A shard that is not the file the manifest describes (another
size at its opening, or changed since: ``fstat``) is never mapped: a truncated one is named
with its shard and the first sample it lacks. A shard truncated while a mapping of it is alive
kills the reading process with SIGBUS: the documented failure mode, checked here in a child;
Without ``mapped`` the reader uses ``read()``, and the same child then survives.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import signal
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from loader import CorruptShardError, ReadOptions, ShardDataset
from loader.io.ranges import BufferPool
from loader.io.source import Source
from loader.plan.order import SampleRange
from loader.read.reader import ShardReader
from tests.faults.shard_surgery import copy_output, index_of
from tests.processes import run_bounded

SHARD = 4  # conftest ``built``: 103 samples in 8 plain shards (12 or 13 each)
ROOT = str(Path(__file__).resolve().parents[2])


def _reader(out: Path) -> ShardReader:
    source = Source(str(out))
    return ShardReader(source, source.manifest(), pool=BufferPool(), read=ReadOptions(mapped=True))


def _child(action: str, out: Path, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    result = run_bounded(
        [sys.executable, "-m", "tests.faults.mapped_child", action, str(out), str(SHARD)],
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    return result.returncode, result.stdout.splitlines()


def _epoch(out: Path, mapped: bool = True) -> list[tuple[str, bytes]]:
    """(key, payload) of every sample of one shuffled epoch, in order, from the batch path."""
    got = []
    read = ReadOptions(mapped=mapped)
    for batch in ShardDataset(str(out), seed=3, batch_size=5, read=read):
        packed = batch["bin"]
        offsets = packed.offsets.tolist()
        data = packed.data.numpy().tobytes()
        for k, key in enumerate(batch["__key__"]):
            got.append((str(key), data[offsets[k] : offsets[k + 1]]))
    return got


def test_a_window_is_a_view_of_the_shard_mapped(built: Path) -> None:
    reader = _reader(built)
    index = reader.index(SHARD)
    chunk = reader.read(SampleRange(SHARD, 2, 9))
    data = chunk._data
    assert isinstance(data, memoryview) and isinstance(data.obj, mmap.mmap) and data.readonly
    begin, end = int(index.sample_offset[2]), int(index.sample_offset[9])
    tar = (built / f"shard-{SHARD:05d}.tar").read_bytes()
    assert data.tobytes() == tar[begin:end]  # exactly the range, from an unaligned start
    with tarfile.open(built / f"shard-{SHARD:05d}.tar") as archive:
        members = {m.name: archive.extractfile(m).read() for m in archive}  # type: ignore[union-attr]
    for j in range(7):
        sample = chunk.sample(j)
        assert sample["bin"] == members[f"{index.key(2 + j)}.bin"]
    reader.close()


def test_mapped_and_read_epochs_are_the_same(built: Path) -> None:
    mapped = _epoch(built)
    read = _epoch(built, mapped=False)
    assert len(mapped) == 103 and len({k for k, _ in mapped}) == 103
    assert mapped == read  # same order, same bytes


def test_a_shard_larger_than_its_manifest_says_is_read_not_mapped(
    built: Path, tmp_path: Path
) -> None:
    out = copy_output(built, tmp_path / "out")
    expected = _epoch(out)
    with open(out / f"shard-{SHARD:05d}.tar", "ab") as f:
        f.write(b"\0" * 10240)
    reader = _reader(out)
    chunk = reader.read(SampleRange(SHARD, 0, 3))
    assert isinstance(chunk._data, memoryview) and not chunk._data.readonly  # a read buffer
    reader.close()
    assert _epoch(out) == expected


def test_a_shard_truncated_between_reads_is_named_not_mapped(built: Path, tmp_path: Path) -> None:
    out = copy_output(built, tmp_path / "out")
    index = index_of(out, SHARD)
    code, lines = _child("truncate-between", out)
    assert code == 0, lines
    shard = out / f"shard-{SHARD:05d}.tar"
    cut = int(index.sample_offset[3]) + 100
    assert lines == [
        "mapped",
        f"raised {shard}: sample {index.key(3)!r} at offset {int(index.sample_offset[3])}: "
        f"the shard is truncated: it ends at byte {cut}; run `shardprep verify` on the output "
        "folder and rebuild or restore the shard",
        f"first {[index.key(0), index.key(1)]}",
    ]


def test_a_shard_truncated_while_mapped_kills_the_reader_with_sigbus(
    built: Path, tmp_path: Path
) -> None:
    """The documented failure mode: no exception can come of it, the process dies."""
    out = copy_output(built, tmp_path / "out")
    code, lines = _child("truncate-while-mapped", out)
    assert code == -signal.SIGBUS, (code, lines)
    assert lines == ["mapped"]


def test_with_mapping_off_a_shard_truncated_after_its_read_is_served_as_read(
    built: Path, tmp_path: Path
) -> None:
    out = copy_output(built, tmp_path / "out")
    tar = (out / f"shard-{SHARD:05d}.tar").read_bytes()
    end = int(index_of(out, SHARD).sample_offset[-1])
    code, lines = _child("truncate-while-mapped", out, {"MAPPED_CHILD_MAPS": "0"})
    assert code == 0, lines
    assert lines == ["read", f"survived {hashlib.sha256(tar[:end]).hexdigest()}"]


def test_a_shard_replaced_by_rename_keeps_the_mapped_bytes(built: Path, tmp_path: Path) -> None:
    """The build's own way to replace a file (a temporary one renamed over it) leaves a live
    mapping the old file's bytes; a reader opening the shard afterwards gets the new file,
    and a damaged sample in it is named."""
    out = copy_output(built, tmp_path / "out")
    path = out / f"shard-{SHARD:05d}.tar"
    index = index_of(out, SHARD)
    original = path.read_bytes()
    reader = _reader(out)
    chunk = reader.read(SampleRange(SHARD, 0, 6))
    damaged = bytearray(original)
    member = int(index.member_start[7])
    damaged[int(index.member_offset[member])] ^= 0xFF  # one data byte of sample 7
    (out / "replacement").write_bytes(bytes(damaged))
    os.replace(out / "replacement", path)
    assert chunk._data.tobytes() == original[: int(index.sample_offset[6])]
    rest = reader.read(SampleRange(SHARD, 6, 9))  # the open file: still the old one
    assert [rest.sample(j)["__key__"] for j in range(3)] == [index.key(j) for j in (6, 7, 8)]
    reader.close()
    fresh = _reader(out)
    again = fresh.read(SampleRange(SHARD, 6, 9))
    with pytest.raises(CorruptShardError) as err:
        again.sample(1)
    assert (err.value.shard, err.value.key) == (str(path), index.key(7))
    assert np.array_equal(
        np.frombuffer(again._data, np.uint8)[:10],
        np.frombuffer(damaged, np.uint8)[
            int(index.sample_offset[6]) : int(index.sample_offset[6]) + 10
        ],
    )
    fresh.close()
