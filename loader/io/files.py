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

Where the reader is alone in its process, it shares its positioned reads with one thread of
its executor (``loader.io.executor``): a batch's sample reads (``together``, from
``loader.torch.scatter``) and a window's bytes in 1 MiB parts (``split_read_into``); work the
thread has not started when the caller is done is withdrawn, so it never holds the caller up.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import BinaryIO

from loader.io.executor import Executor
from loader.io.source import Source
from shardprep.format.manifest import Manifest

__all__ = [
    "UNREAD_SAMPLE_BYTES",
    "OpenedFiles",
    "ShardFile",
    "ShardFiles",
    "SPLIT_BYTES",
    "split_read_into",
    "together",
    "Unread",
    "large_samples",
    "leaves_unread",
    "positioned_read",
]

UNREAD_SAMPLE_BYTES = 64 << 10  # outputs whose samples average this much are left unread
OPEN_FILES = 8  # shards kept open per reader (chunks still holding one keep it open)
THREAD_NAME = "shardprep-local-read"  # the reader's executor (``loader.core``): threads <name>-<i>
WAIT_S = 300.0  # a local read this slow is a hung file system: say so instead of waiting forever
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


class OpenedFiles:
    """The closers of the shard files one owner opened (a reader's ``ShardFiles``, a local
    read-ahead's ``LocalFetch``), for ``sweep()`` when the owner closes.

    A ``ShardFile`` that is collected unclosed closes its file in a ``weakref.finalize``, whose
    call is Python code: an interrupt (Ctrl-C) landing at its first line is reported and
    dropped by CPython, and the finalizer's registry then keeps the file open for the life of
    the process. ``sweep()`` runs each such closer: a file whose ``ShardFile`` is gone is closed
    when its owner closes, whatever cut its own closing."""

    __slots__ = ("_closers", "_lock")

    def __init__(self) -> None:
        self._closers: list[weakref.finalize[[], ShardFile]] = []
        self._lock = threading.Lock()

    def add(self, file: ShardFile) -> None:
        with self._lock:
            self._closers = [c for c in self._closers if c.alive]
            self._closers.append(file._closer)

    def sweep(self) -> None:
        """Close the files whose ``ShardFile`` was collected without closing them."""
        with self._lock:
            closers = self._closers
            self._closers = [c for c in closers if c.alive]
        for closer in closers:
            if closer.alive and closer.peek() is None:  # its ShardFile gone: a cut close
                closer()


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

    def __init__(self, source: Source, manifest: Manifest, split: Executor | None) -> None:
        self._source, self._manifest = source, manifest
        self._open: OrderedDict[int, ShardFile] = OrderedDict()
        self._all: weakref.WeakSet[ShardFile] = weakref.WeakSet()
        # every shard open here that a chunk still holds: opened once, however many hold it
        self._held: weakref.WeakValueDictionary[int, ShardFile] = weakref.WeakValueDictionary()
        self._opened = OpenedFiles()
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
        self._opened.add(file)
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
        self._opened.sweep()


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


def split_read_into(executor: Executor, fd: int, view: memoryview, offset: int) -> int:
    """``len(view)`` bytes of ``fd`` from ``offset`` into ``view``, in parts of ``SPLIT_BYTES``
    that the caller and one of ``executor``'s threads take in turn (``os.preadv`` releases the
    GIL: two cores copy at once); the bytes read (fewer where the file ends)."""
    bounds = list(range(0, len(view), SPLIT_BYTES)) + [len(view)]
    got = [0] * (len(bounds) - 1)
    claim = iter(range(len(got)))

    def work() -> bool:
        for i in claim:
            a, b = bounds[i], bounds[i + 1]
            got[i] = positioned_read(fd, (view[a:b],), offset + a, b - a)
        return True

    executor.together(work, WAIT_S, _hung)
    done = 0
    for i, n in enumerate(got):
        done += n
        if n < bounds[i + 1] - bounds[i]:
            break  # the file ends here
    return done


def together(executor: Executor | None, work: Callable[[], bool], count: int) -> bool:
    """``work()`` on the caller, shared with one of ``executor``'s threads (``Executor.together``)
    when there is one and ``count`` reads are worth it (``SPLIT_MIN``); whether it succeeded."""
    if executor is None or count < SPLIT_MIN:
        return work()
    return executor.together(work, WAIT_S, _hung)


def _hung() -> BaseException:
    return TimeoutError(
        f"a shard read on thread {THREAD_NAME} took over {WAIT_S:.0f} s: is the file system hung?"
    )
