"""Verify: re-read every shard of a build and check it against the manifest and its index.

Checks, per shard (``docs/cli.md`` lists them for users):

- the manifest is consistent with itself (``read_manifest``: names confined
  to the folder, totals and class counts equal the sums over the shards);
- the shard and index files exist, have the sizes and sha256 the manifest gives;
- the index agrees with the manifest entry and describes the tar layout
  exactly (``shardprep.format.integrity.check_index``);
- every member's data matches its checksum in the index and (version 3) every
  sample's bytes (its tar headers, the padding between its members, its data)
  match the sample's checksum; for version 2 the headers are compared with the
  writer's instead; the
  damaged samples are named by key); for ``.tar.zst``, every frame
  decompresses on its own to exactly its span, never further;
- reading the tar from the start finds exactly the members the index lists,
  with the same names, sizes and offsets;
- every earlier version of the build (docs/format.md, "Versions") has its manifest file in
  ``versions/``, with the sha256 the newest manifest records, and lists the newest's first
  shards (its classes the newest's first classes).

Every read is bounded by the sizes in the manifest and index. Problems are
collected per shard, never raised, so one bad shard does not hide the others.

An OUT at a URL is checked the same way, by the same functions: its objects' sizes come
from one listing, and each shard and index is copied to a private temporary folder with
ranged parallel reads (:class:`~shardprep.url_output.RemoteOutput`), ``THREADS`` shards at a
time (so at most ``THREADS`` shards' bytes on the local disk), then checked and removed.
The threads run in this process: verify has no engine seam (``--engine ray`` is not offered).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tarfile
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import IO, Any

from tqdm import tqdm

from shardprep.format.errors import ManifestError
from shardprep.format.integrity import (
    FrameError,
    check_index,
    damaged_samples,
    decompress_frame,
    salvage_frame,
)
from shardprep.format.manifest import Manifest, ShardEntry
from shardprep.format.shardformat import BLOCK, ShardIndex, decode_index
from shardprep.format.versions import manifest_version, read_version, version_file
from shardprep.storage import is_url
from shardprep.url_output import RemoteOutput, read_manifest_at

__all__ = ["VerifyReport", "verify_output"]

CHUNK_BYTES = 16 << 20  # plain shards are checked in reads of about this size
NAMED = 10  # damaged samples named per shard; the rest are counted
THREADS = 4  # shards of a URL OUT read and checked at a time


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_output`: empty ``problems`` means everything checked out."""

    num_shards: int = 0
    num_samples: int = 0
    problems: list[str] = field(default_factory=list)
    version: int = 1  # the newest version of the build (every earlier one is checked too)


def verify_output(
    out: str,
    progress: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    threads: int = THREADS,
) -> VerifyReport:
    """Check every shard of the build in ``out`` (a folder or a URL); problems are collected,
    not raised. ``storage_options`` are fsspec's, for a URL; ``threads`` shards of a URL are
    read and checked at a time.

    Raises:
        ManifestError: the manifest itself is missing, invalid or inconsistent.
        InputError: the storage of a URL gives no answer in time.
    """
    manifest = read_manifest_at(out, storage_options)
    report = VerifyReport(num_shards=len(manifest.shards), version=manifest_version(manifest))
    results: Iterable[list[str]]
    if is_url(out):
        remote = RemoteOutput(out, storage_options)
        report.problems += _version_problems(out, manifest, remote.read)
        results = _remote_results(remote, manifest, threads)
    else:
        report.problems += _version_problems(out, manifest, partial(_read_local, out))
        results = (list(_verify_shard(out, manifest, entry)) for entry in manifest.shards)
    bar = tqdm(manifest.shards, desc="verify", unit=" shards", disable=not progress)
    for entry, problems in zip(bar, results, strict=True):
        report.problems += [f"{entry.file}: {p}" for p in problems]
        report.num_samples += entry.num_samples
    return report


def _read_local(out: str, name: str, limit: int) -> bytes:
    with open(os.path.join(out, name), "rb") as f:
        return f.read(limit)


def _version_problems(out: str, manifest: Manifest, read: Callable[[str, int], bytes]) -> list[str]:
    """What is wrong with the build's earlier versions (none for a version 1 build)."""
    problems = []
    for n in range(1, manifest_version(manifest)):
        try:
            earlier = read_version(manifest, n, read, out)
        except (ManifestError, OSError) as err:
            problems.append(f"{version_file(n)}: {err}")
            continue
        names, newest = earlier.class_names or (), manifest.class_names or ()
        if tuple(newest[: len(names)]) != tuple(names):
            problems.append(f"{version_file(n)}: its classes are not the newest version's first")
        shards = manifest.shards[: len(earlier.shards)]
        for old, new in zip(earlier.shards, shards, strict=True):
            padded = old.class_counts + (0,) * (len(newest) - len(names))
            if replace(old, class_counts=padded) != new:
                problems.append(
                    f"{version_file(n)}: {old.file} differs from the newest version's entry "
                    "(a version never rewrites an earlier shard)"
                )
                break
    return problems


