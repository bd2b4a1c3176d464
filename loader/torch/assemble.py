"""Assemble: whole batches cut straight from the read windows, per batch with NumPy.

The batch path of ``ShardDataset(batch_size=B)`` without ``decode`` or a
``transform``. The per-sample path hands out one dict of ``bytes`` per sample
and ``collate_samples`` joins them; here a window's members are described by
arrays once (``Window``), and each batch is one gather over them: the members
of each field are copied once, straight from the window's buffers into the
batch tensor (in shared memory when it is large and this is a DataLoader
worker), with no per-sample dict. With a version 3 index each sample's bytes
(headers, padding, data) are checked against its one checksum: one slice per
sample before a small batch is gathered, or, for a large one, with a streaming
hash per sample fed the bytes between members from the window and each member's
data from its copy (so every byte is read once); with version 2 each member's
data checksum is checked. A batch that goes on in the next
window keeps copies of its first samples (``Carried``, one buffer), not the window.

The result is exactly the per-sample path's: same samples, order, fields and
values (``tests/unit/test_assemble.py``). A batch it cannot describe as arrays
(a sample missing a field or holding one twice, fields in another order, a
sample or member failing its checksum, a sample whose tar header is damaged) is made by
the per-sample path instead, which gives the same batch or raises the same
``CorruptShardError``, naming the sample.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.utils.data
import xxhash
from torch.utils.data._utils.collate import default_collate

from loader.read.chunk import Chunk
from loader.torch.arena import Arena, fresh_shared
from loader.torch.batch import KEY, POSITION, SHARE_BYTES, Batch, Packed, collate_samples, cross
from loader.torch.scatter import gather_fields, unread_of
from shardprep.format.shardformat import KEY_FIELD, PADDED_FIELD, payload_checksum

__all__ = ["Carried", "Recycler", "Window", "assemble_batches"]

IntArray = npt.NDArray[np.int64]


class Window:
    """One read window's samples as arrays over window positions (chunk after chunk).

    Member ``m`` lies in chunk ``chunk[m]``'s buffer at ``offset[m]``, ``size[m]``
    bytes, with recorded data checksum ``checksum[m]``; it belongs to field
    ``names[field[m]]``. Window sample ``p`` owns members ``begin[p]:end[p]``;
    ``damaged[p]``: one of its tar headers is damaged (``Chunk.table``, version 2).
    ``by_sample`` (every chunk's index is of version 3): sample ``p``'s bytes are chunk
    ``sample_chunk[p]``'s ``span_start[p]:span_end[p]`` with recorded checksum
    ``sample_checksum[p]``, the only checksum checked.
    """

    def __init__(self, chunks: list[Chunk]) -> None:
        tables = [c.table() for c in chunks]
        self.chunks = chunks
        lengths = [len(t.keys) for t in tables]
        self._starts = np.cumsum([0, *lengths])
        self.keys = _concat([t.keys for t in tables])
        self.padded = np.repeat([t.padded for t in tables], lengths).astype(np.bool_)
        self.extra = {f: [v for t in tables for v in t.extra[f]] for f in tables[0].extra}
        base = np.cumsum([0] + [len(t.size) for t in tables])
        self.begin = np.concatenate([t.begin + b for t, b in zip(tables, base, strict=False)])
        self.end = np.concatenate([t.end + b for t, b in zip(tables, base, strict=False)])
        self.size = np.concatenate([t.size for t in tables])
        self.offset = np.concatenate([t.offset for t in tables])
        self.checksum = np.concatenate([t.checksum for t in tables])
        self.largest = int(self.size.max()) if len(self.size) else 0  # one member's bytes
        self.checks = all(c.checks for c in chunks)
        self.by_sample = self.checks and all(t.by_sample for t in tables)
        if self.by_sample:
            self.span_start = _concat([t.span_start for t in tables])
            self.span_end = _concat([t.span_end for t in tables])
            self.sample_checksum = _concat([t.sample_checksum for t in tables])
            self.sample_chunk = np.repeat(np.arange(len(tables)), lengths)
            self.damaged = _concat([t.damaged for t in tables])
        else:  # a window mixing versions (never one output) takes the per-sample path
            self.damaged = np.concatenate(
                [t.damaged | (self.checks and t.by_sample) for t in tables]
            )
        self.any_damaged = bool(self.damaged.any())
        # every sample checked already (its result in ``damaged``): batches check nothing
        self.prechecked = self.by_sample and all(t.prechecked for t in tables)
        self.chunk = np.repeat(np.arange(len(tables)), [len(t.size) for t in tables])
        # left unread (large samples, ``loader.io.files``): each batch reads its own samples
        self.unread = unread_of([t.data for t in tables])
        self.buffers = [] if self.unread is not None else [memoryview(c.loaded()) for c in chunks]
        ids: dict[str, int] = {}
        fields = []
        for t in tables:
            local = np.array([ids.setdefault(e, len(ids)) for e in t.exts], dtype=np.int64)
            fields.append(local[t.ext] if len(t.ext) else t.ext)
        self.field = np.concatenate(fields)
        self.names = list(ids)

    def load(self) -> None:
        """Read the bytes of a window left unread, for a batch made from them.

        Raises:
            CorruptShardError: a shard is shorter than its index says (naming the first
                sample it lacks).
        """
        if self.unread is not None:
            self.buffers = [memoryview(c.loaded()) for c in self.chunks]
            self.unread = None

    def members(self, numbers: IntArray) -> list[memoryview]:
        """The bytes of the given members, as views into the chunks' buffers (no copy).

        Made per batch and dropped with it: a window's worth of live views
        would keep the garbage collector busy (they are tracked objects).
        """
        buffers = self.buffers
        return [
            buffers[c][a : a + z]
            for c, a, z in zip(
                self.chunk[numbers].tolist(),
                self.offset[numbers].tolist(),
                self.size[numbers].tolist(),
                strict=True,
            )
        ]

    def samples_match(self, positions: IntArray) -> bool:
        """Whether the samples at ``positions`` match their checksums (``by_sample``): one
        checksum of one slice per sample, each from its first header to its last data."""
        buffers = self.buffers
        if len(buffers) == 1:
            whole = buffers[0]
            views = [
                whole[a:b]
                for a, b in zip(
                    self.span_start[positions].tolist(),
                    self.span_end[positions].tolist(),
                    strict=True,
                )
            ]
        else:
            views = [
                buffers[c][a:b]
                for c, a, b in zip(
                    self.sample_chunk[positions].tolist(),
                    self.span_start[positions].tolist(),
                    self.span_end[positions].tolist(),
                    strict=True,
                )
            ]
        got = np.fromiter(map(payload_checksum, views), np.uint64, len(views))
        return not (got != self.sample_checksum[positions]).any()

    def sample(self, p: int) -> dict[str, Any]:
        """Window sample ``p`` as the per-sample path hands it out (checksum checked)."""
        c = int(np.searchsorted(self._starts, p, side="right")) - 1
        return self.chunks[c].sample(p - int(self._starts[c]))

    def carry(self, positions: IntArray) -> Carried:
        """The samples at ``positions`` copied out of the window, for a batch that goes on in
        the next window: the window's buffers are then free for the next read.

        Each member's checksum (and each sample's tar headers) is checked here, where the
        per-sample path checks it (before the next window is read).

        Raises:
            CorruptShardError: the first of those samples holding a damaged member or
                header, as the per-sample path raises it.
        """
        counts = self.end[positions] - self.begin[positions]
        starts = np.zeros(len(positions) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        # member numbers of the samples, in order: begin[p], begin[p] + 1, ..., per sample
        members = np.repeat(self.begin[positions] - starts[:-1], counts) + np.arange(starts[-1])
        views = self.members(members)
        if self.by_sample:
            if (self.any_damaged and self.damaged[positions].any()) or (
                not self.prechecked and not self.samples_match(positions)
            ):
                for p in positions.tolist():
                    self.sample(p)  # raises at the first damaged sample, naming it
                raise RuntimeError(
                    "a sample failed its checksum when gathered but not when read again: "
                    "its shard is changing while it is read"
                )
        elif self.checks:
            got = np.fromiter(map(payload_checksum, views), np.uint64, len(views))
            bad = np.flatnonzero(got != self.checksum[members])
            if self.any_damaged:
                bad = np.union1d(bad, starts[:-1][self.damaged[positions]])
            if len(bad):
                first = int(np.searchsorted(starts, bad[0], side="right")) - 1
                self.sample(int(positions[first]))  # raises, naming the sample
                raise RuntimeError(
                    f"sample {self.keys[positions[first]]} failed its checksum when gathered "
                    "but not when read again: its shard is changing while it is read"
                )
        return Carried(self, positions, members, starts, views)


class Carried(Window):
    """Samples copied out of a window (``Window.carry``): one buffer, members in sample order.

    It stands in for its window in the batch that goes on in the next one: the same arrays
    (over its own sample and member numbers), checksums already checked.
    """

    def __init__(
        self,
        window: Window,
        positions: IntArray,
        members: IntArray,
        starts: IntArray,
        views: list[memoryview],
    ) -> None:
        self.chunks = []
        self.unread = None
        self.keys = window.keys[positions]
        self.padded = window.padded[positions]
        picked = positions.tolist()
        self.extra = {f: [values[p] for p in picked] for f, values in window.extra.items()}
        self.begin, self.end = starts[:-1], starts[1:]
        self.size = window.size[members]
        self.offset = np.zeros(len(members), dtype=np.int64)
        np.cumsum(self.size[:-1], out=self.offset[1:])
        self.checksum = window.checksum[members]
        self.largest = int(self.size.max()) if len(self.size) else 0
        self.damaged = np.zeros(len(positions), dtype=np.bool_)
        self.any_damaged = False
        self.checks = False  # checked as they were copied
        self.by_sample = False
        self.prechecked = False
        self.chunk = np.zeros(len(members), dtype=np.int64)
        self.buffers = [memoryview(bytearray().join(views))]  # the one copy
        self.field = window.field[members]
        self.names = window.names

    def sample(self, p: int) -> dict[str, Any]:
        """Sample ``p`` as the per-sample path hands it out (``Chunk.sample``)."""
        out: dict[str, Any] = {KEY_FIELD: str(self.keys[p]), PADDED_FIELD: bool(self.padded[p])}
        for field, values in self.extra.items():
            out[field] = values[p]
        data, names = self.buffers[0], self.names
        for m in range(int(self.begin[p]), int(self.end[p])):
            start = int(self.offset[m])
            out[names[self.field[m]]] = data[start : start + int(self.size[m])].tobytes()
        return out


def _regular(window: Window) -> tuple[int, list[str]] | None:
    """(members per sample, field names) if every sample of ``window`` holds the same fields
    in the same order, one member each; else None. Worked out once per window."""
    cached: tuple[int, list[str]] | None | bool = window.__dict__.get("_layout", False)
    if cached is not False:
        return cached  # type: ignore[return-value]
    layout: tuple[int, list[str]] | None = None
    counts = window.end - window.begin
    if len(counts) and not (counts != counts[0]).any():
        width = int(counts[0])
        fields = window.field[window.begin[:, None] + np.arange(width)]
        first = fields[0]
        if not (fields != first).any() and len(set(first.tolist())) == width:
            layout = (width, [window.names[f] for f in first.tolist()])
    window.__dict__["_layout"] = layout
    return layout


FIXED_BYTES = 64  # a field whose members all have one size this small is gathered per window


class _Columns:
    """A regular window's fields as columns over its sample positions, for batches that need
    no check of their own (``_columns``): field ``k`` of position ``p`` is ``size[k][p]``
    bytes at ``start[k][p]`` of buffer ``chunk[p]`` (``chunk`` None: the window has one
    buffer). A field of one small size is gathered once for the whole window
    (``fixed[k]``: one row of bytes per position), so a batch takes its rows in one NumPy
    operation instead of a slice per member; the other fields are sliced per member."""

    __slots__ = ("chunk", "end", "fixed", "largest", "names", "size", "start", "widest")

    def __init__(self, window: Window, width: int, names: list[str]) -> None:
        self.names = names
        first = window.begin  # each position's first member
        self.chunk = window.chunk[first] if len(window.buffers) > 1 else None
        self.start: list[IntArray] = []
        self.end: list[IntArray] = []  # start + size
        self.size: list[IntArray] = []
        self.largest: list[int] = []
        self.fixed: list[npt.NDArray[np.uint8] | None] = []
        for k in range(width):
            start, size = window.offset[first + k], window.size[first + k]
            largest = int(size.max()) if len(size) else 0
            self.start.append(start)
            self.end.append(start + size)
            self.size.append(size)
            self.largest.append(largest)
            one_size = len(size) > 0 and largest <= FIXED_BYTES and not (size != largest).any()
            self.fixed.append(_rows(window, self.chunk, start, largest) if one_size else None)
        self.widest = max(self.largest, default=0)  # one sample's largest member

    def payloads(self, window: Window, k: int, positions: IntArray) -> list[memoryview]:
        """Field ``k``'s bytes of the samples at ``positions``, as views (no copy)."""
        starts = self.start[k][positions].tolist()
        ends = self.end[k][positions].tolist()
        if self.chunk is None:
            whole = window.buffers[0]
            return [whole[a:b] for a, b in zip(starts, ends, strict=True)]
        buffers = window.buffers
        return [
            buffers[c][a:b]
            for c, a, b in zip(self.chunk[positions].tolist(), starts, ends, strict=True)
        ]


