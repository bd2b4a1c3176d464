"""Manifest: the O(shards) description of a finished build, written last and atomically.

Its presence means "build complete": every rank and DataLoader worker reads it
to plan an epoch without touching the data. Reading is strict: an unknown
version or a missing field is an error, not a guess, and so is a manifest
that contradicts itself: file names outside the pattern of its own folder,
totals or class counts that are not the sums over its shards.
``docs/format.md`` documents every field and rule.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardprep.format.errors import ManifestError
from shardprep.format.shardformat import BLOCK, EOF_MARKER, MANIFEST_NAME, index_name, shard_name

__all__ = [
    "MANIFEST_VERSION",
    "MAX_TAR_BYTES",
    "Manifest",
    "ShardEntry",
    "manifest_bytes",
    "manifest_from_records",
    "max_index_bytes",
    "max_shard_bytes",
    "read_manifest",
    "write_manifest",
]

JOURNAL_NAME = ".shardprep-build.json"
"""The build journal: present in OUT while a build is in progress (``build --resume`` needs it)."""
MANIFEST_FORMAT = "shardprep-manifest"
MANIFEST_VERSION = 2  # 2: shards carry per-sample checksums (index version 2), index_bytes
MAX_MANIFEST_BYTES = 256 << 20
"""Readers refuse a larger manifest.json (it is O(shards + classes): ~300 bytes per shard)."""
COMPRESSIONS = ("none", "zstd")
MAX_TAR_BYTES = 1 << 44
"""No shard holds more than 16 TiB of tar (a manifest that says so is corrupt)."""
INDEX_BASE_BYTES = 1 << 20
"""An index's fixed part at most: magic, header length and its JSON header (extensions)."""
INDEX_SAMPLE_BYTES = 1 << 16
"""An index's bytes per sample at most, besides its members: 60 bytes of arrays, its key and
its source path (64 KiB in all: a source path longer than ~60 KiB is not written)."""
INDEX_MEMBER_SHARE = 16
"""Each member takes 26 bytes of index and at least 512 bytes of tar (its header): an index's
member arrays are at most tar_bytes / 16 bytes."""
ZSTD_SLACK_BYTES = 1024
"""A .tar.zst shard is at most tar_bytes + tar_bytes / 128 + this many bytes per frame (one
frame per sample at most, plus the end marker's): zstd's worst-case expansion, with room."""
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """One shard as the manifest describes it."""

    file: str
    index_file: str
    num_samples: int
    num_bytes: int
    tar_bytes: int
    sha256: str
    index_sha256: str
    index_bytes: int
    class_counts: tuple[int, ...]


@dataclass(frozen=True)
class Manifest:
    """A parsed ``manifest.json`` (see docs/format.md)."""

    options: dict[str, Any]
    input_fingerprint: str
    class_names: tuple[str, ...] | None
    class_counts: tuple[int, ...]
    shards: tuple[ShardEntry, ...]
    extra: dict[str, Any]  # sections added by optional features (e.g. class weighting)
    fingerprint: str = ""  # sha256 of the manifest file's bytes

    @property
    def num_samples(self) -> int:
        """Total samples over all shards."""
        return sum(s.num_samples for s in self.shards)

    @property
    def compression(self) -> str:
        """``"none"`` or ``"zstd"``."""
        return str(self.options.get("compression", "none"))

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to disk (key order fixed, no timestamps)."""
        sizes = [s.num_samples for s in self.shards]
        nbytes = [s.num_bytes for s in self.shards]
        return {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "options": self.options,
            "input_fingerprint": self.input_fingerprint,
            "classes": None
            if self.class_names is None
            else [
                {"index": i, "name": name, "count": count}
                for i, (name, count) in enumerate(
                    zip(self.class_names, self.class_counts, strict=True)
                )
            ],
            "totals": {
                "num_shards": len(self.shards),
                "num_samples": sum(sizes),
                "num_bytes": sum(nbytes),
                "tar_bytes": sum(s.tar_bytes for s in self.shards),
                "min_shard_samples": min(sizes),
                "max_shard_samples": max(sizes),
                "shard_bytes_ratio": round(max(nbytes) / max(1, min(nbytes)), 6),
            },
            **self.extra,
            "shards": [
                {
                    "file": s.file,
                    "index_file": s.index_file,
                    "num_samples": s.num_samples,
                    "num_bytes": s.num_bytes,
                    "tar_bytes": s.tar_bytes,
                    "sha256": s.sha256,
                    "index_sha256": s.index_sha256,
                    "index_bytes": s.index_bytes,
                    "class_counts": list(s.class_counts),
                }
                for s in self.shards
            ],
        }


def manifest_from_records(
    records: Sequence[Any],
    options: dict[str, Any],
    input_fingerprint: str,
    class_names: tuple[str, ...] | None,
    extra: dict[str, Any] | None = None,
) -> Manifest:
    """Assemble a Manifest from the writer's ShardRecords (in shard order)."""
    num_classes = len(class_names) if class_names is not None else 0
    shards = tuple(
        ShardEntry(
            file=r.file,
            index_file=r.index_file,
            num_samples=r.num_samples,
            num_bytes=r.num_bytes,
            tar_bytes=r.tar_bytes,
            sha256=r.sha256,
            index_sha256=r.index_sha256,
            index_bytes=r.index_bytes,
            class_counts=tuple(r.class_counts) + (0,) * (num_classes - len(r.class_counts)),
        )
        for r in records
    )
    totals = tuple(sum(s.class_counts[c] for s in shards) for c in range(num_classes))
    return Manifest(options, input_fingerprint, class_names, totals, shards, extra or {})


