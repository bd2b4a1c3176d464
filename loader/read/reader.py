"""Reader: fetch the raw bytes of sample ranges from shards, by seeking with the sidecar index.

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
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, replace
from time import perf_counter_ns
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from loader.errors import CorruptShardError, UnreachableError
from loader.io.executor import Executor
from loader.io.files import SPLIT_BYTES, ShardFiles, Unread, leaves_unread, split_read_into
from loader.io.ranges import BufferPool, RangeIO
from loader.io.source import Source
from loader.options import ReadOptions
from loader.plan.order import SampleRange
from loader.read.chunk import (
    Chunk,
    UncheckedChunk,
    _headers_checked,
)
from loader.read.telemetry import READ, Clock
from shardprep.format.errors import ChecksumMismatchError, ManifestError
from shardprep.format.integrity import (
    FrameError,
    check_index,
    decompress_frame,
    first_damaged_sample,
    salvage_frame,
)
from shardprep.format.manifest import Manifest
from shardprep.format.shardformat import (
    WEIGHT_FIELD,
    ShardIndex,
    decode_index,
)

__all__ = ["ShardReader", "checked_indexes"]

IntArray = npt.NDArray[np.int64]
INDEX_CACHE = 4  # reweighting draws kept per worker
INDEX_CACHE_BYTES = 16 << 20  # shard indexes kept per worker: ~72 B per sample of 2 members (the
# 200k samples of the `small` benchmark in 16 shards take 13.7 MiB: all of them, none read twice)
_READ = ReadOptions()


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
        split: Executor | None = None,
        executor: Executor | None = None,
        clock: Clock | None = None,
    ) -> None:
        """``read``: how shards are checked and read (``checksums``, ``verify``, ``mapped``;
        the other fields are the stream's). ``expand``: a shard's reweighted sequence.
        ``pool``: chunks may hold views: of the mapped shard with ``read.mapped`` (local plain
        shards, see the module docstring), else of the pool's reused buffers.
        ``io``: makes, from this reader, where its shard and index bytes come from instead of
        reading them itself (``loader.io.readahead.read_ahead``: the read-ahead, with the cache);
        it gets the reader because a read plan needs the reader's indexes.
        ``unread``: a local uncompressed output's chunks of large samples are left unread,
        for batches that read their own samples (``loader.io.files``, ``loader.torch.scatter``).
        ``shared``: indexes read and checked already (``checked_indexes``), used as they are.
        ``split``: the reader's executor when it is alone in its process (in process, or a
        DataLoader's only worker): a local output's reads are shared with one of its threads
        (``loader.io.files.split_read_into``, ``together``). ``executor``: the reader's threads
        (``split``'s, a local read-ahead's), closed with the reader. ``clock``: where the
        time of each ``read`` is counted (``loader.read.telemetry``; default: nowhere kept)."""
        checksums, mapped = read.checksums, read.mapped
        self._clock = clock or Clock()
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
        self._split = split if not source.remote else None
        self._executor = executor
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
        began = perf_counter_ns()
        try:
            return self._read(piece)
        finally:
            self._clock.add(READ, perf_counter_ns() - began)

    def _read(self, piece: SampleRange) -> Chunk:
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
                return buffer[: split_read_into(self._split, self._file.fileno(), buffer, offset)]
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
        if self._files is not None:
            self._files.close()
        try:
            if self.io is not None:
                self.io.close()
        finally:  # (a Ctrl-C in a join still stops the other threads)
            if self._executor is not None:
                self._executor.close()

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()  # its mappings stay valid until their last view goes
        self._file, self._open_shard, self._mappable = None, -1, None


def _identity(status: os.stat_result) -> tuple[int, int, int, int]:
    """What tells an open shard file from another file or from itself changed: device, inode,
    size, modification time (ns)."""
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def _frames_of(index: ShardIndex, piece: SampleRange) -> tuple[int, int]:
    """The zstd frames ``[f0, f1)`` that hold the samples of ``piece``."""
    f0 = int(np.searchsorted(index.frame_sample, piece.start, side="right")) - 1
    f1 = int(np.searchsorted(index.frame_sample, piece.stop, side="left"))
    return f0, f1
