"""Shard files: a local output's shards held open for positioned reads, and chunks left unread.

The batch path reads a window of large samples (``UNREAD_SAMPLE_BYTES`` or more on average)
without reading it: the reader hands out a ``Chunk`` whose bytes are an ``Unread`` (where they
lie: an open shard file, an offset, a size), and each batch then reads its samples straight
from the file into its own buffers (``loader.torch.scatter``), one ``os.preadv`` per sample. Every
byte is copied once, by the kernel, from the page cache into the batch; nothing holds a
window's bytes.

Where a batch cannot be made that way (a sample failing its checksum or cut short, irregular
fields, the per-sample path), the chunk's bytes are read whole on demand (``Unread.load``,
the reader's own read, which names the first sample a truncated shard lacks), and everything
goes on as for a chunk that was read.

An open shard is a ``ShardFile``: the file object (so it is closed, not leaked, when the last
chunk holding it goes) and its descriptor. ``ShardFiles`` keeps the last few shards open;
``close()`` (the reader's) closes every one it opened, and a chunk that outlives it reads
nothing (``fd`` becomes -1: a closed descriptor's number is never reused for a read).

``SplitReads`` is the reader's second thread, where the reader is alone in its process: it
shares a batch's sample reads (``loader.torch.scatter``) and a window's reads in 1 MiB parts
(``read_into``) with the calling thread; work it has not started when the caller is done is
withdrawn, so it never holds the caller up.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import BinaryIO

from loader.io.source import Source
from shardprep.format.manifest import Manifest

__all__ = [
    "UNREAD_SAMPLE_BYTES",
    "ShardFile",
    "ShardFiles",
    "SPLIT_BYTES",
    "SplitReads",
    "Unread",
    "large_samples",
    "leaves_unread",
    "positioned_read",
]

UNREAD_SAMPLE_BYTES = 64 << 10  # outputs whose samples average this much are left unread
OPEN_FILES = 8  # shards kept open per reader (chunks still holding one keep it open)
THREAD_NAME = "shardprep-split-read"
WAIT_S = 300.0  # a local read this slow is a hung file system: say so instead of waiting forever
JOIN_TIMEOUT_S = 5.0
SPLIT_MIN = 8  # batches of fewer samples are read on the calling thread alone
SPLIT_BYTES = 1 << 20  # a window read this large is shared between the threads in parts this size


def large_samples(manifest: Manifest) -> bool:
    """Whether the output's samples average ``UNREAD_SAMPLE_BYTES`` or more (decided for the
    whole output, so every window and epoch reads the same way)."""
    total = sum(s.num_bytes for s in manifest.shards)
    return total >= UNREAD_SAMPLE_BYTES * max(manifest.num_samples, 1)


def leaves_unread(source: Source, manifest: Manifest, checksums: bool, mapped: bool) -> bool:
    """Whether a batch reader of this output leaves its windows unread: a local, uncompressed
    output of large samples (``large_samples``), read with checksums and without ``mmap``."""
    if source.remote or manifest.compression == "zstd" or not checksums or mapped:
        return False
    return large_samples(manifest)


class ShardFile:
    """One open shard file for ``os.preadv`` from any thread; closed by ``close()`` or when
    the last reference goes."""

    __slots__ = ("__weakref__", "_closer", "fd", "name")

    def __init__(self, file: BinaryIO, name: str) -> None:
        self.fd = file.fileno()
        self.name = name  # the shard's path, for errors
        self._closer = weakref.finalize(self, file.close)

    def close(self) -> None:
        """Close the file; later reads through this object fail with EBADF."""
        self.fd = -1
        self._closer()


class Unread:
    """A chunk's bytes left in its shard: ``size`` bytes of ``file`` from ``offset``.

    ``load()`` reads them (the reader's read: a truncated shard raises ``CorruptShardError``
    naming its first missing sample)."""

    __slots__ = ("file", "files", "load", "offset", "size")

    def __init__(
        self,
        files: ShardFiles,
        file: ShardFile,
        offset: int,
        size: int,
        load: Callable[[], bytes | memoryview],
    ) -> None:
        self.files, self.file, self.offset, self.size, self.load = files, file, offset, size, load


class ShardFiles:
    """The shards of one local, uncompressed output, opened on demand (at most
    ``OPEN_FILES`` kept; least recently used closed first once no chunk holds it)."""

    def __init__(self, source: Source, manifest: Manifest, split: SplitReads | None) -> None:
        self._source, self._manifest = source, manifest
        self._open: OrderedDict[int, ShardFile] = OrderedDict()
        self._all: weakref.WeakSet[ShardFile] = weakref.WeakSet()
        # every shard open here that a chunk still holds: opened once, however many hold it
        self._held: weakref.WeakValueDictionary[int, ShardFile] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self.split = split  # a batch's reads shared with one more thread (the reader's), if any

    def get(self, shard: int) -> ShardFile | None:
        """Shard ``shard`` open; None where its size is not the manifest's (it is then read
        the usual way, which names what is missing)."""
        file = self._open.get(shard)
        if file is not None:
            self._open.move_to_end(shard)
            return file
        file = self._held.get(shard)  # (no longer among the last few, but still held)
        if file is not None:
            self._keep(shard, file)
            return file
        entry = self._manifest.shards[shard]
        path = self._source.path(entry.file)

        def open_owned() -> tuple[ShardFile, int]:  # owned (closed on drop) at once
            opened, size = self._source.open_sized(entry.file, entry.num_bytes)
            return ShardFile(opened, path), size

        file, size = self._source.call(open_owned, entry.file)
        if size != entry.num_bytes:
            file.close()
            return None
        with self._lock:
            self._all.add(file)
        self._held[shard] = file
        self._keep(shard, file)
        return file

    def _keep(self, shard: int, file: ShardFile) -> None:
        self._open[shard] = file
        while len(self._open) > OPEN_FILES:
            self._open.popitem(last=False)  # closed when the last chunk holding it goes

    def close(self) -> None:
        """Close every shard file opened here, held by a chunk or not."""
        self._open.clear()
        self._held.clear()
        with self._lock:
            files = list(self._all)
        for file in files:
            file.close()


def positioned_read(fd: int, views: Sequence[memoryview], offset: int, total: int) -> int:
    """``os.preadv`` of ``views`` (``total`` bytes together) from ``offset``, resumed after a
    short read until the file ends; the bytes read."""
    done = os.preadv(fd, views, offset)
    while done < total:
        rest, skip = [], done
        for v in views:
            if skip >= len(v):
                skip -= len(v)
                continue
            rest.append(v[skip:])
            skip = 0
        got = os.preadv(fd, rest, offset + done)
        if got == 0:
            break
        done += got
    return done


class SplitReads:
    """A reader's positioned reads shared between the calling thread and one more, where the
    reader is alone in its process (in process, or a DataLoader's only worker): a batch's
    samples (``loader.torch.scatter``), or a window's bytes in two halves (``read_into``).

    ``os.preadv`` releases the GIL while the kernel copies out of the page cache, so two
    threads copy at once on two cores; the checksums (``xxh3``, fast next to the copy) follow
    each read on the thread that made it. The thread starts at the first split, in the process
    that reads (never in one that forks DataLoader workers before reading), and ``close()``
    stops and joins it; a process forked while it runs starts its own. Every wait is bounded.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._pid = -1
        self._getpid = os.getpid  # (still there when a generator is closed at interpreter exit)
        self._jobs: queue.SimpleQueue[Job | None]

    def __call__(self, work: Callable[[], bool], count: int) -> bool:
        """``work()`` on this thread and on the other at once (they share ``count`` reads
        between them); whether both succeeded. Alone for fewer than ``SPLIT_MIN`` reads.

        Returns only once the other thread's ``work`` has returned (it writes into buffers
        the caller owns), and raises what it raised.
        """
        if count < SPLIT_MIN:
            return work()
        return self._both(work)

    def read_into(self, fd: int, view: memoryview, offset: int) -> int:
        """``len(view)`` bytes of ``fd`` from ``offset`` into ``view``, in parts of
        ``SPLIT_BYTES`` that the two threads take in turn; the bytes read (fewer where the
        file ends)."""
        bounds = list(range(0, len(view), SPLIT_BYTES)) + [len(view)]
        got = [0] * (len(bounds) - 1)
        claim = iter(range(len(got)))

        def work() -> bool:
            for i in claim:
                a, b = bounds[i], bounds[i + 1]
                got[i] = positioned_read(fd, (view[a:b],), offset + a, b - a)
            return True

        self._both(work)
        done = 0
        for i, n in enumerate(got):
            done += n
            if n < bounds[i + 1] - bounds[i]:
                break  # the file ends here
        return done

    def _both(self, work: Callable[[], bool]) -> bool:
        """``work()`` here and, if it takes the job in time, on the other thread."""
        job = self.offer(work)
        try:
            mine = work()
        finally:
            theirs = self.settle(job)
        if isinstance(theirs, BaseException):
            raise theirs
        return mine and theirs is not False

    def offer(self, work: Callable[[], bool]) -> Job:
        """Offer ``work`` to the other thread, which starts it as soon as it is free; the
        caller then runs ``work`` itself too and ends with ``settle``."""
        if self._thread is None or self._pid != os.getpid():
            self._start()
        job = Job(work)
        self._jobs.put(job)
        return job

    def settle(self, job: Job) -> bool | BaseException | None:
        """After the caller's own ``work()``: what the other thread's returned (or raised),
        once it has; None if it had not taken the job (withdrawn: the caller did it all).

        Raises:
            TimeoutError: the other thread's work took over ``WAIT_S`` (a hung file system).
        """
        with job.lock:  # not taken yet (its thread busy or asleep): withdrawn, all done here
            taken = job.state == TAKEN
            if not taken:
                job.state = WITHDRAWN
        try:
            if taken and not job.done.wait(WAIT_S):
                raise TimeoutError(
                    f"a shard read on thread {THREAD_NAME} took over {WAIT_S:.0f} s: "
                    "is the file system hung?"
                )
        finally:
            # the work holds views of the caller's buffers: a job left in the queue or in the
            # other thread's last binding must not keep them (a pool or a recycler reuses a
            # buffer only once no view of it is left)
            job.work = _done
        return job.result if taken else None

    def _start(self) -> None:
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=_serve, args=(self._jobs,), name=THREAD_NAME, daemon=True
        )
        self._pid = os.getpid()
        self._thread.start()

    def close(self) -> None:
        """Stop and join the thread (if this process started it)."""
        thread, self._thread = self._thread, None
        if thread is not None and self._pid == self._getpid():
            self._jobs.put(None)
            # (not started: a Ctrl-C in ``start``; if it runs after all, it reads the None)
            if thread.is_alive():
                thread.join(JOIN_TIMEOUT_S)


QUEUED, TAKEN, WITHDRAWN = 0, 1, 2


def _done() -> bool:
    return True


class Job:
    """One ``work`` offered to the other thread: taken by it, or withdrawn by the caller once
    it has done all the work itself (never both: ``lock``)."""

    __slots__ = ("done", "lock", "result", "state", "work")

    def __init__(self, work: Callable[[], bool]) -> None:
        self.work = work
        self.state = QUEUED
        self.result: bool | BaseException = False
        self.done = threading.Event()
        self.lock = threading.Lock()


def _serve(jobs: queue.SimpleQueue[Job | None]) -> None:
    while (job := jobs.get()) is not None:
        with job.lock:
            if job.state == WITHDRAWN:
                continue
            job.state = TAKEN
        try:
            job.result = job.work()
        except BaseException as err:  # handed to the caller, which raises it
            job.result = err
        finally:
            job.done.set()
