"""Write: copy one planned shard's samples into a tar (or .tar.zst) plus its sidecar index.

A shard is written to a hidden temporary name, flushed to disk and renamed,
index first, so a file named ``shard-NNNNN.tar`` is always complete. Output
bytes depend only on the samples and their order (fixed tar metadata, fixed
zstd level and frame boundaries), never on timing or on which process writes.
"""

from __future__ import annotations

import errno
import hashlib
import os
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import xxhash

from shardprep.format.errors import WriteError
from shardprep.format.shardformat import (
    BLOCK,
    EOF_MARKER,
    FRAME_BYTES,
    MAX_EXTENSIONS,
    decode_index,
    encode_index,
    index_name,
    payload_checksum,
    sample_layout,
    shard_name,
    tar_header,
)
from shardprep.inventory import SampleRef
from shardprep.remote_input import RemoteParts
from shardprep.storage import is_url
from shardprep.transform import MapError, SampleMap, apply_map

__all__ = [
    "FRAME_BYTES",
    "ResumableWriteError",
    "ShardRecord",
    "record_from_index",
    "write_shard",
]


class ResumableWriteError(WriteError):
    """Writing a shard failed on a cause outside the build (a full disk, a source that
    vanished, storage that stopped answering): once it is fixed, the same build resumed
    finishes. The message says what happened; the builder adds what OUT keeps, counted, and
    how to resume as the caller gives options (:func:`shardprep.builder.resume_advice`)."""

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.shard_index))


LABEL_EXT = "cls"
WEIGHT_EXT = "weight"


@dataclass(frozen=True, slots=True)
class ShardRecord:
    """What the manifest records about one written shard."""

    index: int
    file: str
    index_file: str
    num_samples: int
    num_bytes: int  # size of the shard file as stored (compressed for .tar.zst)
    tar_bytes: int  # size of the uncompressed tar
    sha256: str
    index_sha256: str
    index_bytes: int  # size of the sidecar index file
    class_counts: tuple[int, ...]


class _ShardBuffer:
    """The shard being written: buffered tar bytes, its sidecar-index columns, and its sha256.

    Bytes are emitted in chunks of about FRAME_BYTES that always end on a sample
    boundary; for zstd each chunk becomes one independent frame, recorded in
    the frame table so a reader can start decompressing at any frame.
    """

    def __init__(self, out: BinaryIO, compression: str, zstd_level: int) -> None:
        self._out = out
        self._zstd = None
        if compression == "zstd":
            import zstandard

            self._zstd = zstandard.ZstdCompressor(level=zstd_level, write_checksum=True)
        self.buffer = bytearray()
        self.flushed = 0  # uncompressed bytes already emitted
        self.file_bytes = 0
        self.sha256 = hashlib.sha256()
        self._exts: dict[str, tuple[int, bytes]] = {}
        self.sample_offset = array("Q")
        self.member_start = array("Q", [0])
        self.member_ext = array("H")
        self.member_offset = array("Q")
        self.member_size = array("Q")
        self.member_hash = array("Q")
        self.sample_hash = array("Q")  # of the sample's bytes; stored ^ its layout
        self.label = array("i")
        self.copy = array("I")
        self.multiplicity = array("I")
        self.keys = bytearray()
        self.key_end = array("Q")
        self.sources = bytearray()
        self.source_end = array("Q")
        self.frame_sample = array("Q")
        self.frame_offset = array("Q")

    def add(self, key: bytes, members: list[tuple[str, bytes]], sample: SampleRef) -> None:
        """Append one sample's members as tar records and record them in the index.

        Each member's checksum covers its data; the sample's covers its bytes from its first
        header to the end of its last member's data (``shardformat.sample_ends``).
        """
        buffer = self.buffer
        position = self.flushed + len(buffer)
        if self._zstd is not None and not buffer:
            self.frame_sample.append(len(self.label))  # this sample opens a new frame
            self.frame_offset.append(self.file_bytes)
        self.sample_offset.append(position)
        whole = xxhash.xxh3_64()  # seed 0, as payload_checksum: the sample_hash
        pad = 0  # the previous member's padding
        for ext, data in members:
            ext_id, dot_ext = self._exts.get(ext) or self._new_ext(ext)
            size = len(data)
            header = tar_header(key + dot_ext, size)
            position += len(header)
            self.member_ext.append(ext_id)
            self.member_offset.append(position)
            self.member_size.append(size)
            self.member_hash.append(payload_checksum(data))
            whole.update(_ZEROS[:pad])
            whole.update(header)
            whole.update(data)
            pad = -size % BLOCK
            buffer += header
            buffer += data
            buffer += _ZEROS[:pad]
            position += size + pad
        self.member_start.append(len(self.member_size))
        self.sample_hash.append(whole.intdigest())
        self.label.append(sample.label)
        self.copy.append(sample.copy)
        self.multiplicity.append(sample.multiplicity)
        self.keys += key
        self.key_end.append(len(self.keys))
        self.sources += sample.source.encode("utf-8", "surrogateescape")
        self.source_end.append(len(self.sources))

    def _new_ext(self, ext: str) -> tuple[int, bytes]:
        if len(self._exts) >= MAX_EXTENSIONS:  # member_ext is uint16: refused, not overflowed
            raise _TooManyNames(ext)
        entry = self._exts[ext] = (len(self._exts), b"." + ext.encode("utf-8", "surrogateescape"))
        return entry

    def flush(self) -> None:
        """Emit the buffered bytes (one zstd frame when compressing)."""
        if not self.buffer:
            return
        chunk = self._zstd.compress(self.buffer) if self._zstd is not None else self.buffer
        self.sha256.update(chunk)
        self._out.write(chunk)
        self.file_bytes += len(chunk)
        self.flushed += len(self.buffer)
        self.buffer = bytearray()

    def finish(self) -> int:
        """Flush the samples, close the frame table, append the tar end marker.

        The end marker gets a zstd frame of its own, so ``frame_offset[-1]``
        is where the sample data ends. Returns the tar offset of the marker.
        """
        self.flush()
        end_offset = self.flushed
        if self._zstd is not None:
            self.frame_sample.append(len(self.label))
            self.frame_offset.append(self.file_bytes)
        self.buffer += EOF_MARKER
        self.flush()
        return end_offset

    def encode_index(self, end_offset: int) -> bytes:
        """The sidecar index of everything added so far."""
        arrays = {
            "sample_offset": [*self.sample_offset, end_offset],
            "member_start": self.member_start,
            "member_ext": self.member_ext,
            "member_offset": self.member_offset,
            "member_size": self.member_size,
            "member_hash": self.member_hash,
            "sample_hash": np.frombuffer(self.sample_hash, dtype=np.uint64)
            ^ sample_layout(
                np.frombuffer(self.sample_offset, dtype=np.uint64),
                np.frombuffer(self.member_start, dtype=np.uint64),
                np.frombuffer(self.member_offset, dtype=np.uint64),
                np.frombuffer(self.member_size, dtype=np.uint64),
            ),
            "label": self.label,
            "copy": self.copy,
            "multiplicity": self.multiplicity,
            "key_end": self.key_end,
            "source_end": self.source_end,
            "frame_sample": self.frame_sample,
            "frame_offset": self.frame_offset,
            "key_blob": np.frombuffer(bytes(self.keys), dtype=np.uint8),
            "source_blob": np.frombuffer(bytes(self.sources), dtype=np.uint8),
        }
        return encode_index(list(self._exts), arrays)


