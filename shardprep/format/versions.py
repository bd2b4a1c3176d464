"""Versions of a build: every build or ``--append`` is version N of OUT (docs/format.md,
"Versions").

- A plain build is version 1; its ``manifest.json`` has no ``versions`` section (so every
  build written before versions existed reads as version 1, unchanged).
- An append writes version N >= 2: a manifest of *all* shards (the earlier ones first, their
  entries unchanged, then the appended ones, numbered after them) with a ``versions``
  section, one entry per version: ``version``, ``first_shard``, ``num_shards``,
  ``num_samples``, ``input_fingerprint``, ``options``, its ``class_weighting`` if it had one,
  and, for every version but the newest, ``manifest_sha256``: the sha256 of that version's
  own manifest file, ``versions/manifest-NNNNN.json``. Those files are immutable: written
  once (version 1's by the first append, a byte copy of the ``manifest.json`` it replaces),
  never rewritten. ``manifest.json`` is the newest version, byte for byte its
  ``versions/manifest-NNNNN.json``, replaced atomically (on object storage, written last).

Pure: parsing, checking and assembling. Reading files is the caller's (a reader callback).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from shardprep.format.errors import ManifestError
from shardprep.format.manifest import (
    MAX_MANIFEST_BYTES,
    Manifest,
    manifest_from_records,
    parse_manifest,
)

__all__ = [
    "VERSIONS_DIR",
    "appended_manifest",
    "manifest_version",
    "read_version",
    "version_entries",
    "version_file",
    "version_of_shard",
    "versions_problem",
]

VERSIONS_DIR = "versions"
SECTION = "versions"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FIELDS = {"version", "first_shard", "num_shards", "num_samples", "input_fingerprint", "options"}


def version_file(version: int) -> str:
    """The path of version ``version``'s manifest file relative to OUT."""
    return f"{VERSIONS_DIR}/manifest-{version:05d}.json"


def manifest_version(manifest: Manifest) -> int:
    """The version number of ``manifest`` (1 without a ``versions`` section)."""
    entries = manifest.extra.get(SECTION)
    return len(entries) if isinstance(entries, list) and entries else 1


def version_entries(manifest: Manifest) -> list[dict[str, Any]]:
    """One entry per version of ``manifest`` (a version 1 manifest gets one, built from its
    own fields: its shards, fingerprint, options and class weighting)."""
    entries = manifest.extra.get(SECTION)
    if isinstance(entries, list) and entries:
        return [dict(e) for e in entries]
    entry: dict[str, Any] = {
        "version": 1,
        "first_shard": 0,
        "num_shards": len(manifest.shards),
        "num_samples": manifest.num_samples,
        "input_fingerprint": manifest.input_fingerprint,
        "options": manifest.options,
    }
    if "class_weighting" in manifest.extra:
        entry["class_weighting"] = manifest.extra["class_weighting"]
    return [entry]


def version_of_shard(manifest: Manifest, shard: int) -> int:
    """The version that added shard ``shard`` of ``manifest``."""
    for entry in version_entries(manifest):
        if entry["first_shard"] <= shard < entry["first_shard"] + entry["num_shards"]:
            return int(entry["version"])
    raise IndexError(f"shard {shard} is not in the manifest's {len(manifest.shards)} shards")


