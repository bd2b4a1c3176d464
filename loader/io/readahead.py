"""Read-ahead: a worker performs the reads it will make next, before they are asked for, in
bounded memory; one mechanism for remote and local outputs.

The epoch order is a pure function of (seed, epoch), so a worker knows its whole read
schedule before it reads anything (``loader.plan.reads``: the same windows, the same resume
skip, adjacent reads of one shard coalesced into groups of at most ``request_bytes``).
``ReadAhead`` submits the groups' parts as jobs to the reader's ``loader.io.executor.Executor``
while at most ``read_ahead_bytes`` are fetched or being fetched beyond the read being served
(always at least one group), and hands the bytes to the ``ShardReader`` (``io.ranges.RangeIO``)
in plan order. A part no thread has started when its bytes are asked for is read by the asking
thread itself. The bytes are the same, in the same order: checksums are checked downstream as
without read-ahead. What changes between outputs is a ``Fetch`` and a ``Pace``:

- **remote** (``RemoteFetch``): a part is one ranged GET (``Source.fetch``: retried,
  deadlines); with ``max_requests=None``, 16 requests per DataLoader split between its
  workers, the budget (``read_ahead_bytes=None``: 128 MiB per DataLoader, at least 64 MiB per
  worker, ``ahead_bytes``) divided between them: 16 of 8 MiB in process, 8 of 8 MiB in each of
  2 workers (``concurrency``). With a cache (``loader.io.cache``), a group's job makes its shard present
  in the cache (downloaded whole, once per node) and pins it; reads are then ``pread`` calls on
  the cached file.
- **local** (``LocalFetch``): a part is one ``os.preadv`` of the shard file (it releases the
  GIL: the kernel's copy out of the page cache overlaps the caller's work on the window
  before), on one thread, one window (``shuffle_buffer_bytes``) ahead. Used for the per-sample
  path of outputs of large samples (``loader.io.files.large_samples``); outputs of small
  samples are read when asked (their per-sample work dominates, and a second window would
  push a small-sample epoch past its memory budget), and batches of large samples read
  straight into the batch (``loader.torch.scatter``).

``read_ahead(source, manifest, plan, ...)`` is the seam: the factory of a ``ShardReader``'s
``RangeIO``, or ``None`` for direct reads. Per worker, memory is one window plus
``read_ahead_bytes`` (plus one request when a single read is larger).

Threads start at the first read, inside the process that iterates (a DataLoader worker, never
the process that forks it) and stop in ``close()`` (iterator end, close or an exception). A
process forked from that one which goes on with the same iteration reads directly. Every wait
has a deadline, and a failed fetch raises its error when its bytes are asked for, naming the
file.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from time import perf_counter_ns
from typing import Any, Protocol

from loader.errors import UnreachableError
from loader.io.executor import Executor, Job
from loader.io.files import OpenedFiles, ShardFile, positioned_read
from loader.io.options import RemoteOptions
from loader.io.ranges import RangeIO, allocate
from loader.io.source import Source, worst_case_s
from loader.plan.reads import Group, Read, ReadPlan, Spans, plan_groups
from shardprep.format.manifest import Manifest

__all__ = [
    "LocalFetch",
    "Pace",
    "ReadAhead",
    "RemoteFetch",
    "ahead_bytes",
    "concurrency",
    "read_ahead",
]

log = logging.getLogger(__name__)

INDEX_AHEAD = 4  # index files fetched ahead of the shards being planned
AUTO_REQUESTS = 16  # max_requests=None: requests in flight per DataLoader, split between workers
MIN_AUTO_REQUESTS = 4  # ... and at least this many per worker
MIN_AUTO_REQUEST_BYTES = 1 << 20  # ... of at least this size (or request_bytes when smaller)
AUTO_AHEAD_BYTES = 128 << 20  # read_ahead_bytes=None: per DataLoader, split between workers
MIN_AUTO_AHEAD_BYTES = 64 << 20  # ... and at least this much per worker
WAIT_SLACK_S = 5.0  # beyond a fetch's own worst case, so that its error (naming why) comes first
LOCAL_WAIT_S = 300.0  # a local read this slow is a hung file system: say so, don't wait forever
LOCAL_PART_BYTES = 4 << 20  # a local group is read in parts this large at most
THREAD_NAME = "shardprep-read-ahead"


@dataclass(frozen=True, slots=True)
class Pace:
    """How far ahead a read-ahead runs: ``threads`` performing parts of at most
    ``request_bytes``, with at most ``ahead_bytes`` fetched or in flight beyond the read
    being served."""

    threads: int
    ahead_bytes: int
    request_bytes: int


def ahead_bytes(options: RemoteOptions, workers: int) -> int:
    """One worker's read-ahead budget, of ``workers``: ``read_ahead_bytes``, or for ``None``
    ``AUTO_AHEAD_BYTES`` split between the workers (at least ``MIN_AUTO_AHEAD_BYTES`` each):
    a node reads ahead the same whatever its worker count (in process too)."""
    if options.read_ahead_bytes is not None:
        return options.read_ahead_bytes
    return max(MIN_AUTO_AHEAD_BYTES, AUTO_AHEAD_BYTES // max(1, workers))


def concurrency(options: RemoteOptions, workers: int) -> tuple[int, int]:
    """(requests in flight, bytes per request) of one worker's read-ahead, of ``workers``.

    ``max_requests`` given: it and ``request_bytes``, per worker. ``None``: ``AUTO_REQUESTS``
    split between the workers (at least ``MIN_AUTO_REQUESTS`` each), each request at most the
    budget (:func:`ahead_bytes`) over that count (not under ``MIN_AUTO_REQUEST_BYTES``): the
    budget is spent on as many connections as it holds (a paced link gives each connection its
    share; one process alone needs more of them), and workers together keep the node's count
    (fewer, larger requests each). With the defaults: 16 of 8 MiB in process, 8 of 8 MiB in
    each of 2 workers (the same 16 connections and request size per node).
    """
    if options.max_requests is not None:
        return options.max_requests, options.request_bytes
    requests = max(MIN_AUTO_REQUESTS, AUTO_REQUESTS // max(1, workers))
    share = max(MIN_AUTO_REQUEST_BYTES, ahead_bytes(options, workers) // requests)
    return requests, min(options.request_bytes, share)


def dataloader_workers() -> int:
    """The number of workers of the torch DataLoader this process is a worker of, else 1
    (torch is not imported for this: a process that never imported it is no such worker)."""
    data = sys.modules.get("torch.utils.data")
    info = None if data is None else data.get_worker_info()
    return 1 if info is None else int(info.num_workers)


class Fetch(Protocol):
    """Where a read-ahead's bytes come from (``RemoteFetch``, ``LocalFetch``)."""

    cache: Any  # a loader.io.cache.ShardCache, or None
    splits: bool  # a group is fetched in parts of request_bytes (else as one part)

    def index(self, shard: int) -> bytes:
        """The whole index file of ``shard``."""

    def part(self, shard: int, start: int, stop: int) -> bytes | memoryview:
        """Bytes ``[start, stop)`` of ``shard``'s file (fewer where the file ends)."""

    def timeout(self, size: int) -> float:
        """Seconds a wait for a part of ``size`` bytes may take before ``hung`` is raised."""

    def hung(self, name: str, timeout: float) -> BaseException:
        """The error of a wait for ``name`` that outlived ``timeout``."""

    def close(self) -> None:
        """Let go of what it holds open."""

    def waited(self, ns: int) -> None:
        """A caller waited ``ns`` nanoseconds for bytes (``Source.io_counts``'s ``wait_ns``)."""