_ZEROS = bytes(BLOCK)


class _TooManyNames(Exception):
    """A sample brings the shard's distinct member names past MAX_EXTENSIONS (only a --map
    can: the scan bounds a build's names); write_shard names the shard and the sample."""


class _PartReader:
    """Reads a part's bytes from a file, from inside a tar or from a URL, checking its size."""

    def __init__(self, remote: RemoteParts | None = None) -> None:
        self._tar_fds: dict[str, int] = {}
        self._remote = remote

    def read(self, path: str, offset: int, size: int) -> bytes:
        if self._remote is not None and is_url(path):
            return self._remote.read(path, size, offset)
        if offset >= 0:
            fd = self._tar_fds.get(path)
            if fd is None:
                fd = self._tar_fds[path] = os.open(path, os.O_RDONLY)
            data = os.pread(fd, size, offset)
        else:
            fd = os.open(path, os.O_RDONLY)
            try:
                data = os.read(fd, size + 1)
                while len(data) < size:  # a short read: keep reading to tell it from a shrink
                    more = os.read(fd, size + 1 - len(data))
                    if not more:
                        break
                    data += more
            finally:
                os.close(fd)
        if len(data) != size:
            raise OSError(errno.EIO, f"size changed since the scan ({size} -> {len(data)} bytes)")
        return data

    def close(self) -> None:
        for fd in self._tar_fds.values():
            os.close(fd)
        self._tar_fds.clear()
        if self._remote is not None:
            self._remote.close()


def _remote_parts(
    samples: Sequence[SampleRef], storage_options: Mapping[str, Any] | None
) -> RemoteParts | None:
    """The fetcher of the samples' URL parts, in read order; None if all parts are local."""
    urls = [(p.path, p.size, p.offset) for s in samples for p in s.parts if is_url(p.path)]
    return RemoteParts(urls, storage_options) if urls else None


