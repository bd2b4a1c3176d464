"""Read: fetch the raw bytes of sample ranges from shards, by seeking with the sidecar index.

No tar header is parsed while streaming: the index gives every member's offset
and size, so a range is one ``pread`` (``.tar``) or the decompression of the
zstd frames that cover it (``.tar.zst``), and samples are slices of that
buffer. One ``ShardReader`` lives in each worker; it keeps one shard file open
and the indexes of the shards it is reading.

Nothing is trusted unchecked: an index must match its manifest entry (sha256,
then ``shardprep.format.integrity.check_index``) before it is used, every read is
bounded by the index and the file's size, a zstd frame is decompressed only
to the span its index gives it, and each sample's checksum is compared when
the sample is handed out (``Chunk.sample``). The tar headers between the members
(which this reader skips, but ``tar`` and WebDataset read) are covered by the
per-sample checksum of a version 3 index (``sample_hash``: a sample's bytes from its
first header to its last member's data), the only checksum checked per sample; for a
version 2 index (per-member data checksums) they are compared, once per chunk, with
the ones the writer makes from the index (``damaged_headers``).

Mapped shards: a local uncompressed shard is read through ``mmap`` (one read-only shared
mapping per read, of just its byte range), so a chunk's bytes are the page cache's own pages
and the batch gather copies each byte once, straight from them (a ``read()`` into a buffer
copied every byte once more, in the kernel). A shard is mapped only while it is the file the
manifest describes: its size must be the manifest's ``num_bytes`` when it is opened, and before
each mapping an ``fstat`` of the open file must still give the device, inode, size and
modification time seen at the open; otherwise that read and the shard's next ones take the
``read()`` path, which names the first sample a truncated shard lacks (``CorruptShardError``).
What a mapping cannot survive: a shard truncated *in place* while one of its mappings is alive
(between that check and the last batch gathered from the window, a fraction of a second).
Touching a page past the new end raises SIGBUS, which Python cannot turn into an exception:
the process dies ("killed by signal: Bus error" for a DataLoader worker, exit status -7 or 135).
shardprep never truncates a finished shard (it writes a temporary file and renames it; a file
replaced by rename leaves the mapped one intact), so only another program rewriting a shard
in place (``truncate``, ``cp`` or ``rsync --inplace`` over it) can cause it. Mapping is
therefore opt-in (``ReadOptions(mapped=True)``): it saved about 4% of the CPU per GB of an
in-process ``images`` epoch on the benchmark machine, not enough to make it the default
(tests/faults/test_mapped_shards.py).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import Any, BinaryIO, Protocol

import numpy as np
import numpy.typing as npt

from loader.errors import CorruptShardError, UnreachableError
from loader.options import ReadOptions
from loader.order import SampleRange
from loader.shardfiles import SPLIT_BYTES, ShardFiles, SplitReads, Unread, leaves_unread
from loader.source import Source
from shardprep.format.errors import ChecksumMismatchError, ManifestError
from shardprep.format.integrity import (
    FrameError,
    check_index,
    damage_of,
    damaged_headers,
    decompress_frame,
    first_damaged_sample,
    salvage_frame,
)
from shardprep.format.manifest import Manifest
from shardprep.format.shardformat import (
    KEY_FIELD,
    PADDED_FIELD,
    WEIGHT_FIELD,
    ShardIndex,
    decode_index,
    mismatched,
    payload_checksum,
    sample_checksums,
    sample_ends,
    tar_header,
)

__all__ = [
    "BufferPool",
    "Chunk",
    "ChunkTable",
    "RangeIO",
    "ShardReader",
    "UncheckedChunk",
]

IntArray = npt.NDArray[np.int64]
INDEX_CACHE = 4  # reweighting draws kept per worker
PRECHECK_BYTES = 64 << 10  # a chunk's v3 samples this small on average are checked at once
_READ = ReadOptions()
INDEX_CACHE_BYTES = 16 << 20  # shard indexes kept per worker: ~72 B per sample of 2 members (the
# 200k samples of the `small` benchmark in 16 shards take 13.7 MiB: all of them, none read twice)


@dataclass(frozen=True)
class ChunkTable:
    """A chunk's samples as arrays: yielded sample ``j`` owns members ``begin[j]:end[j]``.

    Member ``m`` is ``data[offset[m]:offset[m] + size[m]]``, its extension
    ``exts[ext[m]]`` and its recorded data checksum ``checksum[m]``. For a version 3 index
    (``by_sample``) sample ``j``'s bytes ``data[span_start[j]:span_end[j]]`` (headers,
    padding between members, data) have the recorded checksum ``sample_checksum[j]``, the
    one to check (the three are empty for version 2). ``damaged[j]``: a tar header of
    sample ``j``'s members is not the writer's (version 2), or (``prechecked``, version 3
    samples of less than ``PRECHECK_BYTES`` on average) its bytes fail their checksum: the
    sample must not be handed out.
    """

    data: bytes | memoryview | Unread
    exts: tuple[str, ...]
    keys: npt.NDArray[np.str_]
    begin: IntArray
    end: IntArray
    offset: IntArray
    size: IntArray
    ext: IntArray
    checksum: npt.NDArray[np.uint64]
    by_sample: bool
    prechecked: bool
    span_start: IntArray
    span_end: IntArray
    sample_checksum: npt.NDArray[np.uint64]
    damaged: npt.NDArray[np.bool_]
    padded: bool
    extra: dict[str, list[Any]]


class Chunk:
    """The bytes of consecutive samples of one shard, and how to cut them into samples.

    :meth:`sample` checks the sample's checksum before handing it out: with a
    version 3 index one per sample, over its tar headers, the padding between its
    members and its data; with version 2 one per member, over its data. The per-sample lists it uses are made on its first call: the batch path
    (:meth:`table`) reads the index's arrays directly and never needs them.
    For a version 2 index (data-only checksums) the tar headers of all the chunk's
    members are compared at once, right after the read (``damaged_headers``); a
    sample with a damaged one is refused as a sample failing its checksum is.
    """

    checks = True  # verify every member's checksum as its sample is handed out

    __slots__ = (
        "_bad_headers",
        "_base",
        "_data",
        "_exts",
        "_first",
        "_index",
        "_keys",
        "_lists",
        "_selection",
        "_shard",
        "_stop",
        "extra",
        "padded",
    )

    def __init__(
        self,
        data: bytes | memoryview | Unread,
        base: int,
        index: ShardIndex,
        piece: SampleRange,
        shard: str,
        selection: list[int] | None = None,
        extra: dict[str, list[Any]] | None = None,
    ) -> None:
        self._data = data
        self._base = base
        self._index, self._first, self._stop = index, piece.start, piece.stop
        self._shard = shard
        self._exts = index.exts
        self._keys: npt.NDArray[np.str_] | None = None
        self._lists: _SampleLists | None = None
        self._bad_headers: dict[int, int] | None = None
        self.padded = piece.padded
        self._selection = selection  # samples of the chunk in yield order (reweighting), or all
        self.extra = extra or {}  # per yielded sample: more fields, e.g. "__weight__"

    @property
    def index_version(self) -> int:
        """The version of the chunk's shard index (3: checksums cover the tar headers)."""
        return self._index.version

    def __len__(self) -> int:
        return self._stop - self._first if self._selection is None else len(self._selection)

    def keys(self) -> npt.NDArray[np.str_]:
        """The keys of the chunk's samples (all of them, in shard order), as one array."""
        if self._keys is None:
            self._keys = key_array(self._index, self._first, self._stop)
        return self._keys

    def loaded(self) -> bytes | memoryview:
        """The chunk's bytes, read now if the chunk was left unread (``loader.shardfiles``)."""
        if type(self._data) is Unread:
            self._data = self._data.load()
        return self._data  # type: ignore[return-value]

    def _per_sample(self) -> _SampleLists:
        if self._lists is None:
            data = self.loaded() if self.checks else None  # None: no sample checksums needed
            self._lists = _SampleLists(self._index, self._first, self._stop, self._base, data)
        return self._lists

    def _header_damage(self) -> dict[int, int]:
        """The chunk's samples (numbered from its first) with a damaged tar header, each
        with its first damaged member; worked out once, for the whole chunk. Only for a
        version 2 index: a version 3 index's checksums cover the headers (empty)."""
        if self._bad_headers is None:
            bad: dict[int, int] = {}
            if self.checks and self._index.version == 2:
                index, first = self._index, self._first
                members = damaged_headers(index, self.loaded(), self._base, first, self._stop)
                owners = np.searchsorted(index.member_start, members, side="right") - 1 - first
                for j, m in zip(owners.tolist(), members.tolist(), strict=True):
                    bad.setdefault(j, m)
            self._bad_headers = bad
        return self._bad_headers

    def sample(self, j: int) -> dict[str, Any]:
        """Sample ``j`` of the chunk as WebDataset does: ``{"__key__": ..., ext: bytes}``.

        Raises:
            CorruptShardError: the sample's bytes fail their checksum, or a tar
                header of its members is damaged (naming the shard, the sample's
                key and its tar offset).
        """
        extra = {field: values[j] for field, values in self.extra.items()} if self.extra else None
        if self._selection is not None:
            j = self._selection[j]
        lists = self._per_sample()
        bad = self._bad_headers if self._bad_headers is not None else self._header_damage()
        if bad and j in bad:
            raise self._damaged_header(j, bad[j])
        out: dict[str, Any] = {KEY_FIELD: lists.keys[j], PADDED_FIELD: self.padded}
        if extra:
            out.update(extra)
        data, exts, offset, size, ext = (
            self.loaded(),
            self._exts,
            lists.offset,
            lists.size,
            lists.ext,
        )
        view = type(data) is memoryview  # views of a reused read buffer
        failing, spans = lists.bad, lists.spans
        if failing is not None or spans is not None:  # version 3: one checksum per sample
            if (
                failing[j]  # small samples: all of the chunk's checked at once
                if failing is not None
                else payload_checksum(spans[0][spans[1][j] : spans[2][j]]) != spans[3][j]  # type: ignore[index]
            ):
                raise self._damaged_sample(j)
            for m in range(lists.start[j], lists.start[j + 1]):
                start = offset[m]
                payload = data[start : start + size[m]]
                if view:
                    payload = payload.tobytes()  # type: ignore[union-attr]  # outlives the buffer
                out[exts[ext[m]]] = payload
            return out
        check, digest = self.checks, lists.hash
        for m in range(lists.start[j], lists.start[j + 1]):
            start = offset[m]
            payload = data[start : start + size[m]]
            if view:
                payload = payload.tobytes()  # type: ignore[union-attr]  # a sample outlives the buffer
            if check and payload_checksum(payload) != digest[m]:
                raise self._damaged(j, m, payload)
            out[exts[ext[m]]] = payload
        return out

    def table(self) -> ChunkTable:
        """The chunk's samples as arrays, for assembling whole batches (``loader.assemble``)."""
        index, a, b = self._index, self._first, self._stop
        first = index.member_start[a]
        starts = (index.member_start[a : b + 1] - first).astype(np.int64)
        members = slice(int(first), int(index.member_start[b]))
        keys = self.keys()
        if self._selection is not None:
            chosen = np.asarray(self._selection, dtype=np.int64)
            begin, end = starts[chosen], starts[chosen + 1]
            keys = keys[chosen]
        else:
            begin, end = starts[:-1], starts[1:]
        damaged = np.zeros(b - a, dtype=np.bool_)
        damaged[list(self._header_damage())] = True
        by_sample = index.version != 2
        if by_sample:
            span_start = index.sample_offset[a:b].astype(np.int64) - self._base
            span_end = sample_ends(index, a, b) - self._base
            sample_checksum = sample_checksums(index, a, b)
        else:
            span_start = span_end = np.zeros(0, dtype=np.int64)
            sample_checksum = np.zeros(0, dtype=np.uint64)
        if self._selection is not None:
            damaged = damaged[chosen]
            if by_sample:
                span_start, span_end = span_start[chosen], span_end[chosen]
                sample_checksum = sample_checksum[chosen]
        # small samples are all checked now, in one pass (their batches then check nothing);
        # large ones as their batch copies them (``loader.assemble``), so each byte is read once
        prechecked = (
            by_sample
            and self.checks
            and type(self._data) is not Unread  # checked as each batch reads it
            and int(span_end.sum() - span_start.sum()) < PRECHECK_BYTES * max(len(span_end), 1)
        )
        if prechecked:
            damaged |= mismatched(self.loaded(), span_start, span_end, sample_checksum)
        return ChunkTable(
            data=self._data,
            exts=self._exts,
            keys=keys,
            begin=begin,
            end=end,
            offset=(index.member_offset[members] - np.uint64(self._base)).astype(np.int64),
            size=index.member_size[members].astype(np.int64),
            ext=index.member_ext[members].astype(np.int64),
            checksum=index.member_hash[members],
            by_sample=by_sample,
            prechecked=prechecked,
            span_start=span_start,
            span_end=span_end,
            sample_checksum=sample_checksum,
            damaged=damaged,
            padded=self.padded,
            extra=self.extra,
        )

    def _damaged(self, j: int, m: int, payload: bytes | memoryview) -> CorruptShardError:
        """The error for member ``m`` (of the chunk) of sample ``j`` failing its data checksum."""
        lists = self._per_sample()
        return CorruptShardError.at(
            self._shard,
            lists.keys[j],
            int(self._index.sample_offset[self._first + j]),
            f"checksum mismatch in its .{self._exts[lists.ext[m]]} member (the "
            f"{lists.size[m]} bytes at offset {self._base + lists.offset[m]} hash to "
            f"{payload_checksum(payload):#018x}, the index recorded {lists.hash[m]:#018x}): "
            "the shard's bytes are damaged",
        )

    def _damaged_sample(self, j: int) -> CorruptShardError:
        """The error for sample ``j`` failing its ``sample_hash`` (version 3), saying what is
        damaged: a tar header, the padding before one, or a member's data
        (``integrity.damage_of``, with the members' data checksums)."""
        lists, index, base = self._per_sample(), self._index, self._base
        sample = self._first + j
        what, member = damage_of(index, self.loaded(), base, sample)
        if what == "header":
            return self._damaged_header(j, member)
        key, offset = lists.keys[j], int(index.sample_offset[sample])
        if what == "padding":
            ext = self._exts[int(index.member_ext[member])]
            previous = int(index.member_offset[member - 1]) + int(index.member_size[member - 1])
            return CorruptShardError.at(
                self._shard,
                key,
                offset,
                f"the zero padding before its .{ext} member's tar header (offset {previous}) "
                "is not zeros: the shard's bytes are damaged",
            )
        if what == "data":
            m = member - int(index.member_start[self._first])
            payload = memoryview(self.loaded())[lists.offset[m] : lists.offset[m] + lists.size[m]]
            return self._damaged(j, m, payload)
        end = int(sample_ends(index, sample, sample + 1)[0])
        got = payload_checksum(memoryview(self.loaded())[offset - base : end - base])
        expected = int(sample_checksums(index, sample, sample + 1)[0])
        return CorruptShardError.at(
            self._shard,
            key,
            offset,
            f"checksum mismatch over its tar bytes (the {end - offset} bytes at "
            f"offset {offset} hash to {got:#018x}, the index records {expected:#018x}, "
            "though each member's data, header and padding is intact): the index or the "
            "shard's bytes are damaged",
        )

    def _damaged_header(self, j: int, m: int) -> CorruptShardError:
        index = self._index
        key = self._per_sample().keys[j]
        ext = self._exts[int(index.member_ext[m])]
        size, data_at = int(index.member_size[m]), int(index.member_offset[m])
        name = f"{key}.{ext}"
        at = data_at - len(tar_header(name.encode("utf-8", "surrogateescape"), size))
        return CorruptShardError.at(
            self._shard,
            key,
            int(index.sample_offset[self._first + j]),
            f"the tar header of its .{ext} member (at offset {at}) is not the one the index "
            f"describes (a regular file {name!r} of {size} bytes): the shard's bytes are "
            "damaged (tar, tarfile and webdataset would misread or refuse this member)",
        )