def manifest_bytes(manifest: Manifest) -> bytes:
    """The bytes of ``manifest.json`` (the same wherever it is written)."""
    return json.dumps(manifest.to_json(), indent=1, ensure_ascii=False).encode() + b"\n"


def write_manifest(manifest: Manifest, out_dir: str) -> str:
    """Write ``manifest.json`` atomically (temp file, fsync, rename); returns its path."""
    path = os.path.join(out_dir, MANIFEST_NAME)
    tmp = os.path.join(out_dir, f".{MANIFEST_NAME}.partial")
    data = manifest_bytes(manifest)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Parse and validate manifest bytes; ``where`` names the source in errors.

    Besides the fields' presence and types, the manifest must agree with
    itself (see docs/format.md, "Validation"): shard ``i`` is named
    ``shard_name(i)`` / ``index_name(i)`` (so no name leaves the folder), each
    shard's class counts add up to its samples, and ``totals`` and the class
    counts are the sums over the shards.

    Raises:
        ManifestError: not JSON, not a shardprep manifest, unknown version, a
            missing or ill-typed field, or an inconsistency (naming the shard
            and the field).
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"{where}: {len(data)} bytes is larger than any shardprep manifest "
            f"({MAX_MANIFEST_BYTES} at most); not a shardprep output",
            where,
        )
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ManifestError(f"{where}: not valid JSON ({err}); rebuild the output", where) from err
    if not isinstance(obj, dict) or obj.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{where}: not a shardprep manifest", where)
    if obj.get("version") != MANIFEST_VERSION:
        older = isinstance(obj.get("version"), int) and obj["version"] < MANIFEST_VERSION
        raise ManifestError(
            f"{where}: manifest version {obj.get('version')!r} is not supported by this "
            f"shardprep (it reads version {MANIFEST_VERSION}); "
            + (
                "the output was written by an older shardprep without per-sample checksums: "
                "rebuild it (shardprep build ... --overwrite)"
                if older
                else "upgrade shardprep or rebuild"
            ),
            where,
        )
    known = {"format", "version", "options", "input_fingerprint", "classes", "totals", "shards"}
    try:
        classes = obj["classes"]
        shards = tuple(_shard_entry(s) for s in obj["shards"])
        manifest = Manifest(
            options=dict(obj["options"]),
            input_fingerprint=str(obj["input_fingerprint"]),
            class_names=None if classes is None else tuple(_str(c["name"]) for c in classes),
            class_counts=() if classes is None else tuple(_int(c["count"]) for c in classes),
            shards=shards,
            extra={k: v for k, v in obj.items() if k not in known},
            fingerprint=hashlib.sha256(data).hexdigest(),
        )
        if classes is not None and [_int(c["index"]) for c in classes] != list(range(len(classes))):
            raise ValueError("classes are not numbered 0, 1, ... in order")
        totals = dict(obj["totals"])
    except (KeyError, TypeError, ValueError) as err:
        raise ManifestError(f"{where}: missing or invalid field ({err!r}); rebuild", where) from err
    if not shards:
        raise ManifestError(f"{where}: the manifest lists no shards", where)
    problem = _inconsistency(manifest, totals)
    if problem:
        raise ManifestError(
            f"{where}: {problem}; the manifest is corrupt or was edited: rebuild the output "
            "(or restore manifest.json from a copy)",
            where,
        )
    return manifest