def _rows(
    window: Window, chunk: IntArray | None, start: IntArray, size: int
) -> npt.NDArray[np.uint8]:
    """Every position's ``size`` bytes from ``start`` (in its chunk's buffer), one row each."""
    rows = np.empty((len(start), size), dtype=np.uint8)
    span = np.arange(size)
    for c, buffer in enumerate(window.buffers):
        mine = slice(None) if chunk is None else np.flatnonzero(chunk == c)
        if chunk is not None and not len(mine):  # type: ignore[arg-type]
            continue
        data = np.frombuffer(buffer, dtype=np.uint8)  # dropped on return (a view of the read)
        rows[mine] = data[start[mine][:, None] + span]
        del data
    return rows


def _columns(window: Window) -> _Columns | None:
    """The window's columns (``_Columns``), made once; None where a batch must check its own
    members (version 2 checksums, or version 3 samples too large to be checked at read) or
    samples differ in their fields."""
    cached: _Columns | None | bool = window.__dict__.get("_columns", False)
    if cached is not False:
        return cached  # type: ignore[return-value]
    layout = _regular(window)
    columns = None
    if layout is not None and (not window.checks or window.prechecked):
        columns = _Columns(window, *layout)
    window.__dict__["_columns"] = columns
    return columns


def _fast(
    segments: list[tuple[Window, IntArray]], position: dict[str, int], arena: Arena | None
) -> Batch | None:
    """The batch of small samples checked already (or unchecked) as a few NumPy operations
    per field; None where it does not apply (``_assemble`` then makes it).

    In a DataLoader worker (``arena``) every array of the batch (payloads, offsets, keys,
    flags) is also written into the worker's ring, and the batch crosses to the main process
    as where they lie there (``loader.torch.batch.Crossing``), whatever their size.
    """
    parts: list[tuple[Window, IntArray, _Columns]] = []
    for window, positions in segments:
        c = _columns(window)
        if c is None or (window.any_damaged and window.damaged[positions].any()):
            return None
        parts.append((window, positions, c))
    names = parts[0][2].names
    if any(c.names != names for _, _, c in parts):
        return None
    if sum(len(p) * c.widest for _, p, c in parts) >= SHARE_BYTES:  # (a bound, worked out once)
        for k in range(len(names)):
            if sum(len(p) * c.largest[k] for _, p, c in parts) >= SHARE_BYTES:
                return None  # a large payload: copied (and checked) by _gather
    one = len(parts) == 1
    batch = Batch()
    batch[KEY] = parts[0][0].keys[parts[0][1]] if one else _concat([w.keys[p] for w, p, _ in parts])
    padded = parts[0][0].padded[parts[0][1]] if one else _concat([w.padded[p] for w, p, _ in parts])
    batch[PADDED_FIELD] = torch.from_numpy(padded)
    for field in segments[0][0].extra:
        values = [w.extra[field][p] for w, ps, _ in parts for p in ps.tolist()]
        batch[field] = default_collate(values)  # type: ignore[no-untyped-call]
    arrays: list[tuple[str, Any, list[npt.NDArray[Any]]]] = []
    count = len(padded)
    for k, name in enumerate(names):
        data, offsets = _field(parts, k, count)
        packed = Packed(
            torch.from_numpy(data) if len(data) else torch.empty(0, dtype=torch.uint8),
            torch.from_numpy(offsets),
        )
        batch[name] = packed
        arrays.append((name, packed, [data, offsets]))
    batch[POSITION] = position
    if arena is not None:
        arrays.append((KEY, batch[KEY], [batch[KEY]]))
        arrays.append((PADDED_FIELD, batch[PADDED_FIELD], [padded]))
        batch.crossing = cross(arena, arrays)
    return batch


