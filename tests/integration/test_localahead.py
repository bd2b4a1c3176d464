"""Local read-ahead (``loader.io.readahead.ReadAhead`` with a ``LocalFetch``, on the reader's
``loader.io.executor.Executor``): a local output's next window read on one thread, its samples
checked as they are handed out. Samples here average ~85 KiB (above ``AHEAD_SAMPLE_BYTES``), so every
window after the first is read ahead; windows of ~1 MiB hold several chunks and batches of 5
span windows. The thread serves the per-sample path (a ``transform``, or ``decode``: ``KW``
has an identity transform); the batch path of such an output reads each batch's samples
itself (``loader.torch.scatter``, tests/faults/test_hunt_scatter.py). What must hold: the batches
are exactly the ones made without the thread (and the files' bytes), in the same order; a damaged sample is named (shard and key) at the batch
that holds it; ``on_error="skip"`` is unchanged; no thread before the first read, none after
the iteration ends, is abandoned or raises; it works inside DataLoader workers."""

from __future__ import annotations

import gc
import random
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import shardprep
from loader import CorruptShardError, ReadOptions, ShardDataset
from loader.core import ShardStream
from loader.io.files import THREAD_NAME
from loader.io.ranges import BufferPool
from loader.io.readahead import ReadAhead
from loader.plan.reads import window_plan
from loader.plan.windows import plan_windows
from loader.torch.batch import Packed
from shardprep.format.errors import ChecksumMismatchError
from shardprep.format.shardformat import decode_index


def same(sample: dict[str, Any]) -> dict[str, Any]:
    """The identity transform: selects the per-sample path, the one the thread serves."""
    return sample


# the batch path, which reads each batch itself (no thread); KW: the per-sample path (thread)
BATCH_KW: dict[str, Any] = {"batch_size": 5, "shuffle_buffer_bytes": 1 << 20, "block_size": 8}
KW: dict[str, Any] = {**BATCH_KW, "transform": same}


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """90 samples of a 70-100 KiB ``.jpg`` and a short ``.txt``, in 3 plain shards; and the
    raw ``.jpg`` bytes by key."""
    base = tmp_path_factory.mktemp("large")
    raw = base / "raw"
    raw.mkdir()
    rng = random.Random(7)
    jpgs = {}
    for i in range(90):
        key = f"{i:03d}"
        jpgs[key] = rng.randbytes(rng.randrange(70 << 10, 100 << 10))
        (raw / f"{key}.jpg").write_bytes(jpgs[key])
        (raw / f"{key}.txt").write_bytes(b"caption %d" % i)
    shardprep.build(str(raw), str(base / "out"), shards=3, workers=1, progress=False,
                    input_format="keyed")  # fmt: skip
    return base / "out", jpgs


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME + "-")]


