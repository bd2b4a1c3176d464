"""The time to the first batch of a remote epoch: the first group is planned without waiting for
the next shard's index, and the read-ahead threads (``loader.io.executor.Executor``) start
without holding up the reader, all of them, and stop on close even while they are still being
started."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from loader.io.executor import Executor
from loader.io.readahead import THREAD_NAME
from loader.plan.reads import Read, plan_groups

DEADLINE_S = 60.0


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
    pool = Executor(16, THREAD_NAME)
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
    pool = Executor(16, THREAD_NAME)
    job = pool.submit(lambda: round_)
    pool.close()
    assert _pool_threads() == []
    assert not job.done.is_set() or job.value == round_ or "closed" in str(job.error)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(lambda: 0)