class _SampleLists:
    """Samples ``a:b`` of a shard's index as Python lists, for handing samples out one by one.

    Member numbers are relative to the chunk (its first member is 0), offsets to ``base``.
    """

    __slots__ = ("bad", "ext", "hash", "keys", "offset", "size", "spans", "start")

    def __init__(
        self,
        index: ShardIndex,
        a: int,
        b: int,
        base: int,
        data: bytes | memoryview | None,
    ) -> None:
        first, last = int(index.member_start[a]), int(index.member_start[b])
        # version 3: bad[j], sample j's bytes fail its checksum (small samples: all checked at
        # once, here); or, for large ones (hashed as each is handed out, then copied while in
        # cache), sample j's checksum spans[3][j] covers spans[0][spans[1][j]:spans[2][j]]
        self.bad: list[bool] | None = None
        self.spans: tuple[memoryview, list[int], list[int], list[int]] | None = None
        if index.version != 2 and data is not None:
            starts = index.sample_offset[a:b].astype(np.int64) - base
            ends, sums = sample_ends(index, a, b) - base, sample_checksums(index, a, b)
            if int(ends.sum() - starts.sum()) < PRECHECK_BYTES * max(b - a, 1):
                self.bad = mismatched(data, starts, ends, sums).tolist()
            else:
                self.spans = (memoryview(data), starts.tolist(), ends.tolist(), sums.tolist())
        self.keys: list[str] = key_list(index, a, b)
        self.hash: list[int] = index.member_hash[first:last].tolist()
        self.start: list[int] = (index.member_start[a : b + 1] - first).tolist()
        self.ext: list[int] = index.member_ext[first:last].tolist()
        self.offset: list[int] = (index.member_offset[first:last] - np.uint64(base)).tolist()
        self.size: list[int] = index.member_size[first:last].tolist()


