"""Read-ahead: a worker fetches the ranges it will read next, concurrently, in bounded memory.

The epoch order is a pure function of (seed, epoch), so a worker knows its
whole read schedule before it reads anything: the windows of
``loader.plan.windows.plan_windows`` over its pieces, each window one read per
piece (``ShardReader.span``). ``planned_reads`` replays exactly that plan (the
same windows, the same resume skip); ``plan_groups`` coalesces adjacent reads
of one shard into groups of at most ``request_bytes``; ``ReadAhead`` keeps
up to ``max_requests`` ranged GETs in flight on its own threads, at most
``read_ahead_bytes`` fetched or being fetched beyond the read being served,
and hands the bytes to the ``ShardReader`` (``read.RangeIO``) in plan order
(``concurrency``: with ``max_requests=None``, 16 requests per DataLoader split between its
workers, the budget divided between them: 16 of 4 MiB in process, 8 of 8 MiB in 2 workers).
The bytes are the same, in the same order: checksums are verified downstream
as without read-ahead.

``read_ahead(source, manifest, plan)`` is the seam: it gives ``ShardReader``'s
constructor the factory of its ``RangeIO`` (``None`` for a local output, or
with neither read-ahead nor cache). A ``ReadPlan`` says what the reader will
read: ``window_plan`` the windows of a ``ShardStream`` slot, ``piece_plan``
each piece whole in the order given (a mixture source's batches, drawn lazily
so that no list as long as the epoch is built).

Per worker, memory is one window (``shuffle_buffer_bytes``) plus
``read_ahead_bytes`` (plus one request when a single read is larger).

Threads start at the first read, inside the DataLoader worker (never in the
process that forks it) and stop in ``close()`` (iterator end, close or an
exception). Every wait has a deadline, and a failed fetch raises its error
when its bytes are asked for, naming the file.

With a local cache (``loader.io.cache``) a group's job is to make its shard
present in the cache (downloading it whole, once per node) and to pin it;
reads are then ``pread`` calls on the cached file.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

from loader.errors import UnreachableError
from loader.io.options import RemoteOptions
from loader.io.ranges import RangeIO
from loader.io.source import Source, worst_case_s
from loader.plan.reads import Group, Read, ReadPlan, Spans, plan_groups
from shardprep.format.manifest import Manifest

__all__ = ["ReadAhead", "concurrency", "read_ahead"]

log = logging.getLogger(__name__)

INDEX_AHEAD = 4  # index files fetched ahead of the shards being planned
AUTO_REQUESTS = 16  # max_requests=None: requests in flight per DataLoader, split between workers
MIN_AUTO_REQUESTS = 4  # ... and at least this many per worker
MIN_AUTO_REQUEST_BYTES = 1 << 20  # ... of at least this size (or request_bytes when smaller)
WAIT_SLACK_S = 5.0  # beyond a fetch's own worst case, so that its error (naming why) comes first
JOIN_TIMEOUT_S = 5.0  # close() waits this long for each thread's current request
THREAD_NAME = "shardprep-read-ahead"


def concurrency(options: RemoteOptions, workers: int) -> tuple[int, int]:
    """(requests in flight, bytes per request) of one worker's read-ahead, of ``workers``.

    ``max_requests`` given: it and ``request_bytes``, per worker. ``None``: ``AUTO_REQUESTS``
    split between the workers (at least ``MIN_AUTO_REQUESTS`` each), each request at most
    ``read_ahead_bytes`` over that count (not under ``MIN_AUTO_REQUEST_BYTES``): the budget is spent on as many connections as it
    holds (a paced link gives each connection its share; one process alone needs more of
    them), and workers together keep the node's count (fewer, larger requests each).
    """
    if options.max_requests is not None:
        return options.max_requests, options.request_bytes
    requests = max(MIN_AUTO_REQUESTS, AUTO_REQUESTS // max(1, workers))
    share = max(MIN_AUTO_REQUEST_BYTES, options.read_ahead_bytes // requests)
    return requests, min(options.request_bytes, share)


def dataloader_workers() -> int:
    """The number of workers of the torch DataLoader this process is a worker of, else 1
    (torch is not imported for this: a process that never imported it is no such worker)."""
    data = sys.modules.get("torch.utils.data")
    info = None if data is None else data.get_worker_info()
    return 1 if info is None else int(info.num_workers)


class _Job:
    """A unit of work for the pool: its result, or its error, once done."""

    __slots__ = ("done", "error", "fn", "value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as err:  # handed to the consumer, which re-raises it
            self.error = err
        finally:
            self.done.set()


class _Pool:
    """A few daemon threads running jobs by priority, then in submission order.

    The first submit starts one thread, which starts the others before taking jobs: the
    thread that submits (the reader) is not held up starting them one by one (each start
    waits for the new thread to run, behind the GIL of the ones already fetching).
    """

    def __init__(self, threads: int) -> None:
        self._size = threads
        # (priority, sequence, job): index files (0) before data (1), else first come first served
        self._queue: queue.PriorityQueue[tuple[int, int, _Job | None]] = queue.PriorityQueue()
        self._sequence = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []  # started ones, the starter first
        self._started = False
        self._closed = threading.Event()
        # (still there when an epoch's generator is closed at interpreter exit, after the
        # modules' globals are gone: the daemon threads then end with the process)
        self._finalizing = sys.is_finalizing

    def submit(self, fn: Callable[[], Any], priority: int = 1) -> _Job:
        if self._closed.is_set():
            raise RuntimeError("read-ahead is closed")
        job = _Job(fn)
        self._sequence += 1
        self._queue.put((priority, self._sequence, job))
        if not self._started:
            self._start(0)  # raises (and the read with it) when not even one thread starts
            self._started = True
        return job

    def _start(self, i: int) -> None:
        thread = threading.Thread(target=self._work, args=(i,), name=f"{THREAD_NAME}-{i}")
        thread.daemon = True
        with self._lock:
            thread.start()
            self._threads.append(thread)

    def _work(self, i: int) -> None:
        if i == 0:  # the starter: the other threads first, then jobs like them
            for k in range(1, self._size):
                if self._closed.is_set():
                    break
                try:
                    self._start(k)
                except RuntimeError as err:  # "can't start new thread": fewer threads, slower
                    log.warning("read-ahead: %d of %d threads (%s)", k, self._size, err)
                    break
        while True:
            job = self._queue.get()[2]
            if job is None or self._closed.is_set():
                if job is not None:
                    job.error = RuntimeError("read-ahead closed before this job ran")
                    job.done.set()
                return
            job.run()

    def close(self) -> None:
        """Drop queued jobs and stop every thread (each after its current job, bounded)."""
        self._closed.set()
        if self._finalizing():
            return  # nothing to wake or wait for: the interpreter is ending
        for i in range(self._size):  # one for each thread there is or may still be started
            self._queue.put((-1, i, None))  # ahead of every job
        with self._lock:
            starter = self._threads[:1]
        for thread in starter:  # no thread is started after the starter has ended
            thread.join(JOIN_TIMEOUT_S)
        with self._lock:
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join(JOIN_TIMEOUT_S)
            if thread.is_alive():
                log.warning("%s still busy with a request %.0f s after close", thread.name, 5.0)


class _Pending:
    """A submitted group: its jobs and how many of its reads remain.

    ``parts`` are ``(file offset, job)``: a streamed group is fetched as parts of at most
    ``request_bytes`` in parallel (bytes); a cached group is one job (a pinned file, or the
    group's bytes when the cache had no room).
    """

    __slots__ = ("cost", "group", "parts", "remaining")

    def __init__(self, group: Group, parts: list[tuple[int, _Job]], cost: int) -> None:
        self.group, self.parts, self.cost = group, parts, cost
        self.remaining = len(group.reads)


class ReadAhead:
    """A ``read.RangeIO`` that fetches planned reads ahead on a few threads (see the module doc)."""

    def __init__(
        self,
        source: Source,
        manifest: Manifest,
        reads: Iterator[Read],
        shard_order: Iterable[int],
        options: RemoteOptions,
        cache: Any = None,
    ) -> None:
        self._source, self._manifest, self._options = source, manifest, options
        requests, self._request_bytes = concurrency(options, dataloader_workers())
        self._groups = plan_groups(reads, self._request_bytes)
        self._cache = cache  # a loader.io.cache.ShardCache, or None: stream into memory
        self._pool = _Pool(requests)
        self._pending: deque[_Pending] = deque()
        self._budget = 0  # bytes held or in flight ahead (see _cost)
        self._pinned: dict[int, int] = {}  # cache mode: outstanding groups per shard
        self._exhausted = False
        self._upcoming = iter(shard_order)  # drawn lazily: it may be a walk of the epoch's plan
        self._order: list[int] = []  # the distinct shards drawn so far, in order of first use
        self._position: dict[int, int] = {}  # shard -> its place in _order
        self._next_index = 0
        self._index_jobs: dict[int, _Job] = {}
        self._closed = False
        self.misses = 0  # reads that were not the next planned one (served directly)

    # --- RangeIO --------------------------------------------------------------------

    def index_bytes(self, shard: int) -> bytes:
        """The index file of ``shard``: fetched ahead when it is among the next shards."""
        self._prefetch_indexes(shard)
        job = self._index_jobs.pop(shard, None)
        if job is None:
            data: bytes = self._fetch_index(shard)
            return data
        entry = self._manifest.shards[shard]
        return self._wait(job, entry.index_file, entry.index_bytes)  # type: ignore[no-any-return]

    def read(self, shard: int, offset: int, size: int) -> bytes:
        """The next planned read's bytes (fetched ahead); any other read is made directly."""
        self._top_up()
        head = self._pending[0] if self._pending else None
        want = Read(shard, offset, size)
        if head is None or head.group.reads[len(head.group.reads) - head.remaining] != want:
            self.misses += 1  # a plan that diverged from the reader: correct, but slow
            log.warning("read-ahead: %s was not the planned next read; reading it directly", want)
            return self._direct(want)
        try:
            data = self._gather(head, want)
        finally:
            head.remaining -= 1
            if head.remaining == 0:
                self._release(self._pending.popleft())
        self._top_up()
        return data

    def close(self) -> None:
        """Stop the threads and unpin every cached file; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.close()
        while self._pending:
            self._release(self._pending.popleft())

    # --- planning -------------------------------------------------------------------

    def _top_up(self) -> None:
        """Submit groups until ``read_ahead_bytes`` are ahead (always at least one group)."""
        limit = self._options.read_ahead_bytes
        while (
            not self._exhausted and not self._closed and (not self._pending or self._budget < limit)
        ):
            group = next(self._groups, None)
            if group is None:
                self._exhausted = True
                return
            cost = self._cost(group)
            self._budget += cost
            self._pending.append(_Pending(group, self._submit(group), cost))

    def _cost(self, group: Group) -> int:
        """Memory held for a streamed group; for a cached one, its shard's bytes once per shard."""
        if self._cache is None:
            return group.stop - group.start
        count = self._pinned.get(group.shard, 0)
        self._pinned[group.shard] = count + 1
        return 0 if count else self._manifest.shards[group.shard].num_bytes

    def _release(self, pending: _Pending) -> None:
        self._budget -= pending.cost
        if self._cache is not None:
            count = self._pinned[pending.group.shard] - 1
            if count:
                self._pinned[pending.group.shard] = count
            else:
                del self._pinned[pending.group.shard]
        for _, job in pending.parts:
            if job.done.is_set() and job.value is not None and not isinstance(job.value, bytes):
                job.value.close()  # unpin a cached file (a job still running at close: GC does)

    def _prefetch_indexes(self, current: int) -> None:
        """Fetch ahead the index files of the next ``INDEX_AHEAD`` shards after ``current``."""
        if current not in self._position:
            self._draw(lambda: current in self._position)
        at = self._position.get(current, -1)
        if at >= self._next_index:
            self._next_index = at + 1
        self._draw(lambda: len(self._order) >= self._next_index + INDEX_AHEAD)
        for shard in self._order[self._next_index : self._next_index + INDEX_AHEAD]:
            if shard not in self._index_jobs and not self._closed:
                self._index_jobs[shard] = self._pool.submit(
                    partial(self._fetch_index, shard), priority=0
                )

    def _draw(self, enough: Callable[[], bool]) -> None:
        """Draw distinct shards from the shard order until ``enough()`` or it ends."""
        while not enough():
            shard = next(self._upcoming, None)
            if shard is None:
                return
            if shard not in self._position:
                self._position[shard] = len(self._order)
                self._order.append(shard)

    # --- fetching (pool threads) -----------------------------------------------------

    def _fetch_index(self, shard: int) -> bytes:
        entry = self._manifest.shards[shard]
        if self._cache is not None:
            cached = self._cache.read_index(entry)
            if cached is not None:
                return cached  # type: ignore[no-any-return]
        return self._source.read_bytes(entry.index_file, limit=entry.index_bytes)

    def _submit(self, group: Group) -> list[tuple[int, _Job]]:
        """The group's jobs: its parts (streaming), or its shard made present in the cache."""
        entry = self._manifest.shards[group.shard]
        stop = min(group.stop, entry.num_bytes)
        if self._cache is not None:
            cache = self._cache

            def cached() -> Any:
                pinned = cache.open(entry)
                if pinned is not None:
                    return pinned
                return (
                    self._source.fetch(entry.file, group.start, stop) if stop > group.start else b""
                )

            return [(group.start, self._pool.submit(cached))]
        step = self._request_bytes
        starts = range(group.start, max(stop, group.start + 1), step)
        return [
            (
                start,
                self._pool.submit(partial(self._fetch, entry.file, start, min(start + step, stop))),
            )
            for start in starts
        ]

    def _fetch(self, name: str, start: int, stop: int) -> bytes:
        return self._source.fetch(name, start, stop) if stop > start else b""

    def _direct(self, read: Read) -> bytes:
        entry = self._manifest.shards[read.shard]
        return self._source.fetch(entry.file, read.offset, read.stop) if read.size else b""

    # --- consuming ------------------------------------------------------------------

    def _gather(self, pending: _Pending, read: Read) -> bytes:
        """The bytes of ``read`` from its group's parts (waiting for the ones it needs)."""
        name = self._manifest.shards[read.shard].file
        parts = pending.parts
        chunks: list[bytes] = []
        for i, (start, job) in enumerate(parts):
            end = parts[i + 1][0] if i + 1 < len(parts) else pending.group.stop
            if end <= read.offset and i + 1 < len(parts):
                continue
            if start >= read.stop and chunks:
                break
            value = self._wait(job, name, end - start)
            if not isinstance(value, bytes):  # a pinned cached file
                data: bytes = os.pread(value.fileno(), read.size, read.offset)
                return data
            if start == read.offset and len(value) == read.size:
                return value  # exactly this read: no copy
            chunks.append(value[max(0, read.offset - start) : read.stop - start])
        return b"".join(chunks)

    def _wait(self, job: _Job, name: str, size: int) -> Any:
        """``job``'s result within its deadline; its error re-raised as it is."""
        timeout = worst_case_s(self._options, size) + WAIT_SLACK_S
        if self._cache is not None:
            timeout += self._cache.lock_timeout_s
        if not job.done.wait(timeout):
            raise UnreachableError(
                f"{self._source.path(name)}: no answer within {timeout:.0f} s (read-ahead); "
                "check the network and the server, or lower RemoteOptions.request_bytes",
                url=self._source.path(name),
            )
        if job.error is not None:
            raise job.error
        return job.value


def read_ahead(
    source: Source, manifest: Manifest, plan: ReadPlan
) -> Callable[[Spans], RangeIO] | None:
    """The ``io`` factory of a ``Spans`` that will read ``plan``: its read-ahead (and the
    cache) for a remote output with them on; ``None`` (direct reads) otherwise.

    Local outputs keep direct reads: a page-cache ``pread`` has no latency to hide.
    """
    options = source.options
    if not source.remote:
        return None
    cache = None
    if options.cache_dir is not None:
        from loader.io.cache import ShardCache

        cache = ShardCache.for_output(source, manifest)
    if options.read_ahead_bytes == 0 and cache is None:
        return None
    if options.read_ahead_bytes == 0:
        options = _replace_read_ahead(options)

    def make(reader: Spans) -> RangeIO:
        return ReadAhead(source, manifest, plan.reads(reader), plan.shards(), options, cache)

    return make


def _replace_read_ahead(options: RemoteOptions) -> RemoteOptions:
    """With a cache but no read-ahead: one group at a time (each still served from the cache)."""
    from dataclasses import replace

    return replace(options, read_ahead_bytes=1, max_requests=1)