def write_shard(
    index: int,
    samples: Sequence[SampleRef],
    out_dir: str,
    num_classes: int,
    compression: str = "none",
    zstd_level: int = 3,
    progress: Callable[[int], None] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    transform: SampleMap | None = None,
) -> ShardRecord:
    """Write ``samples`` in order as shard ``index`` in ``out_dir`` and return its record.

    ``progress(n)`` is called after every ``n`` samples written. Parts whose path is a URL
    are read through fsspec with ``storage_options`` (:mod:`shardprep.remote_input`).
    ``transform`` (``--map``) turns each sample's members into those written
    (:mod:`shardprep.transform`); sizes and checksums are those of the written members.

    Raises:
        WriteError: a source vanished, changed size or could not be read, or the
            disk is full; raised from the underlying error and naming the file.
        MapError: ``transform`` raised or returned a sample that cannot be written.
    """
    final = os.path.join(out_dir, shard_name(index, compression))
    tmp = os.path.join(out_dir, f".{shard_name(index, compression)}.partial")
    idx_final = os.path.join(out_dir, index_name(index))
    idx_tmp = os.path.join(out_dir, f".{index_name(index)}.partial")
    reader = _PartReader(_remote_parts(samples, storage_options))
    current = ""
    try:
        with open(tmp, "wb") as out:
            shard = _ShardBuffer(out, compression, zstd_level)
            class_counts = [0] * num_classes
            done = 0
            for sample in samples:
                current = sample.source
                key = sample.key.encode()
                members = _read_members(sample, reader)
                if transform is not None:
                    members = apply_map(transform, sample.key, members, index, sample.source)
                try:
                    shard.add(key, members, sample)
                except _TooManyNames as err:
                    raise _names_error(index, sample, transform, str(err)) from None
                if sample.label >= 0:
                    class_counts[sample.label] += 1
                done += 1
                if len(shard.buffer) >= FRAME_BYTES:
                    shard.flush()
                    if progress:
                        progress(done)
                        done = 0
            end_offset = shard.finish()
            if progress and done:
                progress(done)
            # No fsync: rename after a complete write already guarantees that a
            # crashed or killed build never leaves a complete-looking shard;
            # fsync would only add power-loss safety at a large cost in speed.
        index_bytes = shard.encode_index(end_offset)
        with open(idx_tmp, "wb") as f:
            f.write(index_bytes)
        os.replace(idx_tmp, idx_final)
        os.replace(tmp, final)
    except OSError as err:
        what = "no space left on the device" if err.errno == errno.ENOSPC else str(err)
        raise ResumableWriteError(
            f"shard {index}: {what} (while writing sample from {current!r})", index
        ) from err
    finally:
        reader.close()
    return ShardRecord(
        index=index,
        file=os.path.basename(final),
        index_file=os.path.basename(idx_final),
        num_samples=len(samples),
        num_bytes=shard.file_bytes,
        tar_bytes=end_offset + len(EOF_MARKER),
        sha256=shard.sha256.hexdigest(),
        index_sha256=hashlib.sha256(index_bytes).hexdigest(),
        index_bytes=len(index_bytes),
        class_counts=tuple(class_counts),
    )


def _names_error(
    index: int, sample: SampleRef, transform: SampleMap | None, ext: str
) -> WriteError:
    """The refusal of the sample whose member ``ext`` would be shard ``index``'s
    (MAX_EXTENSIONS + 1)-th distinct member name."""
    where = f"shard {index}: " + (
        f"map {transform.name} on sample {sample.key!r}" if transform else f"sample {sample.key!r}"
    )
    text = (
        f"{where} (from {sample.source!r}): its member {ext!r} would be the shard's "
        f"{MAX_EXTENSIONS + 1:,}th distinct member name; a shard holds at most "
        f"{MAX_EXTENSIONS:,} (its index numbers them in 16 bits): return the same member "
        "names for every sample and put per-sample data inside a member (an .npz, a .json, "
        "a .tar) instead of in its name"
    )
    return MapError(text, index) if transform else WriteError(text, index)


def _read_members(sample: SampleRef, reader: _PartReader) -> list[tuple[str, bytes]]:
    """The sample's members in write order: data parts, .json metadata, .cls, .weight."""
    members = []
    for part in sample.parts:
        try:
            members.append((part.ext, reader.read(part.path, part.offset, part.size)))
        except FileNotFoundError as err:
            raise OSError(err.errno, f"{part.path} vanished since the scan") from err
        except OSError as err:
            raise OSError(err.errno, f"{part.path}: {err.strerror or err}") from err
    if sample.meta:
        exts = {part.ext for part in sample.parts}
        members.append(("meta.json" if "json" in exts else "json", sample.meta))
    if sample.label >= 0:
        members.append((LABEL_EXT, b"%d" % sample.label))
    if sample.weight is not None:
        members.append((WEIGHT_EXT, sample.weight))
    return members


def record_from_index(
    index: int, compression: str, index_bytes: bytes, where: str, sha256: str, num_bytes: int
) -> ShardRecord:
    """The record of shard ``index`` from its index's bytes and its shard file's sha256 and size.

    Raises:
        ManifestError: the index is unreadable (``where`` names it).
    """
    shard_index = decode_index(index_bytes, where)
    labels = shard_index.label[shard_index.label >= 0]
    return ShardRecord(
        index=index,
        file=shard_name(index, compression),
        index_file=index_name(index),
        num_samples=shard_index.num_samples,
        num_bytes=num_bytes,
        tar_bytes=int(shard_index.sample_offset[-1]) + len(EOF_MARKER),
        sha256=sha256,
        index_sha256=hashlib.sha256(index_bytes).hexdigest(),
        index_bytes=len(index_bytes),
        class_counts=tuple(np.bincount(labels).tolist()) if len(labels) else (),
    )