def key_list(index: ShardIndex, a: int, b: int) -> list[str]:
    """The keys of samples ``a:b`` of ``index``, decoded one by one (UTF-8)."""
    if b == a:
        return []
    key_start = int(index.key_end[a - 1]) if a else 0
    blob = bytes(index.key_blob[key_start : int(index.key_end[b - 1])])
    ends = (index.key_end[a:b] - np.uint64(key_start)).tolist()
    return [blob[s:e].decode() for s, e in zip([0, *ends[:-1]], ends, strict=True)]


def key_array(index: ShardIndex, a: int, b: int) -> npt.NDArray[np.str_]:
    """The keys of samples ``a:b`` of ``index`` as one NumPy string array.

    The keys lie back to back in ``index.key_blob``. ASCII keys (the usual case) are cut
    into a fixed-width array in a few NumPy operations; any other byte (UTF-8, or a NUL,
    which a fixed-width array would drop from a key's end) takes the exact path, one
    ``decode`` per key.
    """
    if b == a:
        return np.array([], dtype=np.str_)
    key_start = int(index.key_end[a - 1]) if a else 0
    ends = index.key_end[a:b].astype(np.int64) - key_start
    blob = index.key_blob[key_start : key_start + int(ends[-1])]
    lengths = ends.copy()  # (``np.diff(ends, prepend=0)``, without its Python overhead)
    lengths[1:] -= ends[:-1]
    width = max(int(lengths.max()), 1)
    if len(blob) and (int(blob.max()) >= 0x80 or int(blob.min()) == 0):
        return np.array(key_list(index, a, b), dtype=np.str_)
    grid = np.zeros((b - a, width), dtype=np.uint8)
    grid[np.arange(width) < lengths[:, None]] = blob  # row-major order: key after key
    return grid.view(f"S{width}").ravel().astype(f"U{width}")


