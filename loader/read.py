"""Read: fetch the raw bytes of sample ranges from shards, by seeking with the sidecar index.

No tar header is parsed while streaming: the index gives every member's offset
and size, so a range is one ``pread`` (``.tar``) or the decompression of the
zstd frames that cover it (``.tar.zst``), and samples are slices of that
buffer. One ``ShardReader`` lives in each worker; it keeps one shard file open
and the indexes of the shards it is reading.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from loader.errors import CorruptShardError
from loader.order import SampleRange
from loader.source import Source, retry
from shardprep.errors import ChecksumMismatchError, ManifestError
from shardprep.manifest import Manifest
from shardprep.shardformat import ShardIndex, decode_index

__all__ = ["Chunk", "ShardReader"]

IntArray = npt.NDArray[np.int64]
INDEX_CACHE = 4  # reweighting draws kept per worker
INDEX_CACHE_BYTES = 32 << 20  # shard indexes kept per worker (about 100 bytes per sample)


class Chunk:
    """The bytes of consecutive samples of one shard, and how to cut them into samples."""

    __slots__ = (
        "_data",
        "_exts",
        "_keys",
        "_member_ext",
        "_member_start",
        "_offset",
        "_selection",
        "_size",
        "extra",
        "padded",
    )

    def __init__(
        self,
        data: bytes,
        base: int,
        index: ShardIndex,
        piece: SampleRange,
        selection: list[int] | None = None,
        extra: dict[str, list[Any]] | None = None,
    ) -> None:
        a, b = piece.start, piece.stop
        first, last = int(index.member_start[a]), int(index.member_start[b])
        self._data = data
        self._exts = index.exts
        self._member_start = (index.member_start[a : b + 1] - first).tolist()
        self._member_ext = index.member_ext[first:last].tolist()
        self._offset = (index.member_offset[first:last] - np.uint64(base)).tolist()
        self._size = index.member_size[first:last].tolist()
        key_start = int(index.key_end[a - 1]) if a else 0
        blob = bytes(index.key_blob[key_start : int(index.key_end[b - 1])])
        ends = (index.key_end[a:b] - np.uint64(key_start)).tolist()
        self._keys = [blob[s:e].decode() for s, e in zip([0, *ends[:-1]], ends, strict=True)]
        self.padded = piece.padded
        self._selection = selection  # samples of the chunk in yield order (reweighting), or all
        self.extra = extra or {}  # per yielded sample: more fields, e.g. "__weight__"

    def __len__(self) -> int:
        return len(self._keys) if self._selection is None else len(self._selection)

    def sample(self, j: int) -> dict[str, Any]:
        """Sample ``j`` of the chunk as WebDataset does: ``{"__key__": ..., ext: bytes}``."""
        extra = {field: values[j] for field, values in self.extra.items()} if self.extra else None
        if self._selection is not None:
            j = self._selection[j]
        out: dict[str, Any] = {"__key__": self._keys[j], "__padded__": self.padded}
        if extra:
            out.update(extra)
        data, exts, offset, size, ext = (
            self._data,
            self._exts,
            self._offset,
            self._size,
            self._member_ext,
        )
        for m in range(self._member_start[j], self._member_start[j + 1]):
            start = offset[m]
            out[exts[ext[m]]] = data[start : start + size[m]]
        return out


class ShardReader:
    """Reads sample ranges of one output's shards; one per worker process, made lazily."""

    def __init__(
        self,
        source: Source,
        manifest: Manifest,
        verify: bool = False,
        expand: Callable[[int, ShardIndex], tuple[IntArray, list[float] | None]] | None = None,
    ) -> None:
        self._source = source
        self._expand = expand
        self._expanded: dict[int, tuple[IntArray, list[float] | None]] = {}
        self._manifest = manifest
        self._verify = verify
        self._verified: set[int] = set()
        self._indexes: OrderedDict[int, tuple[ShardIndex, int]] = OrderedDict()
        self._index_bytes = 0
        self._index_checked: set[int] = set()
        self._open_shard = -1
        self._file: BinaryIO | None = None
        self._zstd: Any = None
        self._zstd_error: type[Exception] = OSError
        if manifest.compression == "zstd":
            import zstandard

            self._zstd = zstandard.ZstdDecompressor()
            self._zstd_error = zstandard.ZstdError

    def index(self, shard: int) -> ShardIndex:
        """The sidecar index of ``shard``.

        Indexes are cached up to INDEX_CACHE_BYTES (least recently used out);
        each one's sha256 is checked against the manifest the first time.

        Raises:
            ManifestError: the index is missing, corrupt or not the one the manifest lists.
        """
        cached = self._indexes.get(shard)
        if cached is not None:
            self._indexes.move_to_end(shard)
            return cached[0]
        entry = self._manifest.shards[shard]
        try:
            data = self._source.read_bytes(entry.index_file)
        except OSError as err:
            raise ManifestError(
                f"{self._source.path(entry.index_file)}: cannot read ({err})"
            ) from err
        if shard not in self._index_checked:
            actual = hashlib.sha256(data).hexdigest()
            if actual != entry.index_sha256:
                raise ChecksumMismatchError.for_file(
                    self._source.path(entry.index_file), entry.index_sha256, actual
                )
            self._index_checked.add(shard)
        index = decode_index(data, self._source.path(entry.index_file))
        self._indexes[shard] = (index, len(data))
        self._index_bytes += len(data)
        while self._index_bytes > INDEX_CACHE_BYTES and len(self._indexes) > 1:
            self._index_bytes -= self._indexes.popitem(last=False)[1][1]
        return index

    def _expanded_ids(self, shard: int) -> tuple[IntArray, list[float] | None]:
        """Raw sample ids (and weights) of the shard's reweighted sequence; cached per shard."""
        if self._expand is None:
            raise RuntimeError("no reweighting configured")
        if shard not in self._expanded:
            if len(self._expanded) >= INDEX_CACHE:
                self._expanded.pop(next(iter(self._expanded)))
            self._expanded[shard] = self._expand(shard, self.index(shard))
        return self._expanded[shard]

    def sample_sizes(self, piece: SampleRange) -> list[int]:
        """Bytes each sample of ``piece`` occupies in the tar (for byte-bounded buffers)."""
        offsets = self.index(piece.shard).sample_offset
        if self._expand is None:
            sizes = np.diff(offsets[piece.start : piece.stop + 1])
        else:
            ids = self._expanded_ids(piece.shard)[0][piece.start : piece.stop]
            sizes = offsets[ids + 1] - offsets[ids]
        result: list[int] = sizes.tolist()
        return result

    def read(self, piece: SampleRange) -> Chunk:
        """The samples of ``piece`` (positions of the reweighted sequence when reweighting)."""
        if self._expand is None:
            return self._read_raw(piece)
        ids, weights = self._expanded_ids(piece.shard)
        selected = ids[piece.start : piece.stop]
        first = int(selected[0])
        raw = SampleRange(piece.shard, first, int(selected[-1]) + 1, piece.padded)
        extra = None if weights is None else {"__weight__": weights[piece.start : piece.stop]}
        return self._read_raw(raw, (selected - first).tolist(), extra)

    def _read_raw(
        self,
        piece: SampleRange,
        selection: list[int] | None = None,
        extra: dict[str, list[Any]] | None = None,
    ) -> Chunk:
        """The samples of ``piece``.

        Raises:
            CorruptShardError: the shard is shorter than its index says, or a
                zstd frame does not decompress.
            ChecksumMismatchError: with ``verify=True``, the shard's sha256 differs.
        """
        index = self.index(piece.shard)
        if self._verify and piece.shard not in self._verified:
            self._check_sha256(piece.shard)
        offsets = index.sample_offset
        begin, end = int(offsets[piece.start]), int(offsets[piece.stop])
        if self._zstd is None:
            data = self._pread(piece, index, begin, end - begin)
            return Chunk(data, begin, index, piece, selection, extra)
        frames, frame_offset = index.frame_sample, index.frame_offset
        f0 = int(np.searchsorted(frames, piece.start, side="right")) - 1
        f1 = int(np.searchsorted(frames, piece.stop, side="left"))
        base = int(offsets[int(frames[f0])])
        start, stop = int(frame_offset[f0]), int(frame_offset[f1])
        compressed = self._pread(piece, index, start, stop - start)
        parts = []
        for f in range(f0, f1):
            a, b = int(frame_offset[f]) - start, int(frame_offset[f + 1]) - start
            try:
                parts.append(self._zstd.decompress(compressed[a:b]))
            except self._zstd_error as err:
                raise self._corrupt(piece, index, int(frames[f]), f"zstd frame {f}: {err}") from err
        return Chunk(b"".join(parts), base, index, piece, selection, extra)

    def _pread(self, piece: SampleRange, index: ShardIndex, offset: int, size: int) -> bytes:
        name = self._manifest.shards[piece.shard].file

        def read() -> bytes:
            if self._open_shard != piece.shard or self._file is None:
                self.close()
                self._file = self._source.open(name)
                self._open_shard = piece.shard
            self._file.seek(offset)
            return self._file.read(size)

        try:
            data = retry(read, self._source.path(name))
        except FileNotFoundError as err:
            raise self._corrupt(piece, index, piece.start, "shard file is missing") from err
        if len(data) != size:
            raise self._corrupt(
                piece, index, piece.start, f"shard is truncated (read {len(data)} of {size} bytes)"
            )
        return data

    def _corrupt(
        self, piece: SampleRange, index: ShardIndex, sample: int, reason: str
    ) -> CorruptShardError:
        name = self._source.path(self._manifest.shards[piece.shard].file)
        return CorruptShardError.at(
            name, index.key(sample), int(index.sample_offset[sample]), reason
        )

    def _check_sha256(self, shard: int) -> None:
        entry = self._manifest.shards[shard]
        digest = hashlib.sha256()
        with self._source.open(entry.file) as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != entry.sha256:
            raise ChecksumMismatchError.for_file(
                self._source.path(entry.file), entry.sha256, digest.hexdigest()
            )
        self._verified.add(shard)

    def close(self) -> None:
        """Close the open shard file, if any."""
        if self._file is not None:
            self._file.close()
        self._file, self._open_shard = None, -1