class RemoteFetch:
    """Ranged GETs of a remote output (``Source.fetch``), through the cache if there is one."""

    splits = True  # requests of request_bytes, in flight at once

    def __init__(self, source: Source, manifest: Manifest, cache: Any = None) -> None:
        self._source, self._manifest, self.cache = source, manifest, cache

    def index(self, shard: int) -> bytes:
        entry = self._manifest.shards[shard]
        if self.cache is not None:
            cached = self.cache.read_index(entry)
            if cached is not None:
                return cached  # type: ignore[no-any-return]
        return self._source.read_bytes(entry.index_file, limit=entry.index_bytes)

    def part(self, shard: int, start: int, stop: int) -> bytes | memoryview:
        name = self._manifest.shards[shard].file
        return self._source.fetch(name, start, stop) if stop > start else b""

    def close(self) -> None:
        pass  # (the cache's pinned files are let go with their groups)

    def waited(self, ns: int) -> None:
        self._source.counts().waited(ns)

    def timeout(self, size: int) -> float:
        extra = 0.0 if self.cache is None else self.cache.lock_timeout_s
        return worst_case_s(self._source.options, size) + WAIT_SLACK_S + extra

    def hung(self, name: str, timeout: float) -> BaseException:
        url = self._source.path(name)
        return UnreachableError(
            f"{url}: no answer within {timeout:.0f} s (read-ahead); "
            "check the network and the server, or lower RemoteOptions.request_bytes",
            url=url,
        )