class UncheckedChunk(Chunk):
    """A :class:`Chunk` that hands samples out without checking their checksums (opt-out)."""

    __slots__ = ()
    checks = False


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


_UNUSED = ("copy", "multiplicity", "source_end", "source_blob")  # checked, then not needed


_NARROWED = ("member_start", "member_size", "member_offset", "sample_offset", "key_end")


def _slim(index: ShardIndex) -> tuple[ShardIndex, int]:
    """A copy of ``index`` without the arrays streaming never reads, so that the cache does
    not keep the whole index file alive; and its size in bytes.

    Offsets, sizes and ends held as 32-bit where every value fits (a shard under 4 GiB,
    the usual case): with the unused arrays, about 40% of the index's bytes. Code that
    reads them converts with ``int()`` or ``astype(np.int64)``, or subtracts a
    ``np.uint64`` (which gives ``uint64``).
    """
    empty = {name: getattr(index, name)[:0].copy() for name in _UNUSED}
    arrays = {f.name: getattr(index, f.name) for f in fields(index)}
    kept: dict[str, Any] = {
        name: _narrow(value) if name in _NARROWED else value.copy()
        for name, value in arrays.items()
        if isinstance(value, np.ndarray) and name not in _UNUSED
    }
    slim = replace(index, **kept, **empty)
    return slim, sum(a.nbytes for a in kept.values())


def _narrow(values: npt.NDArray[np.uint64]) -> npt.NDArray[Any]:
    """A copy of ``values`` as ``uint32`` if every value fits, else as they are."""
    wide = bool(len(values)) and int(values.max()) >= 1 << 32
    narrowed: npt.NDArray[Any] = values.copy() if wide else values.astype(np.uint32)
    return narrowed


