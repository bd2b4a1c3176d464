"""Scatter: a batch of large samples read from the shard files straight into its buffers.

For windows left unread (``loader.shardfiles``), each sample of a batch is one
``os.preadv`` from its shard: the iovecs tile the bytes its checksum covers (from its first
tar header to its last member's data), the data of each member going straight to its place in
its field's batch buffer (the worker's shared-memory ring, or the main process's reused
buffer) and the headers and padding in between to a small scratch buffer. The sample's xxh3
is then taken over the same iovecs, while the bytes are still in the CPU's cache, and compared
with the index's. So every payload byte is copied once, by the kernel, and hashed once.

Nothing is handed out unchecked: where a sample is short (its shard was cut) or fails its
checksum, or the batch's samples differ in their fields, ``gather_fields`` returns None; the
caller gives back what it took and makes the batch from the windows' bytes read whole, the
path that names the damaged sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch
import xxhash

from loader.batch import SHARE_BYTES, Packed
from loader.shardfiles import ShardFile, Unread, positioned_read

if TYPE_CHECKING:
    from loader.arena import Arena
    from loader.assemble import Recycler, Window

__all__ = ["gather_fields", "unread_of"]

IntArray = npt.NDArray[np.int64]


def unread_of(buffers: list[object]) -> list[Unread] | None:
    """The chunks' ``Unread`` placeholders if every one of them is unread, else None."""
    if buffers and all(type(b) is Unread for b in buffers):
        return buffers  # type: ignore[return-value]
    return None


class _Reads:
    """Per sample of a batch (in batch order): the file, the file offset of its checked
    bytes, and its iovecs; made from the batch's segments with NumPy, then read."""

    def __init__(self) -> None:
        self.files: list[ShardFile] = []
        self.starts: list[int] = []
        self.views: list[list[memoryview]] = []
        self.sizes: list[int] = []  # the bytes of each sample's iovecs together
        self.expected: list[int] = []


def _plan(
    segments: list[tuple[Window, IntArray]],
    members: list[IntArray],
    outs: list[memoryview],
    ends: list[list[int]],
) -> _Reads | None:
    """The reads of a batch whose segments' members (one column per field, in file order)
    go to ``outs`` (field ``k``'s sample ``i`` at ``ends[k][i]:ends[k][i + 1]``); None if a
    sample's bytes are not exactly its headers and members (the slow path decides)."""
    reads = _Reads()
    i = 0
    width = len(outs)
    gap_parts = []
    layout = []
    for (window, positions), m in zip(segments, members, strict=True):
        unread = window.unread
        assert unread is not None
        chunk = window.sample_chunk[positions]
        bases = np.array([u.offset for u in unread], dtype=np.int64)[chunk]
        span_start = window.span_start[positions]
        begin = window.offset[m]  # (samples, fields), from the chunk's start
        size = window.size[m]
        end = begin + size
        before = np.concatenate([span_start[:, None], end[:, :-1]], axis=1)
        gaps = begin - before
        if (gaps < 0).any() or (end[:, -1] != window.span_end[positions]).any():
            return None  # members overlap or bytes follow the last one: not a plain layout
        gap_parts.append(gaps)
        layout.append((unread, chunk.tolist(), (bases + span_start).tolist(), gaps.tolist()))
        reads.expected.extend(window.sample_checksum[positions].tolist())
        reads.sizes.extend((window.span_end[positions] - span_start).tolist())
    total_gaps = int(sum(int(g.sum()) for g in gap_parts))
    scratch = memoryview(bytearray(total_gaps))
    at = 0
    for unread, chunks, starts, gaps in layout:
        for c, start, sample_gaps in zip(chunks, starts, gaps, strict=True):
            views = []
            for k in range(width):
                g = sample_gaps[k]
                if g:
                    views.append(scratch[at : at + g])
                    at += g
                views.append(outs[k][ends[k][i] : ends[k][i + 1]])
            reads.files.append(unread[c].file)
            reads.starts.append(start)
            reads.views.append(views)
            i += 1
    return reads


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
        if positioned_read(files[i], views, starts[i], wanted) != wanted:
            return False
        h = xxhash.xxh3_64()  # seed 0, as shardprep.format.shardformat.payload_checksum
        for v in views:
            h.update(v)
        if h.intdigest() != sums[i]:
            return False
    return True


def gather_fields(
    segments: list[tuple[Window, IntArray]],
    members: list[IntArray],
    arena: Arena | None,
    recycler: Recycler | None,
    split: Callable[[Callable[[], bool], int], bool] | None = None,
) -> list[Packed] | None:
    """Each field's payloads of a batch of unread windows' samples, packed and checked.

    ``members``: per segment, its samples' member numbers, one column per field in file
    order. A large field goes to ``arena`` (a DataLoader worker's ring: committed, its
    ticket crossing) or ``recycler`` (the main process), a small one to fresh bytes.
    ``split(work, count)`` may run ``work`` on several threads at once, which then share the
    ``count`` samples between them; it returns whether every ``work`` succeeded. None where a sample is
    cut short or fails its checksum, after giving back what was taken from ``arena``.
    """
    width = members[0].shape[1]
    packs: list[Packed] = []
    outs: list[memoryview] = []
    ends: list[list[int]] = []
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
                data = torch.empty(0, dtype=torch.uint8).new(
                    torch.UntypedStorage._new_shared(total)  # type: ignore[no-untyped-call]
                )
                out = memoryview(data.numpy())  # type: ignore[arg-type]
        else:
            assert recycler is not None
            data, out = recycler.tensor(total)
        packs.append(Packed(data, torch.from_numpy(offsets), ticket))
        outs.append(out)
        ends.append(offsets.tolist())
    reads = _plan(segments, members, outs, ends)
    if split is None and arena is None:  # in process: two threads copy (in a worker, one)
        unread = segments[0][0].unread
        split = unread[0].files.split if unread else None
    count = len(reads.files) if reads is not None else 0
    if reads is None:
        ok = False
    else:
        claim = iter(range(count))
        work = partial(_read_checked, reads, claim)
        ok = split(work, count) if split is not None else work()
    if ok:
        return packs
    if arena is not None:
        for packed in reversed(packs):
            if packed._ticket is not None:
                arena.withdraw(packed._ticket)
    return None
