"""Ranges: the seam a reader gets byte ranges through (``RangeIO``), and the reused buffers
reads land in (``BufferPool``).
"""

from __future__ import annotations

import mmap
import sys
from typing import Protocol

__all__ = ["BufferPool", "RangeIO", "allocate"]

GRAIN = 1 << 20  # read buffers are whole MiB


class BufferPool:
    """Read buffers reused from window to window, instead of a fresh ``bytes`` per read.

    A fresh multi-MiB allocation per read costs a page fault per 4 KiB and, as
    glibc moves such sizes between the heap and ``mmap``, a resident size well
    above what is in use. Here a window's reads are laid one after the other
    into one buffer, which the next window reuses. A buffer is reused only once
    nothing refers to it: while a view of it exists it cannot be resized, which
    is how ``_free`` tells (never a guess). At most ``KEEP`` buffers are kept.
    """

    KEEP = 2

    def __init__(self) -> None:
        self._buffers: list[Buffer] = []
        self._current: Buffer | None = None
        self._used = 0

    def start(self, size: int) -> None:
        """A new window of about ``size`` bytes begins: lay its reads into a free buffer."""
        free = [b for b in self._buffers if _free(b)]
        fits = [b for b in free if len(b) >= size]
        if fits:
            self._current = min(fits, key=len)
        else:
            for buffer in free:  # too small for this window: let it go
                self._buffers.remove(buffer)
            # a little larger than asked: windows of one dataset differ by a few samples
            self._current = allocate(-(-size * 9 // 8 // GRAIN) * GRAIN)
            self._buffers.append(self._current)
            del self._buffers[: -self.KEEP]  # the oldest are in use: their views keep them
        self._used = 0

    def take(self, size: int) -> memoryview:
        """A writable view of ``size`` bytes that nothing else refers to."""
        if self._current is None or self._used + size > len(self._current):
            self.start(size)  # more than the window's estimate: a buffer of its own
        assert self._current is not None
        view = memoryview(self._current)[self._used : self._used + size]
        self._used += size
        return view


Buffer = bytearray | mmap.mmap


def allocate(size: int) -> Buffer:
    """A zeroed, writable buffer of ``size`` bytes for reads.

    On Linux, private anonymous memory advised to use transparent huge pages: a
    16 MiB read into a new one took about 2 ms here, against 9 ms for a ``bytearray``
    (zero-filled page by page, 4 KiB at a time), which a fresh DataLoader worker pays
    before its first batch. Elsewhere, a ``bytearray``.
    """
    if sys.platform != "linux" or size == 0:
        return bytearray(size)
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


def _free(buffer: Buffer) -> bool:
    """True if no view of ``buffer`` exists (resizing is refused while one does).

    A ``bytearray`` is shrunk by one byte, then grown back (growing first would
    reallocate a full buffer); an ``mmap`` is resized to its own size.
    """
    if not buffer:
        return True  # nothing can be viewed, and nothing to shrink
    if isinstance(buffer, mmap.mmap):
        try:
            buffer.resize(len(buffer))
        except BufferError:
            return False
        return True
    last = buffer[-1]
    try:
        del buffer[-1]
    except BufferError:
        return False
    buffer.append(last)
    return True


class RangeIO(Protocol):
    """Where a ``ShardReader`` gets bytes from instead of reading them itself (``loader.io.readahead``).

    Reads come in exactly the order they were planned; errors of a read are
    raised by the call that asks for it.
    """

    def index_bytes(self, shard: int) -> bytes:
        """The whole index file of ``shard`` (bounded by its manifest entry)."""

    def read(self, shard: int, offset: int, size: int) -> bytes | memoryview:
        """``size`` bytes of ``shard``'s file from ``offset``; fewer only where the file ends."""

    def close(self) -> None:
        """Stop every thread and release every file; idempotent."""