def _field(
    parts: list[tuple[Window, IntArray, _Columns]], k: int, count: int
) -> tuple[npt.NDArray[np.uint8], IntArray]:
    """Field ``k`` of the ``count`` samples of ``parts`` (``_fast``): their bytes back to
    back, and the offsets where each sample's bytes start (and the last ends)."""
    window, positions, columns = parts[0]
    size = columns.largest[k]
    if len(parts) == 1:  # the usual case: a batch within one window
        fixed = columns.fixed[k]
        if fixed is not None:
            return fixed[positions].reshape(-1), _steps(count, size)
        sizes = columns.size[k][positions]
        views = columns.payloads(window, k, positions)
    elif all(c.fixed[k] is not None and c.largest[k] == size for _, _, c in parts):
        rows = [c.fixed[k][p] for _, p, c in parts]  # type: ignore[index]
        return _concat(rows).reshape(-1), _steps(count, size)
    else:
        sizes = _concat([c.size[k][p] for _, p, c in parts])
        views = [v for w, p, c in parts for v in c.payloads(w, k, p)]
    offsets = np.empty(count + 1, dtype=np.int64)
    offsets[0] = 0
    np.add.accumulate(sizes, out=offsets[1:])
    return np.frombuffer(bytearray().join(views), np.uint8), offsets


