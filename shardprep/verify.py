"""Verify: re-read every shard of a build and check it against the manifest and its index.

Checks, per shard: the shard and index files exist and match their sha256;
the index's sample count and class histogram match the manifest; reading the
tar from the start finds exactly the members the index lists, with the same
names, sizes and offsets (so every sample is complete); for ``.tar.zst``,
every frame in the index decompresses on its own to the expected length.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO

import numpy as np
from tqdm import tqdm

from shardprep.manifest import Manifest, ShardEntry, read_manifest
from shardprep.shardformat import ShardIndex, decode_index

__all__ = ["VerifyReport", "verify_output"]


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_output`: empty ``problems`` means everything checked out."""

    num_shards: int = 0
    num_samples: int = 0
    problems: list[str] = field(default_factory=list)


def verify_output(out: str, progress: bool = False) -> VerifyReport:
    """Check every shard of the build in ``out``; problems are collected, not raised.

    Raises:
        ManifestError: the manifest itself is missing or invalid.
    """
    manifest = read_manifest(out)
    report = VerifyReport(num_shards=len(manifest.shards))
    for entry in tqdm(manifest.shards, desc="verify", unit=" shards", disable=not progress):
        problems = list(_verify_shard(out, manifest, entry))
        report.problems += [f"{entry.file}: {p}" for p in problems]
        report.num_samples += entry.num_samples
    return report


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _verify_shard(out: str, manifest: Manifest, entry: ShardEntry) -> Iterator[str]:
    path, idx_path = os.path.join(out, entry.file), os.path.join(out, entry.index_file)
    for p in (path, idx_path):
        if not os.path.exists(p):
            yield f"missing file {os.path.basename(p)}"
            return
    if _sha256(path) != entry.sha256:
        yield "sha256 of the shard does not match the manifest (corrupt or modified)"
    with open(idx_path, "rb") as f:
        index_bytes = f.read()
    if hashlib.sha256(index_bytes).hexdigest() != entry.index_sha256:
        yield "sha256 of the index does not match the manifest"
        return
    index = decode_index(index_bytes, idx_path)
    if index.num_samples != entry.num_samples:
        yield f"index has {index.num_samples} samples, manifest says {entry.num_samples}"
    if manifest.class_names is not None:
        counts = np.bincount(index.label[index.label >= 0], minlength=len(manifest.class_names))
        if tuple(counts.tolist()) != entry.class_counts:
            yield "class histogram of the index does not match the manifest"
    compressed = manifest.compression == "zstd"
    unreadable: tuple[type[Exception], ...] = (tarfile.TarError, OSError, EOFError)
    if compressed:
        import zstandard

        unreadable += (zstandard.ZstdError,)  # a corrupt frame fails the stream, too
        yield from _verify_frames(path, index)
    try:
        yield from _verify_members(path, index, compressed)
    except unreadable as err:
        yield f"cannot read the tar stream ({err})"


def _open_stream(path: str, compressed: bool) -> IO[bytes]:
    raw = open(path, "rb")  # noqa: SIM115 - closed by the caller's tarfile/with
    if not compressed:
        return raw
    import zstandard

    return zstandard.ZstdDecompressor().stream_reader(raw, closefd=True, read_across_frames=True)


def _verify_members(path: str, index: ShardIndex, compressed: bool) -> Iterator[str]:
    expected = [
        (
            f"{index.key(i)}.{index.exts[int(index.member_ext[m])]}",
            int(index.member_offset[m]),
            int(index.member_size[m]),
            i,
        )
        for i in range(index.num_samples)
        for m in range(int(index.member_start[i]), int(index.member_start[i + 1]))
    ]
    with _open_stream(path, compressed) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
        position = -1  # a stream that ends at once (zeroed first block) has no members
        for position, member in enumerate(tar):
            if position >= len(expected):
                yield f"unexpected extra member {member.name!r}"
                return
            name, offset, size, sample = expected[position]
            if (member.name, member.offset_data, member.size) != (name, offset, size):
                yield (
                    f"sample {index.key(sample)!r}: member {member.name!r} at offset "
                    f"{member.offset_data} ({member.size} bytes) but the index expects {name!r} "
                    f"at {offset} ({size} bytes)"
                )
                return
        if position + 1 != len(expected) if expected else False:
            yield f"tar ends after {position + 1} members, the index lists {len(expected)}"


def _verify_frames(path: str, index: ShardIndex) -> Iterator[str]:
    import zstandard

    starts, offsets = index.frame_sample, index.frame_offset
    if len(starts) < 2 or int(starts[0]) != 0 or int(starts[-1]) != index.num_samples:
        yield "zstd frame table does not cover every sample"
        return
    with open(path, "rb") as f:
        for k in range(len(starts) - 1):
            f.seek(int(offsets[k]))
            frame = f.read(int(offsets[k + 1] - offsets[k]))
            want = int(
                index.sample_offset[int(starts[k + 1])] - index.sample_offset[int(starts[k])]
            )
            try:
                got = len(zstandard.ZstdDecompressor().decompress(frame, max_output_size=want))
            except zstandard.ZstdError as err:
                yield f"zstd frame {k} at offset {int(offsets[k])} does not decompress alone ({err})"
                return
            if got != want:
                yield f"zstd frame {k} decompresses to {got} bytes, the index expects {want}"
                return
