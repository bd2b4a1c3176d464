"""Chunk: the bytes of one sample range and its index, handed out sample by sample, checked.

Each sample's checksum is compared when the sample is handed out (``Chunk.sample``); see
``loader.read.reader`` for what is checked where.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from loader.errors import CorruptShardError
from loader.io.files import Unread
from loader.options import ReadOptions
from loader.plan.order import SampleRange
from shardprep.format.integrity import (
    damage_of,
    damaged_headers,
)
from shardprep.format.shardformat import (
    KEY_FIELD,
    PADDED_FIELD,
    ShardIndex,
    mismatched,
    payload_checksum,
    sample_checksums,
    sample_ends,
    tar_header,
)

__all__ = ["Chunk", "ChunkTable", "UncheckedChunk", "key_array", "key_list"]

IntArray = npt.NDArray[np.int64]
PRECHECK_BYTES = 64 << 10  # a chunk's v3 samples this small on average are checked at once
_READ = ReadOptions()


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
        """The chunk's bytes, read now if the chunk was left unread (``loader.io.files``)."""
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
        """The chunk's samples as arrays, for assembling whole batches (``loader.torch.assemble``)."""
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
        # large ones as their batch copies them (``loader.torch.assemble``), so each byte is read once
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


def _headers_checked(chunk: Chunk) -> Chunk:
    """``chunk`` with its tar headers compared now (version 2 indexes), while its bytes are
    still in the CPU's cache from the read (its samples are handed out after the whole
    window is read). A version 3 index's checksums cover the headers: nothing to do."""
    if chunk._index.version == 2:
        chunk._header_damage()
    return chunk