def _until(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _keys_and_jpgs(batch: dict[str, Any]) -> list[tuple[str, bytes]]:
    return list(zip(list(batch["__key__"]), batch["jpg"].tolist(), strict=True))


def test_batches_are_the_sample_paths_and_the_files_bytes(
    large: tuple[Path, dict[str, bytes]],
) -> None:
    """Read ahead (``KW``), without the thread (mapped reads), and the batch path: the same
    batches."""
    out, jpgs = large
    for epoch in range(2):
        ahead = ShardDataset(str(out), **KW)
        mapped = ShardDataset(str(out), **KW, read=ReadOptions(mapped=True))  # no thread
        batched = ShardDataset(str(out), **BATCH_KW)  # (read by loader.torch.scatter)
        for ds in (ahead, mapped, batched):
            ds.set_epoch(epoch)
        it = iter(ahead)
        got = [next(it)]
        assert len(_threads()) == 1  # these batches do come through the thread
        got.extend(it)
        for want in (list(mapped), list(batched)):
            assert len(got) == len(want) == 18
            for a, b in zip(got, want, strict=True):
                assert list(a) == list(b)
                for field in ("jpg", "txt"):
                    assert isinstance(a[field], Packed)
                    assert torch.equal(a[field].data, b[field].data)
                    assert torch.equal(a[field].offsets, b[field].offsets)
                assert list(a["__key__"]) == list(b["__key__"])
        seen = [pair for batch in got for pair in _keys_and_jpgs(batch)]
        assert sorted(seen) == sorted(jpgs.items())  # every sample once, its own bytes
    assert _until(lambda: not _threads())


def test_a_resumed_stream_is_the_rest_of_the_whole(large: tuple[Path, dict[str, bytes]]) -> None:
    out, _ = large
    stream = ShardStream(str(out), **KW)
    whole = [list(b["__key__"]) for b in stream.iterate(1)]
    for start in (1, 4, 17):
        assert [list(b["__key__"]) for b in stream.iterate(1, start=start)] == whole[start:]


def test_no_thread_before_the_first_read_none_after_the_end(
    large: tuple[Path, dict[str, bytes]],
) -> None:
    out, _ = large
    ds = ShardDataset(str(out), **KW)
    it = iter(DataLoader(ds, batch_size=None, num_workers=0))
    assert not _threads()
    next(it)
    assert len(_threads()) == 1  # the window after the first is being read ahead
    for _ in it:
        pass
    assert _until(lambda: not _threads())


@pytest.mark.parametrize("how", ["close", "abandon", "break"])
def test_the_thread_stops_when_the_iteration_is_left(
    large: tuple[Path, dict[str, bytes]], how: str
) -> None:
    out, _ = large
    ds = ShardDataset(str(out), **KW)
    if how == "break":
        for n, _batch in enumerate(ds):
            if n == 2:
                assert len(_threads()) == 1
                break
    elif how == "close":
        items = ShardStream(str(out), **KW).iterate(0)
        next(items)
        assert len(_threads()) == 1
        items.close()  # type: ignore[attr-defined]
        assert not _threads()  # joined by close, not later
    else:
        it = iter(ds)
        next(it)
        assert len(_threads()) == 1
        del it
    gc.collect()
    assert _until(lambda: not _threads())


def _damage(out: Path, shard: int, sample: int) -> str:
    """Flip a byte of the ``.jpg`` data of ``sample`` of ``shard``; its key."""
    index = decode_index((out / f"shard-{shard:05d}.idx").read_bytes(), "idx")
    member = next(
        m
        for m in range(int(index.member_start[sample]), int(index.member_start[sample + 1]))
        if index.exts[int(index.member_ext[m])] == "jpg"
    )
    with open(out / f"shard-{shard:05d}.tar", "r+b") as f:
        f.seek(int(index.member_offset[member]) + 1000)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    return index.key(sample)


@pytest.mark.parametrize(("shard", "sample"), [(0, 0), (1, 17), (2, 29)])
def test_a_damaged_sample_is_named_at_the_batch_that_holds_it(
    large: tuple[Path, dict[str, bytes]], tmp_path: Path, shard: int, sample: int
) -> None:
    clean, _ = large
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    key = _damage(out, shard, sample)
    order = [list(b["__key__"]) for b in ShardDataset(str(clean), **KW)]
    holding = next(i for i, keys in enumerate(order) if key in keys)
    errors = []
    for kw in (KW, BATCH_KW):  # read ahead, and the batch path (loader.torch.scatter)
        got = []
        with pytest.raises(CorruptShardError) as info:
            for batch in ShardDataset(str(out), **kw):
                got.append(list(batch["__key__"]))
        assert got == order[:holding]  # every batch before it, then the error
        errors.append(str(info.value))
        assert _until(lambda: not _threads())
    assert errors[0] == errors[1]
    assert f"shard-{shard:05d}.tar" in errors[0] and key in errors[0]
    assert "checksum mismatch" in errors[0]


def test_skip_stands_in_for_a_damaged_sample(
    large: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    clean, _ = large
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    key = _damage(out, 1, 5)
    kwargs = {**KW, "read": ReadOptions(on_error="skip")}
    want = [list(b["__key__"]) for b in ShardDataset(str(clean), **KW)]
    got = list(ShardDataset(str(out), **kwargs))
    assert len(got) == len(want)
    flat_want = [k for keys in want for k in keys]
    flat_got = [k for b in got for k in b["__key__"]]
    padded = [p for b in got for p in b["__padded__"].tolist()]
    at = flat_want.index(key)
    assert key not in flat_got and padded.count(True) == 1 and padded[at]
    assert flat_got[:at] + flat_got[at + 1 :] == flat_want[:at] + flat_want[at + 1 :]


def test_a_truncated_shard_names_the_first_missing_sample(
    large: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    clean, _ = large
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    index = decode_index((out / "shard-00002.idx").read_bytes(), "idx")
    cut = int(index.sample_offset[20]) + 100
    with open(out / "shard-00002.tar", "r+b") as f:
        f.truncate(cut)
    with pytest.raises(CorruptShardError) as info:  # (in shard order: that read comes first)
        list(ShardDataset(str(out), **KW, shuffle=False))
    assert "shard-00002.tar" in str(info.value) and index.key(20) in str(info.value)
    assert "truncated" in str(info.value)
    (out / "shard-00001.tar").unlink()
    with pytest.raises(CorruptShardError, match="shard file is missing"):
        list(ShardDataset(str(out), **KW, shuffle=False))
    assert _until(lambda: not _threads())


def test_workers_read_ahead_in_their_own_process(large: tuple[Path, dict[str, bytes]]) -> None:
    out, jpgs = large
    ds = ShardDataset(str(out), **KW)
    seen = []
    for batch in DataLoader(ds, batch_size=None, num_workers=2):
        assert not _threads()  # never in the process that forks the workers
        seen.extend(_keys_and_jpgs(batch))
    assert sorted(seen) == sorted(jpgs.items())


def test_the_reader_starts_its_thread_when_it_reads_ahead(
    large: tuple[Path, dict[str, bytes]],
) -> None:
    """No thread until the first read (a DataLoader may still fork the process that made the
    reader); from the first read on, one, reading the window's parts that the iterating thread
    has not taken and the next window; none once the reader is closed. The reads are served in
    plan order, none missed."""
    out, _ = large
    stream = ShardStream(str(out), **KW)
    pieces = stream.order(0)
    plan = window_plan(pieces, 0, stream.shuffle_buffer, stream.shuffle_buffer_bytes)
    reader = stream.reader(0, BufferPool(), plan, local_ahead=True)
    try:
        assert isinstance(reader.io, ReadAhead)
        assert not _threads()  # made, nothing read: a DataLoader may still fork
        windows = plan_windows(pieces, reader.sample_sizes, 8192, 1 << 20)
        window = next(windows)
        assert not _threads()
        chunks = [reader.read(piece) for piece in window]
        assert len(_threads()) == 1  # reading ahead since the first read
        assert [len(c) for c in chunks] == [len(p) for p in window]
        chunks = [reader.read(piece) for piece in next(windows)]
        assert reader.io.misses == 0
    finally:
        reader.close()
    assert not _threads()


def test_a_damaged_index_is_raised_where_its_shard_is_read(
    large: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    """Planning the window ahead reads the next shard's index: its error must come when that
    window is read (as without the thread: mapped reads), not a window early."""
    clean, _ = large
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    index = out / "shard-00002.idx"
    data = bytearray(index.read_bytes())
    data[-1] ^= 0xFF
    index.write_bytes(bytes(data))
    counts = []
    for read in (ReadOptions(), ReadOptions(mapped=True)):
        got = []
        with pytest.raises(ChecksumMismatchError, match="shard-00002.idx"):
            for batch in ShardDataset(str(out), **KW, shuffle=False, read=read):
                got.append(list(batch["__key__"]))
        counts.append(len(got))
    assert counts[0] == counts[1] > 0
    assert _until(lambda: not _threads())