def _remote_results(remote: RemoteOutput, manifest: Manifest, threads: int) -> Iterator[list[str]]:
    """The problems of each shard of a URL OUT, in shard order; ``threads`` shards in flight."""
    sizes = remote.sizes()
    with (
        tempfile.TemporaryDirectory(prefix="shardprep-verify-") as spool,
        ThreadPoolExecutor(max(1, threads), thread_name_prefix="shardprep-verify") as pool,
    ):
        entries = iter(manifest.shards)
        pending: deque[Future[list[str]]] = deque()
        for entry in entries:
            pending.append(pool.submit(_verify_remote_shard, remote, manifest, entry, sizes, spool))
            if len(pending) >= max(1, threads):
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _verify_remote_shard(
    remote: RemoteOutput, manifest: Manifest, entry: ShardEntry, sizes: dict[str, int], spool: str
) -> list[str]:
    """The problems of one shard of a URL OUT: copied locally, then checked as a local one."""
    for name in (entry.file, entry.index_file):
        if name not in sizes:
            return [f"missing file {name}"]
    folder = tempfile.mkdtemp(dir=spool)
    path, idx_path = os.path.join(folder, entry.file), os.path.join(folder, entry.index_file)
    try:
        # at most one byte more than the manifest gives: a larger object fails its sha256
        remote.copy(entry.file, min(sizes[entry.file], entry.num_bytes + 1), path)
        remote.copy(entry.index_file, min(sizes[entry.index_file], entry.index_bytes + 1), idx_path)
        where = remote.url(entry.index_file)
        return list(_verify_files(path, idx_path, sizes[entry.file], manifest, entry, where))
    except OSError as err:
        return [f"cannot read ({err})"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


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
    yield from _verify_files(path, idx_path, os.path.getsize(path), manifest, entry)


def _verify_files(
    path: str,
    idx_path: str,
    size: int,
    manifest: Manifest,
    entry: ShardEntry,
    idx_where: str = "",
) -> Iterator[str]:
    """The problems of a shard file and its index (local files; ``size``: the shard's size
    where it is stored, ``idx_where``: the index's name in messages, if not ``idx_path``)."""
    if size != entry.num_bytes:
        yield f"the file has {size} bytes, the manifest says {entry.num_bytes}"
    if _sha256(path) != entry.sha256:
        yield "sha256 of the shard does not match the manifest (corrupt or modified)"
    with open(idx_path, "rb") as f:
        index_bytes = f.read(entry.index_bytes + 1)
    if hashlib.sha256(index_bytes).hexdigest() != entry.index_sha256:
        yield "sha256 of the index does not match the manifest"
        return
    compressed = manifest.compression == "zstd"
    classes = len(manifest.class_names) if manifest.class_names is not None else 0
    try:
        index = decode_index(index_bytes, idx_where or idx_path)
        check_index(index, entry, compressed, classes, entry.index_file)
    except ManifestError as err:
        yield str(err)
        return
    yield from _verify_samples(path, index, compressed)
    unreadable: tuple[type[Exception], ...] = (tarfile.TarError, OSError, EOFError)
    if compressed:
        import zstandard

        unreadable += (zstandard.ZstdError,)  # a corrupt frame fails the stream, too
    try:
        yield from _verify_members(path, index, entry, compressed)
    except unreadable as err:
        yield f"cannot read the tar stream ({err})"


def _verify_samples(path: str, index: ShardIndex, compressed: bool) -> Iterator[str]:
    """Every member's checksum; zstd frames one by one, each bounded by its span."""
    damaged: list[int] = []
    offsets = index.sample_offset
    with open(path, "rb") as f:
        if not compressed:
            start = 0
            while start < index.num_samples:
                stop = start + 1  # whole samples, about CHUNK_BYTES at a time
                while (
                    stop < index.num_samples and offsets[stop + 1] - offsets[start] <= CHUNK_BYTES
                ):
                    stop += 1
                base = int(offsets[start])
                f.seek(base)
                data = f.read(int(offsets[stop]) - base)
                damaged += damaged_samples(index, data, base, start, stop)
                start = stop
        else:
            import zstandard

            decompressor = zstandard.ZstdDecompressor()
            frames, frame_offset = index.frame_sample, index.frame_offset
            for k in range(len(frames) - 1):
                first, last = int(frames[k]), int(frames[k + 1])
                base, span = int(offsets[first]), int(offsets[last] - offsets[first])
                f.seek(int(frame_offset[k]))
                frame = f.read(int(frame_offset[k + 1] - frame_offset[k]))
                try:
                    data = decompress_frame(decompressor, frame, span)
                except FrameError as err:
                    yield f"zstd frame {k} at offset {int(frame_offset[k])}: {err}"
                    data = salvage_frame(frame, span)
                damaged += damaged_samples(index, data, base, first, last)
    if damaged:
        named = ", ".join(f"{index.key(i)!r} (offset {int(offsets[i])})" for i in damaged[:NAMED])
        more = f" and {len(damaged) - NAMED} more" if len(damaged) > NAMED else ""
        yield f"{len(damaged)} damaged sample(s) (missing bytes or checksum mismatch): {named}{more}"


class _Capped(io.RawIOBase):
    """At most ``limit`` bytes of ``stream``: a zstd bomb cannot make the tar pass run on."""

    def __init__(self, stream: IO[bytes], limit: int) -> None:
        self._stream, self._left = stream, limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self._stream.read(min(len(view), self._left))
        view[: len(data)] = data
        self._left -= len(data)
        return len(data)

    def close(self) -> None:
        self._stream.close()
        super().close()


def _open_stream(path: str, compressed: bool, limit: int) -> IO[bytes]:
    raw = open(path, "rb")  # noqa: SIM115 - closed by the caller's tarfile/with
    if not compressed:
        return raw
    import zstandard

    stream = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True, read_across_frames=True)
    return io.BufferedReader(_Capped(stream, limit))


def _verify_members(
    path: str, index: ShardIndex, entry: ShardEntry, compressed: bool
) -> Iterator[str]:
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
    limit = entry.tar_bytes + BLOCK
    with (
        _open_stream(path, compressed, limit) as stream,
        tarfile.open(fileobj=stream, mode="r|") as tar,
    ):
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
