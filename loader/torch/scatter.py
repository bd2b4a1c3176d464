"""Scatter: a batch of large samples read from the shard files straight into its buffers.

For windows left unread (``loader.io.files``), each sample of a batch is one
``os.preadv`` from its shard: the iovecs tile the bytes its checksum covers (from its first
tar header to its last member's data), the data of each member going straight to its place in
its field's batch buffer (the worker's shared-memory ring, or the main process's reused
buffer) and the headers and padding in between to a small scratch buffer. The sample's xxh3
is then taken over the same iovecs, while the bytes are still in the CPU's cache, and compared
with the index's. So every payload byte is copied once, by the kernel, and hashed once.

Nothing is handed out unchecked: where a sample is short (its shard was cut) or fails its
checksum, or the batch's samples differ in their fields, ``gather_fields`` gives back what it
took and returns None; the caller makes the batch from the windows' bytes read whole, the
path that names the damaged sample.

Where the reader has a second thread (the reader's executor, ``loader.io.files.together``: alone in its process), the two share a
batch's samples, claiming them one at a time, while the caller waits for the batch; nothing is
read ahead of the batch asked for. (Reading the next batch while the consumer used this one was
3-5% slower here: each thread's return from ``os.preadv`` waits for the GIL the other holds.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt
import torch
import xxhash

from loader.io.files import ShardFile, Unread, positioned_read, together
from loader.torch.arena import fresh_shared
from loader.torch.batch import SHARE_BYTES, Packed

if TYPE_CHECKING:
    from loader.torch.arena import Arena

__all__ = ["gather_fields", "unread_of"]

IntArray = npt.NDArray[np.int64]


class Window(Protocol):
    """What a batch's reads need of a window (``loader.torch.assemble.Window``): where each
    member and each sample's checked span lie, and the unread chunks to read them from."""

    unread: list[Unread] | None
    sample_chunk: IntArray
    span_start: IntArray
    span_end: IntArray
    sample_checksum: npt.NDArray[np.uint64]
    offset: npt.NDArray[np.int64]
    size: npt.NDArray[np.int64]


class Recycler(Protocol):
    """Reused batch buffers (``loader.torch.assemble.Recycler``)."""

    def tensor(self, size: int) -> tuple[torch.Tensor, memoryview]:
        """A uint8 tensor of ``size`` bytes and a writable view of it."""


IOV_MAX = os.sysconf("SC_IOV_MAX")  # the iovecs one os.preadv takes (1024 on Linux)


def unread_of(buffers: list[object]) -> list[Unread] | None:
    """The chunks' ``Unread`` placeholders if every one of them is unread, else None."""
    if buffers and all(type(b) is Unread for b in buffers):
        return buffers  # type: ignore[return-value]
    return None


class _Reads:
    """Per sample of a batch (in batch order): the file, the file offset of its checked
    bytes, its iovecs, their size together and the checksum they must have."""

    __slots__ = ("expected", "files", "sizes", "starts", "views")

    def __init__(
        self,
        files: list[ShardFile],
        starts: list[int],
        views: list[tuple[memoryview, ...]],
        sizes: list[int],
        expected: list[int],
    ) -> None:
        self.files, self.starts, self.views = files, starts, views
        self.sizes, self.expected = sizes, expected


def _views(buffer: memoryview, starts: IntArray, ends: IntArray) -> Iterator[memoryview]:
    """Views of ``buffer[starts[i]:ends[i]]``, made in C (no Python frame per view)."""
    return map(buffer.__getitem__, map(slice, starts.tolist(), ends.tolist()))


