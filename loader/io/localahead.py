"""Local read-ahead: a local output's next window read on one thread.

In process, a ``ShardStream`` reads a window, then gathers its batches, then reads the next:
one core does everything. Here one background thread reads the next window's bytes
(``os.preadv``, which releases the GIL: the kernel's copy out of the page cache) while this
thread gathers the batches of the window before, checksums included. The reads come to the
``Spans`` through its ``io`` seam (``read.RangeIO``), in plan order; the reader checks
them as it checks any read. (Checking the samples on the thread too was tried and measured
slower: an xxh3 call per ~66 KiB sample hands the GIL back and forth with the gather, and an
in-process ``images`` epoch ran at 3.5 GB/s against 4.3 without read-ahead and 5.7-6.3 with
this read-only thread; docs/benchmarks-feeding.md.)

Bounds and lifetimes:

- At most one window ahead: the next window is submitted when the last read of the current
  one is served, so memory is two windows (``BufferPool``: reused, never one that a view still
  refers to, so the thread never writes into bytes a chunk or a batch still reads). Windows
  whose samples average under ``AHEAD_SAMPLE_BYTES`` are not read ahead (they are read when
  asked, on the iterating thread): their per-sample work dominates, not the read, and the
  second window would push the memory of a small-sample epoch past its budget.
- The thread starts at the first read, inside the process that iterates (a DataLoader worker,
  never the process that forks it), and is stopped and joined by ``close()``, which the
  stream's ``finally`` calls when the iteration ends, is closed or abandoned, or raises.
  A process forked from that one (user code) that goes on with the same iteration has no
  thread: its reads are made directly.
- A read's error (a missing shard) is raised by the call that asks for that read, as a direct
  read raises it; a short read comes back short (the reader names the first missing sample).
  Every wait is bounded (``WAIT_S``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from loader.io.ranges import BufferPool, RangeIO
from loader.io.source import Source
from loader.plan.order import SampleRange
from loader.plan.reads import Read, Spans, planned_windows
from shardprep.format.manifest import Manifest

__all__ = ["LocalAhead", "WindowPlan", "local_ahead", "window_reads"]

log = logging.getLogger(__name__)

THREAD_NAME = "shardprep-local-read"
WAIT_S = 300.0  # a local read this slow is a hung file system: say so instead of waiting forever
JOIN_TIMEOUT_S = 5.0
AHEAD_SAMPLE_BYTES = 64 << 10  # windows of smaller samples on average are not read ahead (as
# ``loader.read.chunk.PRECHECK_BYTES``: such samples are checked a window at once)

WindowPlan = Callable[[Spans], Iterator[list[Read]]]


def window_reads(
    pieces: list[SampleRange], skip: int, max_samples: int, max_bytes: int
) -> WindowPlan:
    """The reads of ``shuffled_windows`` over ``pieces``, window by window (a stream slot)."""
    return lambda reader: planned_windows(pieces, reader, skip, max_samples, max_bytes)


def local_ahead(
    source: Source, manifest: Manifest, mapped: bool, plan: WindowPlan
) -> Callable[[Spans], RangeIO] | None:
    """The ``io`` factory of a ``Spans`` of a local, uncompressed, unmapped output that
    will read ``plan``; None for any other (remote: ``loader.io.readahead.read_ahead``)."""
    if source.remote or manifest.compression == "zstd" or mapped:
        return None
    return lambda reader: LocalAhead(source, manifest, reader, plan)


@dataclass(slots=True)
class _Part:
    """One planned read of a window: where its bytes go, and what the thread made of it."""

    read: Read
    into: memoryview  # a slice of the window's buffer
    data: memoryview | None = None
    error: BaseException | None = None


class _Window:
    __slots__ = ("done", "next", "parts")

    def __init__(self, parts: list[_Part]) -> None:
        self.parts = parts
        self.next = 0  # the next part to serve
        self.done = threading.Event()


class LocalAhead:
    """A ``read.RangeIO`` reading a local output's planned windows on one thread, one ahead."""

    def __init__(self, source: Source, manifest: Manifest, reader: Spans, plan: WindowPlan) -> None:
        self._source, self._manifest, self._reader = source, manifest, reader
        self._plan = plan
        self._windows: Iterator[list[Read]] | None = None  # drawn at the first read
        self._pool = BufferPool()  # used by the iterating thread; the other fills views of it
        self._current: _Window | None = None
        self._ahead: _Window | None = None
        self._jobs: queue.SimpleQueue[_Window | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self._held: list[Read] | None = None  # a planned window not read ahead
        self.misses = 0  # reads that were not the next planned one (read directly)
        self._files: dict[int, Any] = {}  # the iterating thread's open shard (windows asked for)
        self._pid: int | None = None  # the process the thread runs in

    # --- RangeIO --------------------------------------------------------------------

    def index_bytes(self, shard: int) -> bytes:
        entry = self._manifest.shards[shard]
        return self._source.read_bytes(entry.index_file, limit=entry.index_bytes)

    def read(self, shard: int, offset: int, size: int) -> bytes | memoryview:
        """The next planned read's bytes, read on the thread; any other read is made here."""
        if self._closed:
            raise RuntimeError("local read-ahead is closed")
        want = Read(shard, offset, size)
        if self._pid not in (None, os.getpid()):  # a fork: the thread is not in this process
            return self._direct(want)
        window = self._current
        if window is None:
            window = self._current = self._take()
        if window is None or window.parts[window.next].read != want:
            self.misses += 1  # a plan that diverged from the reader: correct, but not ahead
            log.warning("local read-ahead: %s was not the planned next read; reading it", want)
            return self._direct(want)
        part = window.parts[window.next]
        if not self._wait(window):
            name = self._source.path(self._manifest.shards[shard].file)
            raise TimeoutError(
                f"{name}: a read of {size} bytes at offset {offset} did not finish within "
                f"{WAIT_S:.0f} s (local read-ahead): is the file system hung?"
            )
        window.next += 1
        if window.next == len(window.parts):
            self._current = None  # its views go with the chunks that hold them
            self._read_ahead()  # the next window, while this one is gathered
        data, error = part.data, part.error
        del part
        if error is not None:
            raise error
        if data is None:  # a part after one that stopped the thread
            raise RuntimeError(
                f"the local read-ahead thread ({THREAD_NAME}) ended before it read shard "
                f"{shard} ({size} bytes at offset {offset}); see the error logged before this one"
            )
        return data

    def _wait(self, window: _Window) -> bool:
        """Wait for ``window``'s reads, at most ``WAIT_S``; a thread that ended without reading
        it (stopped by something other than an ``Exception``) fails its reads at once."""
        deadline = time.monotonic() + WAIT_S
        while not window.done.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
            thread = self._thread
            if thread is not None and not thread.is_alive() and not window.done.is_set():
                for part in window.parts:
                    if part.data is None and part.error is None:
                        part.error = RuntimeError(
                            f"the local read-ahead thread ({THREAD_NAME}) ended before it read "
                            f"shard {part.read.shard} ({part.read.size} bytes at offset "
                            f"{part.read.offset}); see the error logged before this one"
                        )
                return True
            if time.monotonic() >= deadline:
                return False
        return True

    def close(self) -> None:
        """Stop and join the thread, close this thread's files; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop.set()
            self._jobs.put(None)
            thread, self._thread = self._thread, None
            # (not started: a Ctrl-C in ``start``; if it runs after all, it sees the stop and
            # ends)
            if thread is not None and thread.is_alive():
                thread.join(JOIN_TIMEOUT_S)
                if thread.is_alive():
                    log.warning("%s still reading %.0f s after close", thread.name, JOIN_TIMEOUT_S)
        finally:  # (a Ctrl-C in the join still closes the files read on this thread)
            self._current = self._ahead = None
            for f in self._files.values():
                f.close()
            self._files.clear()

    # --- planning (this thread) -------------------------------------------------------

    def _read_ahead(self) -> None:
        """Submit the next window now, unless planning it fails: its error (say, a damaged index
        of its shard) is then the reader's to raise where it reads that window, not here, a
        window early; the reads from there on are made directly."""
        try:
            self._ahead = self._submit()
        except Exception as err:
            log.debug("local read-ahead stops: planning the next window failed: %s", err)
            self._windows = iter(())

    def _take(self) -> _Window | None:
        """The window after the current one: the one read ahead, or submitted now."""
        ahead, self._ahead = self._ahead, None
        return ahead if ahead is not None else self._submit(now=True)

    def _submit(self, now: bool = False) -> _Window | None:
        """Plan the next window's reads into a free buffer and queue them for the thread, or
        (``now``: the window is asked for) read them here; None at the end of the plan, or
        (unless ``now``) if it is not worth reading ahead."""
        if self._windows is None:
            self._windows = self._plan(self._reader)
        reads, self._held = self._held or next(self._windows, None), None
        if reads is None:
            return None
        total = sum(r.size for r in reads)
        if not now and total < AHEAD_SAMPLE_BYTES * max(sum(map(self._count, reads)), 1):
            self._held = reads  # read when asked: one window in memory
            return None
        self._pool.start(total)
        window = _Window([_Part(r, self._pool.take(r.size)) for r in reads])
        if now:  # nothing to overlap with: no hand-off to the thread
            self._run(window, self._files)
            return window
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=THREAD_NAME, daemon=True)
            self._pid = os.getpid()
            self._thread.start()
        self._jobs.put(window)
        return window

    def _count(self, read: Read) -> int:
        offsets = self._reader.index(read.shard).sample_offset
        a, b = np.searchsorted(offsets, [read.offset, read.stop])
        return int(b - a)

    def _direct(self, read: Read) -> bytes:
        name = self._manifest.shards[read.shard].file
        with self._source.open(name) as f:
            f.seek(read.offset)
            data: bytes = f.read(read.size)
        return data

    # --- the thread -------------------------------------------------------------------

    def _work(self) -> None:
        files: dict[int, Any] = {}
        try:
            while not self._stop.is_set() and self._run(self._jobs.get(), files):
                pass  # (no window stays referenced here while the next is awaited)
        finally:
            for f in files.values():
                f.close()

    def _run(self, window: _Window | None, files: dict[int, Any]) -> bool:
        """Read ``window``'s parts (on the thread, or here when asked for); False for the stop
        sentinel."""
        if window is None:
            return False
        try:
            for part in window.parts:
                if self._stop.is_set():
                    break
                try:
                    self._fill(part, files)
                except Exception as err:  # raised by the read that asks for this part
                    part.error = self._named(err, part.read)
                except BaseException as err:  # the thread ends: the reader is told, not stuck
                    part.error = RuntimeError(
                        f"the local read-ahead thread ({THREAD_NAME}) stopped with {err!r} "
                        f"while reading shard {part.read.shard}"
                    )
                    raise
        finally:
            window.done.set()  # whatever happened, the reader waits no longer
        return True

    def _named(self, err: Exception, read: Read) -> Exception:
        """``err``, naming the shard if it is an ``OSError`` that does not (``os.preadv``'s
        EIO names no file): the same type, so a missing shard is still told apart."""
        if not isinstance(err, OSError) or err.filename is not None or err.errno is None:
            return err
        name = self._source.path(self._manifest.shards[read.shard].file)
        named = type(err)(err.errno, f"{err.strerror} (reading {read.size} bytes at offset "
                                     f"{read.offset})", name)  # fmt: skip
        named.__cause__ = err
        return named

    def _fill(self, part: _Part, files: dict[int, Any]) -> None:
        read = part.read
        f = files.get(read.shard)
        if f is None:
            for old in files.values():
                old.close()
            files.clear()
            f = files[read.shard] = self._source.open(self._manifest.shards[read.shard].file)
        fd, into, got = f.fileno(), part.into, 0
        while got < read.size:
            n = os.preadv(fd, [into[got:]], read.offset + got)
            if n == 0:
                break  # the file ends here: the reader names the first missing sample
            got += n
        part.data = into[:got]
