"""Resume check: is a shard that an interrupted build finished still the shard it wrote?

``build --resume`` reuses the shards an earlier build finished. Between the kill and the
resume a shard can be damaged (a disk error, a copy cut short, a hand edit); reused as it
is, the damage would reach the manifest as the shard's sha256 and be noticed only by a
reader. No sha256 of a finished shard is recorded before the manifest, so the check is
against its index, which the writer made from the same bytes:

- the index decodes and describes the writer's layout (:func:`shardprep.format.integrity.check_index`);
- the file has the size the index implies;
- every member's tar header is the one the writer makes for its key, extension and size,
  its data checksum in the index matches (and, for a version 3 index, each sample's checksum
  over its headers, padding and data), and its padding is zeros; the tar ends with
  the end marker. For ``.tar.zst`` every frame decompresses to exactly its span first.

Together these pin every byte of a plain tar except the payloads, which their 64-bit
checksums cover. The file is read once, sequentially, and its sha256 computed on the way
(the manifest needs it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

from shardprep.format.errors import ManifestError
from shardprep.format.integrity import FrameError, check_index, decompress_frame
from shardprep.format.manifest import ShardEntry
from shardprep.format.shardformat import (
    EOF_MARKER,
    ShardIndex,
    decode_index,
    index_name,
    padding,
    payload_checksum,
    sample_checksums,
    sample_ends,
    shard_name,
    tar_header,
)

__all__ = ["expected_file_bytes", "finished_shard_problem"]

CHUNK_BYTES = 16 << 20  # plain shards are read in pieces of about this many bytes
READ_BLOCK = 8 << 20


def expected_file_bytes(index: ShardIndex, compression: str, zstd_level: int) -> int:
    """The size of the shard file ``index`` describes."""
    end = int(index.sample_offset[-1])
    if compression != "zstd":
        return end + len(EOF_MARKER)
    return int(index.frame_offset[-1]) + len(_zstd_eof(zstd_level))


def _zstd_eof(zstd_level: int) -> bytes:
    import zstandard

    compressor = zstandard.ZstdCompressor(level=zstd_level, write_checksum=True)
    return bytes(compressor.compress(EOF_MARKER))


def finished_shard_problem(
    shard: int,
    index_bytes: bytes,
    read: Callable[[int], bytes],
    file_bytes: int,
    compression: str,
    zstd_level: int,
) -> tuple[str, str]:
    """``(sha256, problem)`` of the shard file that ``read(n)`` returns in order.

    ``problem`` is ``""`` when the file is exactly what the writer made for ``index_bytes``
    (see the module doc), else what is wrong, in a few words. Nothing is raised for a
    damaged shard: the caller writes it again.
    """
    where = index_name(shard)
    try:
        index = decode_index(index_bytes, where)
        expected = expected_file_bytes(index, compression, zstd_level)
        labels = index.label[index.label >= 0]
        counts = tuple(np.bincount(labels).tolist()) if len(labels) else ()
        entry = ShardEntry(
            file=shard_name(shard, compression),
            index_file=where,
            num_samples=index.num_samples,
            num_bytes=file_bytes,
            tar_bytes=int(index.sample_offset[-1]) + len(EOF_MARKER),
            sha256="",
            index_sha256="",
            index_bytes=len(index_bytes),
            class_counts=counts,
        )
        check_index(index, entry, compression == "zstd", len(counts), where)
    except ManifestError as err:
        return "", f"its index is unreadable or inconsistent ({err})"
    if file_bytes != expected:
        return "", f"it has {file_bytes} bytes, its index describes {expected}"
    stream = _HashingReader(read)
    if compression == "zstd":
        problem = _zstd_problem(index, stream, zstd_level)
    else:
        problem = _plain_problem(index, stream)
    stream.drain()
    return stream.sha256.hexdigest(), problem


class _HashingReader:
    """Exact-size reads of a stream, hashed as they pass."""

    def __init__(self, read: Callable[[int], bytes]) -> None:
        self._read = read
        self.sha256 = hashlib.sha256()

    def take(self, size: int) -> bytes:
        """The next ``size`` bytes (fewer only at the end of the file)."""
        parts = []
        while size > 0:
            block = self._read(min(size, READ_BLOCK))
            if not block:
                break
            self.sha256.update(block)
            parts.append(block)
            size -= len(block)
        return b"".join(parts)

    def drain(self) -> None:
        """Hash the rest of the file (after a problem stopped the check)."""
        while self.take(READ_BLOCK):
            pass


def _plain_problem(index: ShardIndex, stream: _HashingReader) -> str:
    offsets = index.sample_offset
    start = 0
    while start < index.num_samples:
        stop = start + 1  # whole samples, about CHUNK_BYTES at a time
        while stop < index.num_samples and offsets[stop + 1] - offsets[start] <= CHUNK_BYTES:
            stop += 1
        base = int(offsets[start])
        problem = _samples_problem(index, stream.take(int(offsets[stop]) - base), base, start, stop)
        if problem:
            return problem
        start = stop
    if stream.take(len(EOF_MARKER)) != EOF_MARKER:
        return "its tar end marker is damaged"
    return ""


def _zstd_problem(index: ShardIndex, stream: _HashingReader, zstd_level: int) -> str:
    import zstandard

    decompressor = zstandard.ZstdDecompressor()
    offsets, frames, frame_offset = index.sample_offset, index.frame_sample, index.frame_offset
    for k in range(len(frames) - 1):
        first, last = int(frames[k]), int(frames[k + 1])
        base, span = int(offsets[first]), int(offsets[last] - offsets[first])
        frame = stream.take(int(frame_offset[k + 1] - frame_offset[k]))
        try:
            data = decompress_frame(decompressor, frame, span)
        except FrameError as err:
            return f"zstd frame {k} at offset {int(frame_offset[k])}: {err}"
        problem = _samples_problem(index, data, base, first, last)
        if problem:
            return problem
    if stream.take(len(_zstd_eof(zstd_level))) != _zstd_eof(zstd_level):
        return "its tar end marker frame is damaged"
    return ""


def _samples_problem(index: ShardIndex, data: Any, base: int, start: int, stop: int) -> str:
    """The first byte of samples ``start..stop-1`` (``data`` holds them from tar offset
    ``base``) that differs from what the writer makes, as a few words; ``""`` if none."""
    view = memoryview(data)
    starts, exts = index.member_start, index.exts
    offsets, sizes, hashes = index.member_offset, index.member_size, index.member_hash
    v3 = index.version != 2
    ends = (sample_ends(index, start, stop) - base).tolist() if v3 else []
    sums = sample_checksums(index, start, stop).tolist() if v3 else []
    for i in range(start, stop):
        position = int(index.sample_offset[i]) - base
        if v3 and (
            len(view) < ends[i - start]
            or payload_checksum(view[position : ends[i - start]]) != sums[i - start]
        ):
            return f"sample {index.key(i)!r} differs from what its index records"
        key = index.key(i).encode()
        for m in range(int(starts[i]), int(starts[i + 1])):
            size = int(sizes[m])
            ext = exts[int(index.member_ext[m])].encode("utf-8", "surrogateescape")
            header = tar_header(key + b"." + ext, size)
            payload = int(offsets[m]) - base
            pad = padding(size)
            if (
                view[position:payload] != header
                or len(view) < payload + size + len(pad)
                or payload_checksum(view[payload : payload + size]) != int(hashes[m])
                or view[payload + size : payload + size + len(pad)] != pad
            ):
                return f"sample {index.key(i)!r} differs from what its index records"
            position = payload + size + len(pad)
    return ""