class LocalFetch:
    """Positioned reads of a local output's shard files, each group in one read into memory of
    its own (``loader.io.ranges.allocate``: private anonymous pages, given back to the system
    when the last view of them goes, so a 20 MiB sample does not leave the heap 20 MiB larger).

    The shard being read is opened once and read through that open file (a ``ShardFile``)
    until the plan moves to another shard (as the reader's own reads do): a folder made
    unreadable while its groups are read does not fail the rest of them; a shard changed
    before the plan comes back to it is opened again (and its change named by the reader)."""

    cache = None
    splits = False

    def __init__(self, source: Source, manifest: Manifest) -> None:
        self._source, self._manifest = source, manifest
        self._files: OrderedDict[int, ShardFile] = OrderedDict()
        self._opened = OpenedFiles()  # closes at close() a file whose own closing was cut
        self._lock = threading.Lock()  # (groups are read on a thread and on the caller)

    def _open(self, shard: int, name: str) -> ShardFile:
        """``shard`` open: the one held, else opened now (the one held before let go: a read
        still using it holds it, and it is closed when that read is done)."""
        with self._lock:
            file = self._files.get(shard)
            if file is not None:
                self._files.move_to_end(shard)
                return file
        opened = ShardFile(self._source.open(name), self._source.path(name))
        self._opened.add(opened)
        with self._lock:
            file = self._files.setdefault(shard, opened)
            while len(self._files) > 1:
                self._files.popitem(last=False)
        if file is not opened:
            opened.close()  # another thread opened it meanwhile
        return file

    def close(self) -> None:
        """Let go of the open shards (each is closed once no read uses it)."""
        with self._lock:
            self._files.clear()
        self._opened.sweep()

    def waited(self, ns: int) -> None:
        self._source.counts().waited(ns)

    def index(self, shard: int) -> bytes:
        entry = self._manifest.shards[shard]
        return self._source.read_bytes(entry.index_file, limit=entry.index_bytes)

    def part(self, shard: int, start: int, stop: int) -> memoryview:
        name = self._manifest.shards[shard].file
        view = memoryview(allocate(max(0, stop - start)))
        file = self._open(shard, name)
        try:
            got = positioned_read(file.fd, (view,), start, len(view)) if len(view) else 0
        except OSError as err:
            raise self._named(err, name, start, stop - start) from err
        return view[:got]  # fewer where the file ends: the reader names the first sample lost

    def _named(self, err: OSError, name: str, offset: int, size: int) -> OSError:
        """``err``, naming the shard if it does not (``os.pread``'s EIO names no file): the
        same type, so a missing shard is still told apart."""
        if err.filename is not None or err.errno is None:
            return err
        return type(err)(
            err.errno,
            f"{err.strerror} (reading {size} bytes at offset {offset})",
            self._source.path(name),
        )

    def timeout(self, size: int) -> float:
        return LOCAL_WAIT_S

    def hung(self, name: str, timeout: float) -> BaseException:
        return TimeoutError(
            f"{self._source.path(name)}: a read did not finish within {timeout:.0f} s "
            "(local read-ahead): is the file system hung?"
        )


class _Pending:
    """A submitted group: its jobs and how many of its reads remain.

    ``parts`` are ``(file offset, job)``: a streamed group is fetched as parts of at most
    ``request_bytes`` in parallel (bytes); a cached group is one job (a pinned file, or the
    group's bytes when the cache had no room).
    """

    __slots__ = ("buffer", "cost", "group", "parts", "remaining", "stop")

    def __init__(
        self,
        group: Group,
        parts: list[tuple[int, Job]],
        cost: int,
        stop: int,
        buffer: memoryview | None,
    ) -> None:
        self.group, self.parts, self.cost = group, parts, cost
        self.stop = stop  # where its last part ends (the group's end, or its file's)
        self.buffer = buffer  # parts fetched into one buffer of the group's size, if several
        self.remaining = len(group.reads)