def _steps(count: int, size: int) -> IntArray:
    """The offsets of ``count`` payloads of ``size`` bytes each, back to back."""
    if not size:
        return np.zeros(count + 1, dtype=np.int64)
    return np.arange(0, (count + 1) * size, size, dtype=np.int64)


class _Fields:
    """A batch segment's members, one column per field; ``members`` None if irregular."""

    def __init__(self, window: Window, positions: IntArray) -> None:
        self.members: IntArray | None = None
        self.names: list[str] = []
        layout = _regular(window)
        if layout is not None and len(positions):  # the usual case: no per-batch checks
            width, self.names = layout
            self.members = window.begin[positions][:, None] + np.arange(width)
            return
        begin, end = window.begin[positions], window.end[positions]
        counts = end - begin
        width = int(counts[0]) if len(counts) else 0
        if not len(counts) or (counts != width).any():
            return
        members = (begin[:, None] + np.arange(width)).reshape(len(positions), width)
        fields = window.field[members]
        first = fields[0]
        if (fields != first).any() or len(set(first.tolist())) != width:
            return  # fields differ between samples, or one sample holds a field twice
        self.members = members
        self.names = [window.names[f] for f in first.tolist()]


class Recycler:
    """Large batch buffers of the main process, reused once the batch's tensor is freed.

    A fresh multi-MiB buffer per batch is a fresh ``malloc`` that glibc often
    serves with new pages (a page fault per 4 KiB) while its thresholds adapt;
    here a buffer goes back to a short free list when the tensor over it and
    every view of it are gone (a finalizer on the array the tensor holds), and
    the next batch of at most that size takes it. Nothing is reused while in use.
    """

    KEEP = 4

    def __init__(self) -> None:
        self._free: list[npt.NDArray[np.uint8]] = []
        self._lock = threading.Lock()  # finalizers run in whichever thread frees the tensor

    def tensor(self, size: int) -> tuple[torch.Tensor, memoryview]:
        """A uint8 tensor of ``size`` bytes and a writable view of them."""
        with self._lock:  # (arrays compare element-wise: list positions, never ``remove``)
            fits = [i for i, b in enumerate(self._free) if len(b) >= size]
            buffer = self._free.pop(min(fits, key=lambda i: len(self._free[i]))) if fits else None
        if buffer is None:
            buffer = np.empty(size + size // 8, dtype=np.uint8)  # room for a larger batch
        array = buffer[:size]
        weakref.finalize(array, self._give, buffer)
        return torch.from_numpy(array), memoryview(array)  # type: ignore[arg-type]

    def _give(self, buffer: npt.NDArray[np.uint8]) -> None:
        with self._lock:
            self._free.append(buffer)
            if len(self._free) > self.KEEP:
                self._free.pop(min(range(len(self._free)), key=lambda i: len(self._free[i])))


class _Stream:
    """Streaming checksums of a large batch segment's samples (``by_sample`` window), fed
    field after field in member order: the window's bytes from where the sample's previous
    member's data ended (its first header for the first) to the member's data, then the
    member's data (from its copy, while it is in the cache)."""

    def __init__(self, window: Window, positions: IntArray) -> None:
        self.window, self.positions = window, positions
        self.hashes = [xxhash.xxh3_64() for _ in range(len(positions))]  # seed 0
        self.at = window.span_start[positions].tolist()
        self.chunk = window.sample_chunk[positions].tolist()

    def gaps(self, members: IntArray) -> list[memoryview]:
        """The bytes before each of ``members`` (one per sample, the next field's) since the
        sample's previous member: its tar header records and the padding before them."""
        window, at = self.window, self.at
        buffers = window.buffers
        starts = window.offset[members].tolist()
        ends = (window.offset[members] + window.size[members]).tolist()
        views = []
        for s, (c, a, b) in enumerate(zip(self.chunk, starts, ends, strict=True)):
            views.append(buffers[c][at[s] : a])
            at[s] = b
        return views

    def matches(self) -> bool:
        """Whether every sample's bytes hashed to its recorded checksum."""
        window = self.window
        got = np.fromiter((h.intdigest() for h in self.hashes), np.uint64, len(self.hashes))
        return (
            self.at == window.span_end[self.positions].tolist()
            and not (got != window.sample_checksum[self.positions]).any()
        )


def _gather(
    segments: list[tuple[Window, IntArray]],
    arena: Arena | None,
    recycler: Recycler | None,
    streams: list[_Stream | None],
) -> Packed | None:
    """One field's payloads (``segments``: window and member numbers) packed in one tensor.

    In a DataLoader worker (``arena`` given) a large one is written into the
    worker's shared-memory ring, or else made in fresh shared memory; in the
    main process into a ``recycler`` buffer. None if a member fails its (version 2) data
    checksum. A segment with a stream (``_Stream``) feeds it its bytes; a ``by_sample``
    segment without one was checked before (``Window.samples_match``).
    """
    sizes = np.concatenate([w.size[m] for w, m in segments])
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    total = int(offsets[-1])
    parts = [window.members(members) for window, members in segments]
    if total < SHARE_BYTES or (arena is None and recycler is None):
        for (window, members), part, stream in zip(segments, parts, streams, strict=True):
            if stream is not None:
                for h, gap, view in zip(stream.hashes, stream.gaps(members), part, strict=True):
                    h.update(gap)
                    h.update(view)
            elif (
                window.checks
                and not window.by_sample
                and not _matches(window, members, map(payload_checksum, part))
            ):
                return None
        joined = bytearray().join([view for part in parts for view in part])
        data = (
            torch.frombuffer(joined, dtype=torch.uint8)
            if total
            else torch.empty(0, dtype=torch.uint8)
        )
        return Packed(data, torch.from_numpy(offsets))
    ends = offsets.tolist()
    if arena is not None:
        slot = arena.reserve(total)
        if slot is not None:
            begin, consumed, out = slot
            if not _copy_checked(segments, parts, ends, out, streams):
                return None  # not committed: the ring's bytes stay free
            placed, ticket = arena.commit(begin, consumed, total)
            return Packed(placed, torch.from_numpy(offsets), ticket)
        # the ring is full: made in shared memory, it crosses as is (as default_collate does)
        data, out = fresh_shared(total)
    else:
        assert recycler is not None
        data, out = recycler.tensor(total)
    if not _copy_checked(segments, parts, ends, out, streams):
        return None
    return Packed(data, torch.from_numpy(offsets))


def _copy_checked(
    segments: list[tuple[Window, IntArray]],
    parts: list[list[memoryview]],
    ends: list[int],
    out: memoryview,
    streams: list[_Stream | None],
) -> bool:
    """Copy the members back to back into ``out`` (``ends``: where each ends), checking
    each one's checksum on its copy; False at the first segment with a mismatch.

    Each member is hashed right after it is copied, while its bytes are still in
    the cache. Hashing the window's bytes first and copying them afterwards read
    them from memory twice: the gather ran at 10 GB/s that way and 13-14 GB/s
    this way (members of 30-100 KiB). The checksum covers the bytes handed out.
    A ``by_sample`` segment's copies feed its samples' streaming checksums (``_Stream``,
    compared once every field is gathered), after the header bytes before them.
    """
    i = 0
    for (window, members), part, stream in zip(segments, parts, streams, strict=True):
        bounds = zip(ends[i : i + len(part)], ends[i + 1 : i + len(part) + 1], strict=True)
        i += len(part)
        if stream is not None:
            gaps = stream.gaps(members)
            for view, h, gap, (a, b) in zip(part, stream.hashes, gaps, bounds, strict=True):
                out[a:b] = view
                h.update(gap)
                h.update(out[a:b])
            continue
        if not window.checks or window.by_sample:
            for view, (a, b) in zip(part, bounds, strict=True):
                out[a:b] = view
            continue
        sums = []
        for view, (a, b) in zip(part, bounds, strict=True):
            out[a:b] = view
            sums.append(payload_checksum(out[a:b]))
        if not _matches(window, members, sums):
            return False
    return True


def _matches(window: Window, members: IntArray, checksums: Iterable[int]) -> bool:
    """Whether the members' ``checksums`` are the ones the window's index lists."""
    got = np.fromiter(checksums, np.uint64, len(members))
    return not (got != window.checksum[members]).any()


def _streams(
    columns: list[tuple[Window, IntArray | None]],
    segments: list[tuple[Window, IntArray]],
    large: bool,
) -> list[_Stream | None] | None:
    """The streaming checksums of a batch's ``by_sample`` segments if a field of it is
    copied into a large buffer (``large``); else those segments' samples are checked now
    (one slice each: None if one fails) and there is no stream."""
    streams: list[_Stream | None] = []
    for (window, members), (_, positions) in zip(columns, segments, strict=True):
        if not window.by_sample or window.prechecked or members is None:
            streams.append(None)
        elif large:
            streams.append(_Stream(window, positions))
        else:
            if not window.samples_match(positions):
                return None
            streams.append(None)
    return streams


def _assemble(
    segments: list[tuple[Window, IntArray]],
    position: dict[str, int],
    arena: Arena | None,
    recycler: Recycler | None,
) -> Batch:
    """The batch of the given window positions, exactly as the per-sample path makes it.

    (A batch that spans windows: the earlier windows' samples as ``Carried`` copies.)
    """
    fast = _fast(segments, position, arena)
    if fast is not None:
        return fast
    layouts = [_Fields(w, p) for w, p in segments]
    names = layouts[0].names
    damaged = any(w.any_damaged and w.damaged[p].any() for w, p in segments)
    if not damaged and all(f.members is not None and f.names == names for f in layouts):
        batch = Batch()
        batch[KEY] = _concat([w.keys[p] for w, p in segments])
        batch[PADDED_FIELD] = torch.from_numpy(_concat([w.padded[p] for w, p in segments]))
        for field in segments[0][0].extra:
            values = [w.extra[field][p] for w, ps in segments for p in ps.tolist()]
            batch[field] = default_collate(values)  # type: ignore[no-untyped-call]
        columns = [(w, f.members) for (w, _), f in zip(segments, layouts, strict=True)]
        if all(w.unread is not None for w, _ in segments):  # each sample read into the batch
            members = [f.members for f in layouts if f.members is not None]
            packs = gather_fields(segments, members, arena, recycler)
            if packs is not None:
                batch.update(zip(names, packs, strict=True))
                batch[POSITION] = position
                return batch
        for w, _ in segments:
            w.load()  # a sample cut short or failing its checksum: made from the whole windows
        large = (arena is not None or recycler is not None) and _any_large(columns)
        streams = _streams(columns, segments, large)
        tickets = []
        for k, name in enumerate(names if streams is not None else ()):
            assert streams is not None
            packed = _gather(
                [(w, m[:, k]) for w, m in columns if m is not None], arena, recycler, streams
            )
            if packed is None:
                break  # a member fails its checksum
            batch[name] = packed
            tickets.append(packed._ticket)
        else:
            if streams is not None and all(s is None or s.matches() for s in streams):
                batch[POSITION] = position
                return batch
        if arena is not None:  # the payloads already committed never leave: free them
            for ticket in reversed(tickets):
                if ticket is not None:
                    arena.withdraw(ticket)
    # irregular fields, or a damaged member or header: the per-sample path, which names the
    # damaged sample
    for w, _ in segments:
        w.load()
    return collate_samples(_samples(segments), position)


def _any_large(columns: list[tuple[Window, IntArray | None]]) -> bool:
    """Whether a field of the batch is at least ``SHARE_BYTES`` (copied, ``_copy_checked``)."""
    if sum(len(m) * w.largest for w, m in columns if m is not None) < SHARE_BYTES:
        return False  # the usual case for small samples: no per-member sums
    totals = sum(w.size[m].sum(axis=0) for w, m in columns if m is not None)
    return bool(np.size(totals) and np.max(totals) >= SHARE_BYTES)


def _concat(arrays: list[npt.NDArray[Any]]) -> npt.NDArray[Any]:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def assemble_batches(
    windows: Iterable[tuple[list[Chunk], IntArray]],
    batch_size: int,
    positions: Iterator[dict[str, int]],
    arena: Arena | None = None,
    recycler: Recycler | None = None,
) -> Iterator[Batch]:
    """Batches of ``batch_size`` window samples (the last may be short), in window order.

    ``windows`` yields each window's chunks and the positions to emit, in
    order (``loader.read.samples.shuffled_windows``); ``positions`` gives each
    batch's ``__position__``; ``arena``: the DataLoader worker's ring for
    large payloads (None in the main process); ``recycler``: the main
    process's reused buffers for them.
    """
    batches = _batch_segments(windows, batch_size)
    segments = next(batches, None)
    while segments is not None:
        yield _assemble(segments, next(positions), arena, recycler)
        segments = None  # (its window released before the next one is read into the pool)
        segments = next(batches, None)


def _batch_segments(
    windows: Iterable[tuple[list[Chunk], IntArray]], batch_size: int
) -> Iterator[list[tuple[Window, IntArray]]]:
    """Each batch's samples as (window, positions) segments, in order (``assemble_batches``)."""
    pending: list[tuple[Window, IntArray]] = []  # the next batch's samples so far
    need = batch_size
    for chunks, order in windows:
        window = Window(chunks)
        while len(order):
            take, order = order[:need], order[need:]
            pending.append((window, take))
            need -= len(take)
            if need == 0:
                yield pending
                pending, need = [], batch_size
        # The next batch goes on in the next window: keep copies of its samples (one buffer),
        # not this window, so that one window is in memory while the next is read. (The
        # per-sample path makes the same batch: tests/integration/test_assemble.py.)
        pending = [
            (w.carry(p), np.arange(len(p), dtype=np.int64))
            if w is window and w.unread is None  # (an unread window holds no bytes)
            else (w, p)
            for w, p in pending
        ]
        del window, chunks
    if pending:
        yield pending


def _samples(segments: list[tuple[Window, IntArray]]) -> list[dict[str, Any]]:
    return [w.sample(p) for w, ps in segments for p in ps.tolist()]
