"""The time to the first batch of a remote epoch: the first window comes in over every request
in flight, the first group is planned without waiting for the next shard's index, and the
read-ahead threads start without holding up the reader (against a real S3 server, moto, through
the counting proxy of ``tests.s3``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("obstore")

import shardprep  # noqa: E402
from loader.prefetch import (  # noqa: E402
    MIN_FIRST_PART_BYTES,
    THREAD_NAME,
    Read,
    ReadAhead,
    _Pool,
    first_part_bytes,
    plan_groups,
)
from loader.source import RemoteOptions, Source  # noqa: E402
from tests.conftest import write_class_folders  # noqa: E402
from tests.s3 import Proxy, S3Server  # noqa: E402

MIB = 1 << 20
DEADLINE_S = 60.0


def _gets(proxy: Proxy, since: int, suffix: str) -> int:
    lines = [r.split("?")[0] for r in proxy.requests[since:]]
    return sum(1 for r in lines if r.startswith("GET ") and r.endswith(suffix))


@pytest.fixture(scope="module")
def big_shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One plain shard of several MiB (samples of up to ~1.6 MB)."""
    base = tmp_path_factory.mktemp("first_window")
    raw = write_class_folders(base / "raw", {"a": 14}, repeat=2000)
    shardprep.build(str(raw), str(base / "out"), shards=1, workers=1, progress=False)
    return base / "out"


def test_first_part_bytes() -> None:
    # the first 16 MiB window over 16 requests of 4 MiB: 16 parts of 1 MiB
    assert first_part_bytes(16 * MIB, 16, 4 * MIB) == MIB
    assert first_part_bytes(16 * MIB, 8, 8 * MIB) == 2 * MIB  # 2 workers: 8 of 2 MiB each
    assert first_part_bytes(16 * MIB + 1, 16, 4 * MIB) == MIB + 1  # rounded up, not a 17th
    assert first_part_bytes(MIB, 16, 4 * MIB) == MIN_FIRST_PART_BYTES  # not under a floor
    assert first_part_bytes(64 * MIB, 4, 8 * MIB) == 8 * MIB  # never over request_bytes
    assert first_part_bytes(0, 16, 4 * MIB) == 4 * MIB  # no first window: request_bytes


@pytest.mark.parametrize(("first_bytes", "first_gets"), [(2 * MIB, 4), (0, 1)])
def test_first_window_comes_in_on_every_request(
    s3: S3Server, bucket: str, proxy: Proxy, big_shard: Path, first_bytes: int, first_gets: int
) -> None:
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
    fs.put(str(big_shard), f"{bucket}/out", recursive=True)
    options = RemoteOptions(
        storage_options=s3.storage_options(proxy.endpoint), max_requests=4, request_bytes=2 * MIB
    )
    source = Source(f"s3://{bucket}/out", options)
    manifest = Source(str(big_shard)).manifest()
    entry = manifest.shards[0]
    assert entry.num_bytes > 4 * MIB
    local = (big_shard / entry.file).read_bytes()
    reads = [Read(0, 0, 2 * MIB), Read(0, 2 * MIB, 2 * MIB)]  # two windows of one request each
    since = len(proxy.requests)
    ahead = ReadAhead(source, manifest, iter(reads), [0], options, first_bytes=first_bytes)
    try:
        got = [bytes(ahead.read(r.shard, r.offset, r.size)) for r in reads]
    finally:
        ahead.close()
    assert got == [local[r.offset : r.stop] for r in reads]
    # the first window: 4 GETs of 512 KiB (one per request in flight), or one of 2 MiB
    assert _gets(proxy, since, "/" + entry.file) == first_gets + 1
    assert ahead.misses == 0


def test_a_read_larger_than_a_request_is_planned_at_once() -> None:
    """Its group goes out before the next read is drawn: drawing it may wait for an index."""
    drawn: list[int] = []

    def reads() -> Iterator[Read]:
        drawn.append(1)
        yield Read(0, 0, 10_000)
        drawn.append(2)
        yield Read(1, 0, 10)

    groups = plan_groups(reads(), 4096)
    first = next(groups)
    assert (first.shard, first.start, first.stop) == (0, 0, 10_000)
    assert drawn == [1]
    assert [(g.shard, g.start, g.stop) for g in groups] == [(1, 0, 10)]
    # a read that fits a request still waits for the next one (which may join its group)
    drawn.clear()
    small = plan_groups(iter([Read(0, 0, 100), Read(0, 100, 100)]), 4096)
    assert [(g.start, g.stop, len(g.reads)) for g in small] == [(0, 200, 2)]


def _pool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]


def _until(condition: object, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE_S} s: {what}")
        time.sleep(0.005)


def test_pool_starts_every_thread_and_close_stops_them() -> None:
    assert _pool_threads() == []
    pool = _Pool(16)
    release = threading.Event()
    running = threading.Semaphore(0)

    def job() -> int:
        running.release()
        release.wait(DEADLINE_S)
        return 1

    jobs = [pool.submit(job) for _ in range(16)]
    for _ in range(16):  # all 16 at once: every thread was started, each runs one
        assert running.acquire(timeout=DEADLINE_S)
    assert len(_pool_threads()) == 16
    release.set()
    for j in jobs:
        assert j.done.wait(DEADLINE_S) and j.value == 1
    pool.close()
    assert _pool_threads() == []


@pytest.mark.parametrize("round_", range(20))
def test_pool_closed_while_its_threads_start(round_: int) -> None:
    """close() right after the first submit: the starter may still be starting threads; none
    survives (a job still queued is dropped: nobody waits for it)."""
    pool = _Pool(16)
    job = pool.submit(lambda: round_)
    pool.close()
    assert _pool_threads() == []
    assert not job.done.is_set() or job.value == round_ or "closed" in str(job.error)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(lambda: 0)