SHARED_INDEX_BYTES = 2 * INDEX_CACHE_BYTES  # index files at most this large in all are shared


def checked_indexes(source: Source, manifest: Manifest) -> dict[int, ShardIndex]:
    """Every shard's index, read and checked once (``ShardReader.index``), for the readers of
    one stream to share (``ShardReader(shared=...)``).

    Made where the dataset is constructed: the DataLoader forks its workers from that
    process later, and each inherits these (copy-on-write pages it only reads) instead of
    reading, hashing and checking every index again, once per worker and epoch (about 2 ms
    per MB of index files, per worker). Only for a local output whose index files total at
    most ``SHARED_INDEX_BYTES`` and whose slimmed indexes fit in ``INDEX_CACHE_BYTES``, the
    memory one reader's cache may take anyway; otherwise none. An index that cannot be read
    or fails a check is left out: the reader that needs it reads it itself and raises the
    error there, as it would without this.
    """
    if source.remote or sum(e.index_bytes for e in manifest.shards) > SHARED_INDEX_BYTES:
        return {}
    reader = ShardReader(source, manifest)
    found: dict[int, ShardIndex] = {}
    total = 0
    # the next index file is read and hashed (sha256 lets the GIL go) on a second thread while
    # this one decodes and checks the last: `small`'s 26 MB of index files 35 -> 26 ms here, and
    # one index file more in memory at a time; the thread is gone before this returns
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="shardprep-index") as pool:
            ahead = pool.submit(reader._hashed_index, 0) if manifest.shards else None
            for shard in range(len(manifest.shards)):
                assert ahead is not None
                hashed, ahead = ahead, None
                if shard + 1 < len(manifest.shards):
                    ahead = pool.submit(reader._hashed_index, shard + 1)
                try:
                    index, size = reader._checked_index(shard, *hashed.result())
                except (ManifestError, ChecksumMismatchError):
                    continue  # raised where the shard is read (see above)
                found[shard] = index
                total += size
                if total > INDEX_CACHE_BYTES:
                    break
            if ahead is not None:
                ahead.cancel()  # (or, begun already, waited for as the pool shuts down)
    finally:
        reader.close()
    return found if total <= INDEX_CACHE_BYTES else {}