def versions_problem(manifest: Manifest) -> str:
    """The first way the ``versions`` section of ``manifest`` contradicts it, or ``""``
    (a manifest without one is version 1 and has none to check)."""
    if SECTION not in manifest.extra:
        return ""
    entries = manifest.extra[SECTION]
    if not isinstance(entries, list) or len(entries) < 2:
        return "versions is not a list of two or more versions"
    first = 0
    for n, entry in enumerate(entries, start=1):
        if not isinstance(entry, dict) or not set(entry) >= _FIELDS:
            return f"versions[{n - 1}] lacks one of {sorted(_FIELDS)}"
        if entry["version"] != n or entry["first_shard"] != first:
            return (
                f"versions[{n - 1}] is version {entry['version']!r} from shard "
                f"{entry['first_shard']!r}, not version {n} from shard {first}"
            )
        count = entry["num_shards"]
        if type(count) is not int or count < 1 or first + count > len(manifest.shards):
            return (
                f"version {n}: num_shards {count!r} does not fit the {len(manifest.shards)} shards"
            )
        samples = sum(s.num_samples for s in manifest.shards[first : first + count])
        if entry["num_samples"] != samples:
            return f"version {n}: num_samples is {entry['num_samples']!r} but its shards hold {samples}"
        newest = n == len(entries)
        sha = entry.get("manifest_sha256")
        if newest and sha is not None:
            return f"version {n} is the newest: it has no manifest_sha256"
        if not newest and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
            return f"version {n}: manifest_sha256 is not 64 lowercase hex digits"
        first += count
    if first != len(manifest.shards):
        return f"the versions hold {first} shards, the manifest lists {len(manifest.shards)}"
    last = entries[-1]
    if (
        last["options"] != manifest.options
        or last["input_fingerprint"] != manifest.input_fingerprint
    ):
        return "the newest version's options or input_fingerprint differ from the manifest's"
    if "class_weighting" in manifest.extra:
        return "a manifest with versions keeps class_weighting in each version, not at the top"
    return ""


def appended_manifest(
    base: Manifest,
    records: Sequence[Any],
    options: dict[str, Any],
    input_fingerprint: str,
    class_names: tuple[str, ...] | None,
    weighting: dict[str, Any] | None,
) -> Manifest:
    """The manifest of the version that appends ``records`` (ShardRecords in shard order,
    numbered after ``base``'s shards) to ``base`` (the newest version so far, as read: its
    ``fingerprint`` is the sha256 of its file). ``class_names`` is the union (``base``'s
    first, in their order); ``weighting`` the append's own class weighting section."""
    entries = version_entries(base)
    entries[-1]["manifest_sha256"] = base.fingerprint
    entry: dict[str, Any] = {
        "version": len(entries) + 1,
        "first_shard": len(base.shards),
        "num_shards": len(records),
        "num_samples": sum(r.num_samples for r in records),
        "input_fingerprint": input_fingerprint,
        "options": options,
    }
    if weighting:
        entry["class_weighting"] = weighting
    ordered = [*_records_of(base), *records]
    return manifest_from_records(
        ordered, options, input_fingerprint, class_names, extra={SECTION: [*entries, entry]}
    )


def _records_of(manifest: Manifest) -> list[Any]:
    """``manifest``'s shard entries as the records ``manifest_from_records`` takes (a
    ShardEntry has every field a record has)."""
    return list(manifest.shards)


def read_version(
    newest: Manifest, version: int | None, read: Callable[[str, int], bytes], where: str
) -> Manifest:
    """Version ``version`` of the build whose newest manifest is ``newest`` (None: the newest).

    ``read(name, limit)`` returns the first ``limit`` bytes of file ``name`` of OUT (raising
    ``FileNotFoundError`` if absent); ``where`` is OUT, for messages. The file read must be
    the one the newer manifest recorded (its sha256) and say it is that version.

    Raises:
        ManifestError: no such version, its file missing, changed or invalid.
    """
    latest = manifest_version(newest)
    if version is None or version == latest:
        return newest
    if type(version) is not int or not 1 <= version <= latest:
        raise ManifestError(
            f"{where}: there is no version {version!r}: the build has versions 1 to {latest}",
            where,
        )
    name = version_file(version)
    path = f"{where.rstrip('/')}/{name}"
    expected = version_entries(newest)[version - 1]["manifest_sha256"]
    try:
        data = read(name, MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError as err:
        raise ManifestError(
            f"{path}: version {version}'s manifest is missing (the build has versions 1 to "
            f"{latest}); it was removed: restore it from a copy, or read a newer version",
            path,
        ) from err
    manifest = parse_manifest(data, path)
    if manifest.fingerprint != expected or manifest_version(manifest) != version:
        raise ManifestError(
            f"{path}: not the manifest of version {version} that version {latest} records "
            f"(sha256 {manifest.fingerprint}, recorded {expected}); it was changed: restore "
            "it from a copy",
            path,
        )
    return manifest
