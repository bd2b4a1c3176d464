"""A reader alone in its process shares its local reads with one more thread
(one thread of its ``loader.io.executor.Executor``: ``loader.io.files.split_read_into`` and
``together``): a window's bytes in 1 MiB parts, a batch's samples one by one.

Pinned here: the bytes read are the file's, a read that meets the end of the file says how far
it got, a job the other thread has not taken when the caller is done is withdrawn (the caller
does not wait for a busy thread), small-sample epochs with windows read in parts are the
per-sample path's, and a shard truncated under such a read is named.
"""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

import shardprep
from loader import CorruptShardError, ShardDataset
from loader.io.executor import Executor
from loader.io.files import SPLIT_BYTES, THREAD_NAME, split_read_into, together
from tests.integration.test_localahead import _until, same


def _splits() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME + "-")]


def test_a_window_read_in_parts_is_the_files_bytes(tmp_path: Path) -> None:
    data = random.Random(1).randbytes(5 * SPLIT_BYTES + 12345)
    path = tmp_path / "blob"
    path.write_bytes(data)
    split = Executor(1, THREAD_NAME)
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, size in [(0, len(data)), (777, 3 * SPLIT_BYTES + 5), (100, SPLIT_BYTES)]:
            view = memoryview(bytearray(size))
            assert split_read_into(split, fd, view, offset) == size
            assert view.tobytes() == data[offset : offset + size]
        # past the end of the file: the bytes there are, and how many
        view = memoryview(bytearray(4 * SPLIT_BYTES))
        offset = len(data) - SPLIT_BYTES - 99
        assert split_read_into(split, fd, view, offset) == SPLIT_BYTES + 99
        assert view[: SPLIT_BYTES + 99].tobytes() == data[offset:]
        assert len(_splits()) == 1
    finally:
        split.close()
        os.close(fd)
    assert not _splits()


def test_a_job_the_busy_thread_has_not_taken_is_withdrawn() -> None:
    """The other thread is held inside a first job; a second caller does all of its own work
    and returns at once, without waiting for that thread (its job is withdrawn, never run)."""
    split = Executor(1, THREAD_NAME)
    release, holding = threading.Event(), threading.Event()

    def hold() -> bool:  # the first job: the other thread takes it and is held there
        if threading.current_thread().name.startswith(THREAD_NAME + "-"):
            holding.set()
            assert release.wait(30)
        else:  # (its caller waits until it is taken, so that it is not withdrawn)
            assert holding.wait(30)
        return True

    first = threading.Thread(target=together, args=(split, hold, 100))
    first.start()
    try:
        assert holding.wait(30)
        done: list[str] = []
        claim = iter(range(50))

        def work() -> bool:
            for i in claim:
                done.append(f"{threading.current_thread().name}:{i}")
            return True

        results: list[bool] = []
        second = threading.Thread(
            target=lambda: results.append(together(split, work, 50)), name="second"
        )
        second.start()
        second.join(10)  # (a caller that waited for the held thread would still be waiting)
        assert not second.is_alive()
        assert not release.is_set()
        assert results == [True]
        assert done == [f"second:{i}" for i in range(50)]  # all its work, none on the held one
    finally:
        release.set()
        first.join(30)
        split.close()
    assert not first.is_alive()
    assert not _splits()


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """600 samples of 6-10 KiB (small samples: windows read whole) in 2 plain shards."""
    base = tmp_path_factory.mktemp("small")
    rng = random.Random(3)
    for i in range(600):
        folder = base / "raw" / f"c{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:04d}.bin").write_bytes(rng.randbytes(rng.randrange(6 << 10, 10 << 10)))
    shardprep.build(str(base / "raw"), str(base / "out"), shards=2, workers=1, progress=False)
    return base / "out"


KW: dict[str, Any] = {
    "batch_size": 16,
    "shuffle_buffer_bytes": 3 << 20,
    "block_size": 256,
    "seed": 4,
}


def _epoch(batches: Any) -> list[tuple[list[str], bytes, list[int]]]:
    return [
        (list(b["__key__"]), b["bin"].data.numpy().tobytes(), b["bin"].offsets.tolist())
        for b in batches
    ]


def test_windows_read_in_parts_give_the_per_sample_paths_batches(small: Path) -> None:
    """In process the 3 MiB windows are read in 1 MiB parts on two threads; the per-sample
    path (a transform) reads them on one: every batch equal, byte for byte, over two epochs."""
    ds = ShardDataset(str(small), **KW)
    reference = ShardDataset(str(small), transform=same, **KW)
    orders = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        reference.set_epoch(epoch)
        it = iter(DataLoader(ds, batch_size=None))
        first = next(it)
        assert len(_splits()) == 1  # the reader's second thread, in process
        got = _epoch([first, *it])
        assert _until(lambda: not _splits())
        assert got == _epoch(DataLoader(reference, batch_size=None))
        keys = sorted(k for keys, _, _ in got for k in keys)
        assert len(keys) == len(set(keys)) == 600  # each sample once
        orders.append([keys for keys, _, _ in got])
    assert orders[0] != orders[1]


def test_a_shard_truncated_under_a_read_in_parts_is_named(small: Path, tmp_path: Path) -> None:
    import shutil

    out = tmp_path / "out"
    shutil.copytree(small, out)
    tar = out / "shard-00001.tar"
    size = tar.stat().st_size
    os.truncate(tar, size // 2)
    with pytest.raises(CorruptShardError, match=r"shard-00001\.tar: sample '.*' .*truncated"):
        for _ in ShardDataset(str(out), **KW):
            pass
    assert _until(lambda: not _splits())


def test_no_view_of_the_callers_buffer_is_kept(tmp_path: Path) -> None:
    """Once a read returns, neither thread holds a view of the caller's buffer (a window
    buffer is reused, and a batch buffer recycled, only once no view of it is left: a view
    kept by the other thread's last job doubled the `small` epoch's window memory)."""
    path = tmp_path / "blob"
    path.write_bytes(random.Random(2).randbytes(4 * SPLIT_BYTES))
    split = Executor(1, THREAD_NAME)
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(3):
            buffer = bytearray(4 * SPLIT_BYTES)
            view = memoryview(buffer)  # (as the reader's pool hands it out: not released)
            assert split_read_into(split, fd, view, 0) == 4 * SPLIT_BYTES
            del view
            buffer.extend(b"x")  # BufferError while any view of it is alive
    finally:
        split.close()
        os.close(fd)


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_one_window_buffer_serves_the_whole_epoch(
    small: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """An epoch of many windows of small samples (each under the 1 MiB buffer the first one
    gets) allocates one window buffer per process, in process and in workers: the previous
    window is let go before the next is read, so the pool reuses its buffer (a batch loop
    that kept the last batch's window while reading the next allocated a second one, and
    peaked 16 MiB higher on `small`)."""
    import multiprocessing

    from loader.io import ranges

    allocated = multiprocessing.Value("i", 0)  # (shared: workers count in it too)
    real = ranges.allocate

    def counting(size: int) -> Any:
        with allocated.get_lock():
            allocated.value += 1
        return real(size)

    monkeypatch.setattr(ranges, "allocate", counting)
    kw = {"batch_size": 16, "shuffle_buffer_bytes": 512 << 10, "block_size": 32, "seed": 1}
    n = sum(
        len(b["__key__"])
        for b in DataLoader(ShardDataset(str(small), **kw), batch_size=None, num_workers=workers)
    )
    assert n == 600
    assert allocated.value == max(workers, 1)  # (a window kept while the next is read: 2 each)