def _plan(
    segments: Sequence[tuple[Window, IntArray]],
    members: list[IntArray],
    outs: list[memoryview],
    offsets: list[IntArray],
) -> _Reads | None:
    """The reads of a batch whose segments' members (one column per field, in file order)
    go to ``outs`` (field ``k``'s sample ``i`` at ``offsets[k][i]:offsets[k][i + 1]``); None if
    a sample's bytes are not exactly its headers and members (the slow path decides).

    A sample's iovecs alternate the bytes before each member (its tar header, and the padding
    after the member before) into a scratch buffer, and the member's data into its field's
    buffer: together exactly the bytes its checksum covers.
    """
    if 2 * len(outs) > IOV_MAX:
        return None  # samples of so many members take more than one os.preadv each
    files: list[ShardFile] = []
    starts, gap_parts, expected, sizes = [], [], [], []
    for (window, positions), m in zip(segments, members, strict=True):
        unread = window.unread
        assert unread is not None
        chunk = window.sample_chunk[positions]
        span_start = window.span_start[positions]
        begin = window.offset[m]  # (samples, fields), from the chunk's start
        end = begin + window.size[m]
        gaps = begin - np.concatenate([span_start[:, None], end[:, :-1]], axis=1)
        if (gaps < 0).any() or (end[:, -1] != window.span_end[positions]).any():
            return None  # members overlap or bytes follow the last one: not a plain layout
        bases = np.array([u.offset for u in unread], dtype=np.int64)
        starts.append(bases[chunk] + span_start)
        gap_parts.append(gaps)
        expected.append(window.sample_checksum[positions])
        sizes.append(window.span_end[positions] - span_start)
        chunk_files = [u.file for u in unread]
        files.extend(map(chunk_files.__getitem__, chunk.tolist()))
    gaps = np.concatenate(gap_parts) if len(gap_parts) > 1 else gap_parts[0]
    gap_ends = np.cumsum(gaps.reshape(-1)).reshape(gaps.shape)  # sample by sample, in order
    scratch = memoryview(bytearray(int(gap_ends[-1, -1]) if gaps.size else 0))
    columns: list[Iterator[memoryview]] = []
    for k, (out, ends) in enumerate(zip(outs, offsets, strict=True)):
        columns.append(_views(scratch, gap_ends[:, k] - gaps[:, k], gap_ends[:, k]))
        columns.append(_views(out, ends[:-1], ends[1:]))
    return _Reads(
        files,
        np.concatenate(starts).tolist(),
        list(zip(*columns, strict=True)),
        np.concatenate(sizes).tolist(),
        np.concatenate(expected).tolist(),
    )


def _read_checked(reads: _Reads, claim: Iterator[int]) -> bool:
    """Read the samples of ``reads`` that ``claim`` hands this thread (each index once, over
    all the threads that share it) and check each one's checksum; False at the first sample
    cut short or failing it."""
    files, starts, views_of, sizes, sums = (
        reads.files,
        reads.starts,
        reads.views,
        reads.sizes,
        reads.expected,
    )
    for i in claim:  # (a C iterator: under the GIL, each index goes to one thread)
        views, wanted = views_of[i], sizes[i]
        try:
            got = positioned_read(files[i].fd, views, starts[i], wanted)
        except OSError as err:  # (EIO, ...) it names no file: name the shard and the bytes
            raise OSError(
                err.errno,
                f"{err.strerror} (reading {wanted} bytes at offset {starts[i]})",
                files[i].name,
            ) from err
        if got != wanted:
            return False
        h = xxhash.xxh3_64()  # seed 0, as shardprep.format.shardformat.payload_checksum
        for v in views:
            h.update(v)
        if h.intdigest() != sums[i]:
            return False
    return True


def gather_fields(
    segments: Sequence[tuple[Window, IntArray]],
    members: list[IntArray],
    arena: Arena | None,
    recycler: Recycler | None,
) -> list[Packed] | None:
    """Each field of a batch of unread windows' samples, read and checked straight into its
    buffer; None if a sample's bytes are not exactly its headers and members, or a sample is
    cut short or fails its checksum (after giving back what was taken from the arena: the
    caller then makes the batch from the windows read whole, which names the sample).

    ``members``: per segment, its samples' member numbers, one column per field in file
    order. A large field goes to ``arena`` (a DataLoader worker's ring: committed, its
    ticket crossing) or ``recycler`` (the main process), a small one to fresh bytes. The
    samples are shared with the reader's other thread if it has one; this returns once that
    thread is out of the batch's buffers, and raises what a read raised, on either thread.
    """
    width = members[0].shape[1]
    packs: list[Packed] = []
    outs: list[memoryview] = []
    ends: list[IntArray] = []
    for k in range(width):
        sizes = np.concatenate(
            [w.size[m[:, k]] for (w, _), m in zip(segments, members, strict=True)]
        )
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        total = int(offsets[-1])
        ticket = None
        if total < SHARE_BYTES or (arena is None and recycler is None):
            data = torch.empty(total, dtype=torch.uint8)
            out = memoryview(data.numpy())  # type: ignore[arg-type]
        elif arena is not None:
            slot = arena.reserve(total)
            if slot is not None:
                begin, consumed, out = slot
                data, ticket = arena.commit(begin, consumed, total)
            else:  # the ring is full: fresh shared memory, which crosses as is
                data, out = fresh_shared(total)
        else:
            assert recycler is not None
            data, out = recycler.tensor(total)
        packs.append(Packed(data, torch.from_numpy(offsets), ticket))
        outs.append(out)
        ends.append(offsets)
    reads = _plan(segments, members, outs, ends)
    if reads is not None:
        unread = segments[0][0].unread
        split = unread[0].files.split if unread else None  # (alone in its process: two threads)
        work = partial(_read_checked, reads, iter(range(len(reads.files))))
        if together(split, work, len(reads.files)):
            return packs
    _give_back(packs, arena)
    return None


def _give_back(packs: list[Packed], arena: Arena | None) -> None:
    if arena is not None:
        for packed in reversed(packs):
            if packed._ticket is not None:
                arena.withdraw(packed._ticket)