class ReadAhead:
    """A ``RangeIO`` that performs planned reads ahead on an executor (see the module doc)."""

    def __init__(
        self,
        fetch: Fetch,
        manifest: Manifest,
        reads: Iterator[Read],
        shard_order: Iterable[int],
        pace: Pace,
        executor: Executor | None = None,
    ) -> None:
        self._fetch, self._manifest, self._pace = fetch, manifest, pace
        self._request_bytes = pace.request_bytes
        self._groups = plan_groups(reads, pace.request_bytes)
        self._cache = fetch.cache  # a loader.io.cache.ShardCache, or None: stream into memory
        self._own = executor is None
        self._pool = executor if executor is not None else Executor(pace.threads, THREAD_NAME)
        self._pending: deque[_Pending] = deque()
        self._budget = 0  # bytes held or in flight ahead (see _cost)
        self._pinned: dict[int, int] = {}  # cache mode: outstanding groups per shard
        self._exhausted = False
        self._stopped = False  # planning failed: the rest is read directly
        self._upcoming = iter(shard_order)  # drawn lazily: it may be a walk of the epoch's plan
        self._order: list[int] = []  # the distinct shards drawn so far, in order of first use
        self._position: dict[int, int] = {}  # shard -> its place in _order
        self._next_index = 0
        self._index_jobs: dict[int, Job] = {}
        self._closed = False
        self._pid = os.getpid()  # a process forked from this one reads directly
        self.misses = 0  # reads that were not the next planned one (served directly)

    # --- RangeIO --------------------------------------------------------------------

    def index_bytes(self, shard: int) -> bytes:
        """The index file of ``shard``: fetched ahead when it is among the next shards."""
        if os.getpid() != self._pid:  # a fork: the job may be one the parent's thread took
            return self._fetch.index(shard)
        self._prefetch_indexes(shard)
        job = self._index_jobs.pop(shard, None)
        if job is None:
            return self._fetch.index(shard)
        entry = self._manifest.shards[shard]
        return self._wait(job, entry.index_file, entry.index_bytes)  # type: ignore[no-any-return]

    def read(self, shard: int, offset: int, size: int) -> bytes | memoryview:
        """The next planned read's bytes (fetched ahead); any other read is made directly."""
        if os.getpid() != self._pid:  # a fork: this process has none of the jobs' threads
            return self._direct(Read(shard, offset, size))
        self._top_up()
        head = self._pending[0] if self._pending else None
        want = Read(shard, offset, size)
        if head is None and self._stopped:
            return self._direct(want)  # planning stopped (see _top_up): read when asked
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
        try:
            if self._own:
                self._pool.close()
            while self._pending:
                self._release(self._pending.popleft())
        finally:
            self._fetch.close()

    # --- planning -------------------------------------------------------------------

    def _top_up(self) -> None:
        """Submit groups until ``read_ahead_bytes`` are ahead (always at least one group)."""
        limit = self._pace.ahead_bytes
        while (
            not self._exhausted and not self._closed and (not self._pending or self._budget < limit)
        ):
            try:
                group = next(self._groups, None)
            except Exception as err:
                # planning the next reads failed (say, a damaged index of a later shard): that
                # error is the reader's to raise where it reads that shard, as without
                # read-ahead, not a window early; the reads from there on are made directly
                log.debug("read-ahead stops: planning the next reads failed: %s", err)
                self._exhausted = self._stopped = True
                return
            if group is None:
                self._exhausted = True
                return
            cost = self._cost(group)
            self._budget += cost
            self._pending.append(self._submit(group, cost))

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
        if self._cache is None:
            return
        for _, job in pending.parts:
            pinned = job.value if job.done.is_set() else None
            if pinned is not None and not isinstance(pinned, (bytes, memoryview)):
                pinned.close()  # unpin a cached file (a job still running at close: GC does)

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
                    partial(self._fetch.index, shard), priority=0
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

    def _submit(self, group: Group, cost: int) -> _Pending:
        """The group's jobs: its parts (streaming), or its shard made present in the cache.

        A group of several parts (one read larger than ``request_bytes``) has one buffer of its
        size, into which each part's job copies what it fetched: the read is then a view of it,
        not a join of its parts by the consumer (one copy fewer, off the consumer's thread)."""
        entry = self._manifest.shards[group.shard]
        stop = min(group.stop, entry.num_bytes)
        if self._cache is not None:
            cache = self._cache

            def cached() -> Any:
                pinned = cache.open(entry)
                if pinned is not None:
                    return pinned
                return self._fetch.part(group.shard, group.start, stop)

            return _Pending(group, [(group.start, self._pool.submit(cached))], cost, stop, None)
        step = self._request_bytes if self._fetch.splits else max(1, stop - group.start)
        starts = range(group.start, max(stop, group.start + 1), step)
        if len(starts) == 1:
            job = self._pool.submit(partial(self._fetch.part, group.shard, group.start, stop))
            return _Pending(group, [(group.start, job)], cost, stop, None)
        buffer = memoryview(allocate(stop - group.start))
        jobs = [
            (
                start,
                self._pool.submit(
                    partial(self._into, buffer, group, start, min(start + step, stop))
                ),
            )
            for start in starts
        ]
        return _Pending(group, jobs, cost, stop, buffer)

    def _into(self, buffer: memoryview, group: Group, start: int, stop: int) -> int:
        """Fetch ``[start, stop)`` of ``group``'s shard into its place in ``buffer``; the
        number of bytes received (fewer where the file ends)."""
        data = self._fetch.part(group.shard, start, stop)
        at = start - group.start
        buffer[at : at + len(data)] = data
        return len(data)

    def _direct(self, read: Read) -> bytes | memoryview:
        return self._fetch.part(read.shard, read.offset, read.stop) if read.size else b""

    # --- consuming ------------------------------------------------------------------

    def _gather(self, pending: _Pending, read: Read) -> bytes | memoryview:
        """The bytes of ``read`` from its group's parts (waiting for the ones it needs)."""
        name = self._manifest.shards[read.shard].file
        parts = pending.parts
        if pending.buffer is not None:
            return self._from_buffer(pending, read, name)
        chunks: list[bytes | memoryview] = []
        for i, (start, job) in enumerate(parts):
            end = parts[i + 1][0] if i + 1 < len(parts) else pending.group.stop
            if end <= read.offset and i + 1 < len(parts):
                continue
            if start >= read.stop and chunks:
                break
            value = self._wait(job, name, end - start)
            if not isinstance(value, (bytes, memoryview)):  # a pinned cached file
                data: bytes = os.pread(value.fileno(), read.size, read.offset)
                return data
            if start == read.offset and len(value) == read.size:
                return value  # exactly this read: no copy
            chunks.append(value[max(0, read.offset - start) : read.stop - start])
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)  # one part: a view of it

    def _from_buffer(self, pending: _Pending, read: Read, name: str) -> memoryview:
        """The bytes of ``read`` in its group's buffer, once the parts it spans are in; fewer
        where a part came back short (the file ends there)."""
        parts, first = pending.parts, pending.group.start
        end = read.offset  # the end of the bytes of the read received so far
        for i, (start, job) in enumerate(parts):
            stop = parts[i + 1][0] if i + 1 < len(parts) else pending.stop
            if stop <= read.offset:
                continue
            if start >= read.stop:
                break
            got: int = self._wait(job, name, stop - start)
            end = max(read.offset, min(read.stop, start + got))
            if start + got < stop:
                break  # the file ends in this part: nothing of the read after it
        assert pending.buffer is not None
        return pending.buffer[read.offset - first : end - first]

    def _wait(self, job: Job, name: str, size: int) -> Any:
        """``job``'s result (run here if no thread has started it), within its deadline; its
        error re-raised as it is."""
        timeout = self._fetch.timeout(size)
        hung = partial(self._fetch.hung, name, timeout)
        began = perf_counter_ns()
        try:
            return self._pool.result(job, timeout, hung, f"a read of {name}")
        finally:
            self._fetch.waited(perf_counter_ns() - began)