class ShardReader:
    """Reads sample ranges of one output's shards; one per worker process, made lazily."""

    def __init__(
        self,
        source: Source,
        manifest: Manifest,
        *,
        read: ReadOptions = _READ,
        expand: Callable[[int, ShardIndex], tuple[IntArray, list[float] | None]] | None = None,
        pool: BufferPool | None = None,
        io: Callable[[ShardReader], RangeIO] | None = None,
        unread: bool = False,
        shared: Mapping[int, ShardIndex] | None = None,
        split: bool = False,
    ) -> None:
        """``read``: how shards are checked and read (``checksums``, ``verify``, ``mapped``;
        the other fields are the stream's). ``expand``: a shard's reweighted sequence.
        ``pool``: chunks may hold views: of the mapped shard with ``read.mapped`` (local plain
        shards, see the module docstring), else of the pool's reused buffers.
        ``io``: makes, from this reader, where its shard and index bytes come from instead of
        reading them itself (``loader.prefetch.read_ahead``: the read-ahead, with the cache);
        it gets the reader because a read plan needs the reader's indexes.
        ``unread``: a local uncompressed output's chunks of large samples are left unread,
        for batches that read their own samples (``loader.shardfiles``, ``loader.scatter``).
        ``shared``: indexes read and checked already (``checked_indexes``), used as they are.
        ``split``: this reader is alone in its process (in process, or a DataLoader's only
        worker): a local output's reads are shared with one more thread
        (``loader.shardfiles.SplitReads``)."""
        checksums, mapped = read.checksums, read.mapped
        self._source = source
        self._mapped = mapped
        self._pool = pool if not source.remote else None
        self._chunk = Chunk if checksums else UncheckedChunk
        self._expand = expand
        self._expanded: dict[int, tuple[IntArray, list[float] | None]] = {}
        self._manifest = manifest
        self._verify = read.verify
        self._verified: set[int] = set()
        self._shared = shared or {}
        self._indexes: OrderedDict[int, tuple[ShardIndex, int]] = OrderedDict()
        self._checked: set[int] = set()  # shards whose index passed check_index (read again
        # after leaving the cache, it is checked against the manifest's sha256 only)
        self._index_bytes = 0
        self._open_shard = -1
        self._file: BinaryIO | None = None
        self._file_size = 0
        # the open shard's (device, inode, size, mtime) at its opening, while it may be mapped
        self._mappable: tuple[int, int, int, int] | None = None
        self._zstd: Any = None
        if manifest.compression == "zstd":
            import zstandard

            self._zstd = zstandard.ZstdDecompressor()
        # where shard and index bytes come from when not read here: read-ahead or a local cache
        self.io: RangeIO | None = None if io is None else io(self)
        self._split = SplitReads() if split and not source.remote else None
        self._files = (
            ShardFiles(source, manifest, self._split)
            if unread and self.io is None and leaves_unread(source, manifest, checksums, mapped)
            else None
        )

    def index(self, shard: int) -> ShardIndex:
        """The sidecar index of ``shard``, checked before it is used.

        Indexes are cached up to INDEX_CACHE_BYTES (least recently used out;
        all the indexes of about 230k samples of two members). Each read is bounded by the manifest's ``index_bytes`` and checked
        against its sha256 and, with ``shardprep.format.integrity.check_index``,
        against the manifest entry and the tar layout.

        Raises:
            ManifestError: the index is missing, corrupt, or does not describe its shard.
            ChecksumMismatchError: the index is not the one the manifest lists.
            UnreachableError: the server holding a remote index could not be reached.
        """
        known = self._shared.get(shard)
        if known is not None:
            return known
        cached = self._indexes.get(shard)
        if cached is not None:
            self._indexes.move_to_end(shard)
            return cached[0]
        index, size = self._load_index(shard)
        self._indexes[shard] = (index, size)
        self._index_bytes += size
        while self._index_bytes > INDEX_CACHE_BYTES and len(self._indexes) > 1:
            self._index_bytes -= self._indexes.popitem(last=False)[1][1]
        return index

    def _load_index(self, shard: int) -> tuple[ShardIndex, int]:
        """``shard``'s index read and checked (see ``index``), slimmed, and its size in bytes."""
        return self._checked_index(shard, *self._hashed_index(shard))

    def _hashed_index(self, shard: int) -> tuple[bytes, str]:
        """The bytes of ``shard``'s index file and their sha256 (hex).

        Raises:
            ManifestError: the file cannot be read, or is larger than the manifest says.
        """
        entry = self._manifest.shards[shard]
        where = self._source.path(entry.index_file)
        try:
            if self.io is not None:
                data = self.io.index_bytes(shard)
            else:
                data = self._source.read_bytes(entry.index_file, limit=entry.index_bytes)
        except UnreachableError:
            raise  # the server, not the index, failed: it names the URL itself
        except OSError as err:
            raise ManifestError(f"{where}: cannot read ({err})", where) from err
        return data, hashlib.sha256(data).hexdigest()

    def _checked_index(self, shard: int, data: bytes, actual: str) -> tuple[ShardIndex, int]:
        """The index ``data`` (whose sha256 is ``actual``) of ``shard``, checked and slimmed,
        and its size in bytes.

        Raises:
            ChecksumMismatchError: ``actual`` is not the sha256 the manifest records.
            ManifestError: the index does not describe its shard (``check_index``).
        """
        entry = self._manifest.shards[shard]
        where = self._source.path(entry.index_file)
        if actual != entry.index_sha256:
            raise ChecksumMismatchError.for_file(where, entry.index_sha256, actual)
        index = decode_index(data, where)
        if shard not in self._checked:  # the same bytes (sha256 above) pass the same checks
            names = self._manifest.class_names
            check_index(index, entry, self._zstd is not None, len(names) if names else 0, where)
            self._checked.add(shard)
        return _slim(index)

    def _expanded_ids(self, shard: int) -> tuple[IntArray, list[float] | None]:
        """Raw sample ids (and weights) of the shard's reweighted sequence; cached per shard."""
        if self._expand is None:
            raise RuntimeError("no reweighting configured")
        if shard not in self._expanded:
            if len(self._expanded) >= INDEX_CACHE:
                self._expanded.pop(next(iter(self._expanded)))
            self._expanded[shard] = self._expand(shard, self.index(shard))
        return self._expanded[shard]

    def start_window(self, pieces: list[SampleRange]) -> None:
        """The next reads are the window ``pieces``: with a buffer pool, one buffer holds them;
        a window of large samples may be left unread instead (``unread``)."""
        unread = self._files is not None  # (windows left unread need no buffer)
        if self._pool is not None and not self._maps() and self.io is None and not unread:
            self._pool.start(sum(int(self.sample_sizes(p).sum()) for p in pieces))

    def _maps(self) -> bool:
        """Whether this reader maps its shards (local, uncompressed, chunks may hold views)."""
        return (
            self._mapped
            and self._pool is not None
            and self._zstd is None
            and self.io is None
            and not self._source.remote
        )

    def sample_sizes(self, piece: SampleRange) -> IntArray:
        """Bytes each sample of ``piece`` occupies in the tar (for byte-bounded buffers)."""
        offsets = self.index(piece.shard).sample_offset
        if self._expand is None:
            sizes = np.diff(offsets[piece.start : piece.stop + 1])
        else:
            ids = self._expanded_ids(piece.shard)[0][piece.start : piece.stop]
            sizes = offsets[ids + 1] - offsets[ids]
        return sizes.astype(np.int64)

    def read(self, piece: SampleRange) -> Chunk:
        """The samples of ``piece`` (positions of the reweighted sequence when reweighting)."""
        if self._expand is None:
            return self._read_raw(piece)
        ids, weights = self._expanded_ids(piece.shard)
        selected = ids[piece.start : piece.stop]
        first = int(selected[0])
        raw = SampleRange(piece.shard, first, int(selected[-1]) + 1, piece.padded)
        extra = None if weights is None else {WEIGHT_FIELD: weights[piece.start : piece.stop]}
        return self._read_raw(raw, (selected - first).tolist(), extra)

    def span(self, piece: SampleRange) -> tuple[int, int]:
        """The file offset and size of the one read that ``read(piece)`` makes (read-ahead plans)."""
        if self._expand is not None:
            selected = self._expanded_ids(piece.shard)[0][piece.start : piece.stop]
            piece = SampleRange(piece.shard, int(selected[0]), int(selected[-1]) + 1)
        index = self.index(piece.shard)
        if self._zstd is None:
            begin, end = int(index.sample_offset[piece.start]), int(index.sample_offset[piece.stop])
            return begin, end - begin
        f0, f1 = _frames_of(index, piece)
        start = int(index.frame_offset[f0])
        return start, int(index.frame_offset[f1]) - start

    def _read_raw(
        self,
        piece: SampleRange,
        selection: list[int] | None = None,
        extra: dict[str, list[Any]] | None = None,
    ) -> Chunk:
        """The samples of ``piece``; their checksums are checked as they are handed out.

        Raises:
            CorruptShardError: the shard is missing or shorter than its index
                says (naming the first incomplete sample), or a zstd frame
                does not decompress to its span (naming the first damaged sample).
            ChecksumMismatchError: with ``verify=True``, the shard's sha256 differs.
        """
        index = self.index(piece.shard)
        if self._verify and piece.shard not in self._verified:
            self._check_sha256(piece.shard)
        shard = self._source.path(self._manifest.shards[piece.shard].file)
        offsets = index.sample_offset
        if self._zstd is None:
            begin, end = int(offsets[piece.start]), int(offsets[piece.stop])
            if self._files is not None and index.version != 2:
                unread = self._unread(piece, begin, end - begin)
                if unread is not None:
                    return self._chunk(unread, begin, index, piece, shard, selection, extra)
            pool = self._pool if self._files is None else None
            data = self._read_whole(piece, begin, end - begin, pool)
            return _headers_checked(self._chunk(data, begin, index, piece, shard, selection, extra))
        frames, frame_offset = index.frame_sample, index.frame_offset
        f0, f1 = _frames_of(index, piece)
        base = int(offsets[int(frames[f0])])
        start, stop = int(frame_offset[f0]), int(frame_offset[f1])
        compressed = self._pread(piece, index, start, stop - start)
        parts = []
        for f in range(f0, f1):
            a, b = int(frame_offset[f]) - start, int(frame_offset[f + 1]) - start
            first, last = int(frames[f]), int(frames[f + 1])
            span = int(offsets[last]) - int(offsets[first])
            try:
                parts.append(decompress_frame(self._zstd, compressed[a:b], span))
            except FrameError as err:
                parts.append(self._salvage(piece, index, f, compressed[a:b], span, err))
        chunk = self._chunk(b"".join(parts), base, index, piece, shard, selection, extra)
        return _headers_checked(chunk)

    def _read_whole(
        self, piece: SampleRange, begin: int, size: int, pool: BufferPool | None
    ) -> bytes | memoryview:
        """The ``size`` bytes of ``piece`` from file offset ``begin``.

        Raises:
            CorruptShardError: the shard is missing or ends before them (naming the first
                sample it lacks).
        """
        data = self._pread_into(piece, begin, size, pool)
        if len(data) < size:
            offsets = self.index(piece.shard).sample_offset
            first = int(np.searchsorted(offsets, begin + len(data), side="right")) - 1
            raise self._corrupt(
                piece, first, f"the shard is truncated: it ends at byte {begin + len(data)}"
            )
        return data

    def _unread(self, piece: SampleRange, begin: int, size: int) -> Unread | None:
        """``piece``'s bytes left in its open shard; None where the shard's size is not the
        manifest's (read whole then, which names what is missing)."""
        assert self._files is not None
        try:
            file = self._files.get(piece.shard)
        except FileNotFoundError as err:
            raise self._corrupt(piece, piece.start, "shard file is missing") from err
        if file is None:
            return None
        load = lambda: self._read_whole(piece, begin, size, None)  # noqa: E731
        return Unread(self._files, file, begin, size, load)

    def _salvage(
        self,
        piece: SampleRange,
        index: ShardIndex,
        f: int,
        frame: bytes,
        span: int,
        err: FrameError,
    ) -> bytes:
        """A damaged frame's output if every sample of ``piece`` in it is intact, else the error.

        Raises:
            CorruptShardError: naming the first sample of ``piece`` in frame
                ``f`` that is missing from what still decodes or fails its checksum.
        """
        first, last = int(index.frame_sample[f]), int(index.frame_sample[f + 1])
        data = salvage_frame(frame, span)
        lo, hi = max(first, piece.start), min(last, piece.stop)
        damaged = first_damaged_sample(index, data, int(index.sample_offset[first]), lo, hi)
        if damaged < hi:
            where = f"zstd frame {f} at file offset {int(index.frame_offset[f])}"
            raise self._corrupt(piece, damaged, f"{where}: {err}") from err
        return data + bytes(span - len(data))  # only other samples' bytes are missing

    def _pread(self, piece: SampleRange, index: ShardIndex, offset: int, size: int) -> bytes:
        """``size`` bytes of the shard file from ``offset``; fewer only where the file ends."""
        return bytes(self._pread_into(piece, offset, size, None))

    def _pread_into(
        self, piece: SampleRange, offset: int, size: int, pool: BufferPool | None
    ) -> bytes | memoryview:
        """As ``_pread``; with a ``pool``, a view of one of its buffers (read with ``readinto``)."""
        name = self._manifest.shards[piece.shard].file
        if self.io is not None:
            try:
                return self.io.read(piece.shard, offset, size)
            except FileNotFoundError as err:
                raise self._corrupt(piece, piece.start, "shard file is missing") from err

        if self._source.remote:  # ranged GETs, each attempt under its deadline (Source.fetch)
            try:
                data = self._source.fetch(name, offset, offset + size)
            except FileNotFoundError as err:
                raise self._corrupt(piece, piece.start, "shard file is missing") from err
            if pool is None:
                return data
            buffer = pool.take(len(data))
            buffer[:] = data
            return buffer

        def read() -> bytes | memoryview:
            if self._open_shard != piece.shard or self._file is None:
                self._close_file()
                entry = self._manifest.shards[piece.shard]
                self._file, self._file_size = self._source.open_sized(name, entry.num_bytes)
                self._open_shard = piece.shard
                if self._maps() and self._file_size == entry.num_bytes:
                    self._mappable = _identity(os.fstat(self._file.fileno()))
            if self._mappable is not None and size > 0:
                mapped = self._map(self._file, offset, size)
                if mapped is not None:
                    return mapped
            self._file.seek(offset)
            wanted = max(0, min(size, self._file_size - offset))
            if pool is None:
                return self._file.read(wanted)
            buffer = pool.take(wanted)
            if self._split is not None and wanted >= SPLIT_BYTES:  # two threads copy at once
                return buffer[: self._split.read_into(self._file.fileno(), buffer, offset)]
            return buffer[: self._file.readinto(buffer)]  # type: ignore[attr-defined]

        try:
            return self._source.call(read, name, on_failure=self._close_file)
        except FileNotFoundError as err:
            raise self._corrupt(piece, piece.start, "shard file is missing") from err

    def _map(self, file: BinaryIO, offset: int, size: int) -> memoryview | None:
        """Bytes ``[offset, offset + size)`` of the open shard as a view of a read-only shared
        mapping of just that range (unmapped when the last view of it goes); None, and the
        shard is read with ``read()`` from now on, if the file is no longer the one opened
        (another size, inode or modification time: see the module docstring)."""
        fd = file.fileno()
        status = os.fstat(fd)
        if _identity(status) != self._mappable or offset + size > status.st_size:
            self._mappable = None
            return None
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            mapping = mmap.mmap(
                fd, offset + size - start, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=start
            )
        except OSError:  # a file system that cannot map files (ENODEV): read() it
            self._mappable = None
            return None
        if hasattr(mmap, "MADV_WILLNEED"):
            mapping.madvise(mmap.MADV_WILLNEED)  # a cold file: read ahead the whole range at once
        return memoryview(mapping)[offset - start :]

    def _corrupt(self, piece: SampleRange, sample: int, reason: str) -> CorruptShardError:
        index = self.index(piece.shard)
        name = self._source.path(self._manifest.shards[piece.shard].file)
        key = index.key(sample) if sample < index.num_samples else "(end of shard)"
        return CorruptShardError.at(name, key, int(index.sample_offset[sample]), reason)

    def _check_sha256(self, shard: int) -> None:
        entry = self._manifest.shards[shard]
        digest = hashlib.sha256()
        if self._source.remote:  # ranged GETs, each bounded; one byte past the end notices growth
            step = self._source.options.request_bytes
            for start in range(0, entry.num_bytes + 1, step):
                block = self._source.fetch(
                    entry.file, start, min(start + step, entry.num_bytes + 1)
                )
                digest.update(block)
                if len(block) < min(step, entry.num_bytes + 1 - start):
                    break
        else:
            with self._source.open(entry.file, entry.num_bytes) as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
        if digest.hexdigest() != entry.sha256:
            raise ChecksumMismatchError.for_file(
                self._source.path(entry.file), entry.sha256, digest.hexdigest()
            )
        self._verified.add(shard)

    def close(self) -> None:
        """Close the open shard files and the read-ahead (its threads), if any."""
        self._close_file()
        try:
            if self._split is not None:
                self._split.close()
        finally:  # (a Ctrl-C in the thread's join still closes the files)
            if self._files is not None:
                self._files.close()
        if self.io is not None:
            self.io.close()

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()  # its mappings stay valid until their last view goes
        self._file, self._open_shard, self._mappable = None, -1, None