def _int(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string")
    return value


def _shard_entry(s: dict[str, Any]) -> ShardEntry:
    return ShardEntry(
        file=_str(s["file"]),
        index_file=_str(s["index_file"]),
        num_samples=_int(s["num_samples"]),
        num_bytes=_int(s["num_bytes"]),
        tar_bytes=_int(s["tar_bytes"]),
        sha256=_str(s["sha256"]),
        index_sha256=_str(s["index_sha256"]),
        index_bytes=_int(s["index_bytes"]),
        class_counts=tuple(_int(c) for c in s["class_counts"]),
    )


def max_index_bytes(num_samples: int, tar_bytes: int) -> int:
    """The largest sidecar index a shard of ``num_samples`` in ``tar_bytes`` of tar can have."""
    return INDEX_BASE_BYTES + num_samples * INDEX_SAMPLE_BYTES + tar_bytes // INDEX_MEMBER_SHARE


def max_shard_bytes(num_samples: int, tar_bytes: int, compression: str) -> int:
    """The largest shard file that holds ``tar_bytes`` of tar (compressed as ``compression``)."""
    if compression == "none":
        return tar_bytes
    return tar_bytes + tar_bytes // 128 + ZSTD_SLACK_BYTES * (num_samples + 2)


def _size_problem(s: ShardEntry, compression: str) -> str:
    """Which size field of ``s`` no shard can have (readers allocate by them), or ``""``."""
    if s.tar_bytes > MAX_TAR_BYTES:
        return f"tar_bytes {s.tar_bytes} is above the maximum {MAX_TAR_BYTES} (16 TiB)"
    most = max_shard_bytes(s.num_samples, s.tar_bytes, compression)
    if s.num_bytes > most:
        return (
            f"num_bytes {s.num_bytes} is above the maximum {most} for a {compression!r} shard "
            f"of {s.tar_bytes} tar bytes"
        )
    if compression != "none" and s.num_bytes == 0:
        return "num_bytes is 0; a .tar.zst shard is never empty"
    most = max_index_bytes(s.num_samples, s.tar_bytes)
    if not 16 <= s.index_bytes <= most:
        return (
            f"index_bytes {s.index_bytes} is outside 16..{most}, the sizes an index of "
            f"{s.num_samples} samples in {s.tar_bytes} tar bytes can have"
        )
    return ""


def _inconsistency(manifest: Manifest, totals: dict[str, Any]) -> str:
    """The first way ``manifest`` contradicts itself or its stated ``totals``, or ``""``."""
    compression = manifest.options.get("compression", "none")
    if compression not in COMPRESSIONS:
        return f"options.compression is {compression!r}, not one of {', '.join(COMPRESSIONS)}"
    num_classes = len(manifest.class_names) if manifest.class_names is not None else 0
    for i, s in enumerate(manifest.shards):
        where = f"shard {i} ({s.file!r})"
        if s.file != shard_name(i, compression) or s.index_file != index_name(i):
            return (
                f"{where}: files {s.file!r} and {s.index_file!r} are not "
                f"{shard_name(i, compression)!r} and {index_name(i)!r}; a manifest may only "
                "name its own shard files, in its own folder"
            )
        if len(s.class_counts) != num_classes:
            return f"{where}: {len(s.class_counts)} class counts for {num_classes} classes"
        if num_classes and sum(s.class_counts) != s.num_samples:
            return (
                f"{where}: num_samples is {s.num_samples} but its class counts add up to "
                f"{sum(s.class_counts)}"
            )
        if s.tar_bytes < len(EOF_MARKER) or s.tar_bytes % BLOCK:
            return f"{where}: tar_bytes {s.tar_bytes} is not a whole tar of 512-byte blocks"
        if compression == "none" and s.num_bytes != s.tar_bytes:
            return f"{where}: num_bytes {s.num_bytes} differs from tar_bytes {s.tar_bytes}"
        size_problem = _size_problem(s, compression)
        if size_problem:
            return f"{where}: {size_problem}"
        if not (_SHA256.fullmatch(s.sha256) and _SHA256.fullmatch(s.index_sha256)):
            return f"{where}: sha256 or index_sha256 is not 64 lowercase hex digits"
    sums = [sum(s.class_counts[c] for s in manifest.shards) for c in range(num_classes)]
    if list(manifest.class_counts) != sums:
        c = next(c for c in range(num_classes) if manifest.class_counts[c] != sums[c])
        return (
            f"class {c} ({manifest.class_names[c]!r}) has count {manifest.class_counts[c]} "  # type: ignore[index]
            f"but the shards hold {sums[c]}"
        )
    expected = manifest.to_json()["totals"]
    for field, value in expected.items():
        if totals.get(field) != value:
            return f"totals.{field} is {totals.get(field)!r} but the shards give {value!r}"
    if set(totals) != set(expected):
        return f"totals has unknown fields {sorted(set(totals) - set(expected))}"
    from shardprep.format.versions import versions_problem  # it builds on this module

    return versions_problem(manifest)


def read_manifest(out_dir: str) -> Manifest:
    """Read ``OUT/manifest.json`` from a local folder.

    Raises:
        ManifestError: missing (the build did not finish) or invalid.
    """
    path = os.path.join(out_dir, MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError as err:
        raise ManifestError(f"{path}: no manifest; {_why_no_manifest(out_dir)}", path) from err
    return parse_manifest(data, path)


def _why_no_manifest(out_dir: str) -> str:
    """What a folder without a manifest is, and the advice that works for it."""
    if os.path.exists(os.path.join(out_dir, JOURNAL_NAME)):
        return "the build did not finish (run the same shardprep build command with --resume)"
    try:
        names = os.listdir(out_dir)
    except OSError as err:
        return f"cannot list {out_dir} ({err.strerror})"
    if any(name.startswith("shard-") for name in names):
        return (
            "the build did not finish or its manifest was removed, and no build journal is "
            "left to resume from: rebuild with shardprep build --overwrite"
        )
    return f"{out_dir} is not the output of shardprep build (it holds no shards)"