def read_ahead(
    source: Source,
    manifest: Manifest,
    plan: ReadPlan,
    local_ahead_bytes: int = 0,
    executor: Executor | None = None,
) -> Callable[[Spans], RangeIO] | None:
    """The ``io`` factory of a ``ShardReader`` that will read ``plan``, or ``None`` (direct
    reads): for a remote output, its read-ahead (and the cache) unless both are off; for a
    local one, ``local_ahead_bytes`` ahead (0: none) on one thread of ``executor``'s (the
    reader's), for an uncompressed output (a zstd one decompresses what it reads: the caller's
    work, not the read, dominates).
    """
    options = source.options
    fetch: Fetch
    if not source.remote:
        if local_ahead_bytes <= 0 or manifest.compression == "zstd":
            return None
        fetch = LocalFetch(source, manifest)
        # parts (and groups) of a quarter window at most: the next shard's first reads go
        # ahead while this one's last window is handed out, not once it is all consumed
        part = min(LOCAL_PART_BYTES, max(1 << 20, local_ahead_bytes // 4))
        pace = Pace(1, local_ahead_bytes, part)
    else:
        cache = None
        if options.cache_dir is not None:
            from loader.io.cache import ShardCache

            cache = ShardCache.for_output(source, manifest)
        workers = dataloader_workers()
        if ahead_bytes(options, workers) == 0 and cache is None:
            return None
        if ahead_bytes(options, workers) == 0:  # a cache alone: one group at a time, from it
            options = replace(options, read_ahead_bytes=1, max_requests=1)
        fetch = RemoteFetch(source, manifest, cache)
        requests, request_bytes = concurrency(options, workers)
        pace = Pace(requests, ahead_bytes(options, workers), request_bytes)
        executor = None  # its own threads: as many as requests in flight

    def make(reader: Spans) -> RangeIO:
        return ReadAhead(fetch, manifest, plan.reads(reader), plan.shards(), pace, executor)

    return make