class RangeIO(Protocol):
    """Where a ``ShardReader`` gets bytes from instead of reading them itself (``loader.prefetch``).

    Reads come in exactly the order they were planned; errors of a read are
    raised by the call that asks for it.
    """

    def index_bytes(self, shard: int) -> bytes:
        """The whole index file of ``shard`` (bounded by its manifest entry)."""

    def read(self, shard: int, offset: int, size: int) -> bytes | memoryview:
        """``size`` bytes of ``shard``'s file from ``offset``; fewer only where the file ends."""

    def close(self) -> None:
        """Stop every thread and release every file; idempotent."""


def _identity(status: os.stat_result) -> tuple[int, int, int, int]:
    """What tells an open shard file from another file or from itself changed: device, inode,
    size, modification time (ns)."""
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def _headers_checked(chunk: Chunk) -> Chunk:
    """``chunk`` with its tar headers compared now (version 2 indexes), while its bytes are
    still in the CPU's cache from the read (its samples are handed out after the whole
    window is read). A version 3 index's checksums cover the headers: nothing to do."""
    if chunk._index.version == 2:
        chunk._header_damage()
    return chunk


def _frames_of(index: ShardIndex, piece: SampleRange) -> tuple[int, int]:
    """The zstd frames ``[f0, f1)`` that hold the samples of ``piece``."""
    f0 = int(np.searchsorted(index.frame_sample, piece.start, side="right")) - 1
    f1 = int(np.searchsorted(index.frame_sample, piece.stop, side="left"))
    return f0, f1
