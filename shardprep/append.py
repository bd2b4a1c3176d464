"""Append: the version an ``--append`` builds on, and what it may add to it.

An append (docs/pipelines.md, "Appending") writes NEW's samples as new shards numbered after
the base version's, and publishes them as the next version (:mod:`shardprep.format.versions`).
This module decides, before anything is written:

- the base (:func:`find_base`): OUT's newest version, or, for ``--resume``, the one the
  interrupted append's journal names (OUT's manifest may already be the append itself, if the
  append was killed between publishing it and removing its journal);
- the classes (:func:`class_union`): the base's class indices never change; a class of NEW
  that the base lacks gets the next index;
- the keys (:func:`check_new_keys`): no key of NEW may be a key of the base's shards (read
  from their indexes, each checked against the sha256 the manifest records). NEW's keys are
  held in memory (about 100 bytes each), the base's are streamed an index at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from shardprep.config import BuildConfig
from shardprep.format.errors import InputError, KeyInBuildError, ManifestError
from shardprep.format.manifest import (
    JOURNAL_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    manifest_bytes,
    parse_manifest,
)
from shardprep.format.shardformat import MANIFEST_NAME, decode_index
from shardprep.format.versions import (
    manifest_version,
    read_version,
    version_file,
    version_of_shard,
)
from shardprep.inventory import InventoryView
from shardprep.weighting import Selection

__all__ = ["AppendBase", "Reader", "check_new_keys", "class_union", "find_base"]

Reader = Callable[[str, int], bytes]
"""``read(name, limit)``: the first ``limit`` bytes of file ``name`` of OUT; raises
``FileNotFoundError`` if absent (:meth:`shardprep.destination.Destination.read_out`)."""

JOURNAL_LIMIT = 1 << 20
INDEX_THREADS = 8
KEY_CHUNK = 1 << 16


@dataclass(frozen=True)
class AppendBase:
    """The version an append builds on, as read from OUT."""

    manifest: Manifest  # the base version's manifest
    data: bytes  # its file's bytes (version 1's is copied into versions/ by the first append)
    version: int
    newest: Manifest  # OUT's manifest now: the base, or (resumed after publishing) the append

    @property
    def first_shard(self) -> int:
        """The appended shards' first number."""
        return len(self.manifest.shards)

    def journal_record(self) -> dict[str, Any]:
        """What the append's journal records of its base."""
        return {
            "base_version": self.version,
            "base_manifest_sha256": self.manifest.fingerprint,
            "first_shard": self.first_shard,
        }

    def fingerprint(self, own: str) -> str:
        """The append's input fingerprint: its own (input, options) and its base's."""
        return hashlib.sha256(f"{own}\n{self.manifest.fingerprint}".encode()).hexdigest()

    def complete(self, fingerprint: str, options: dict[str, Any]) -> Manifest | None:
        """OUT's newest version if it is this very append, already published; else None."""
        newest = self.newest
        if manifest_version(newest) != self.version + 1:
            return None
        if newest.input_fingerprint == fingerprint and newest.options == options:
            return newest
        return None

    def version_files(self, appended: Manifest) -> dict[str, bytes]:
        """The immutable version manifests the append publishes before ``manifest.json``."""
        files = {version_file(self.version + 1): manifest_bytes(appended)}
        if self.version == 1:  # a plain build's manifest.json, kept as version 1
            files = {version_file(1): self.data, **files}
        return files


def find_base(read: Reader, out: str, config: BuildConfig) -> AppendBase:
    """The version an append into ``out`` builds on (see the module doc).

    Raises:
        InputError: OUT holds no finished build, an interrupted build or append (without
            ``--resume``), an interrupted plain build (with it), or nothing to resume.
        ManifestError: a manifest of OUT is invalid, or not the one its successor records.
    """
    interface = config.interface
    journal = _journal(read, out, config)
    try:
        data = read(MANIFEST_NAME, MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError as err:
        if journal is not None:
            raise InputError(
                f"{out}: holds an interrupted build, not a finished one to append to: finish it "
                f"with {interface.without('append')} and {interface.setting('resume')}",
                out,
            ) from err
        raise InputError(
            f"{out}: holds no finished build to append to (no {MANIFEST_NAME}); build it "
            f"first {interface.without('append')}",
            out,
        ) from err
    where = f"{out.rstrip('/')}/{MANIFEST_NAME}"
    newest = parse_manifest(data, where)
    latest = manifest_version(newest)
    if newest.compression != config.compression:
        raise InputError(
            f"{out}: its shards are compressed {newest.compression!r}, not "
            f"{config.compression!r}: an append keeps the build's compression; pass "
            f"{interface.setting('compression', newest.compression)}",
            out,
        )

    def version(n: int) -> tuple[Manifest, bytes]:
        if n == latest:
            return newest, data
        base = read_version(newest, n, read, out)
        return base, read(version_file(n), MAX_MANIFEST_BYTES + 1)

    if journal is not None:
        if not config.resume:
            raise InputError(
                f"{out}: a build or append into it is in progress, or was interrupted (OUT holds "
                f"its journal, {JOURNAL_NAME}): let it finish, or finish it with its own "
                f"command and {interface.setting('resume')}; then append",
                out,
            )
        record = journal.get("append")
        if not isinstance(record, dict):
            raise InputError(
                f"{out}: the interrupted build was a plain build, not an append: resume it "
                f"without {interface.setting('append')}",
                out,
            )
        number = record.get("base_version")
        if not (type(number) is int and number in (latest, latest - 1)):
            raise InputError(
                f"{out}: the interrupted append built on version {number!r}, but OUT's newest "
                f"version is {latest}; the journal does not belong to this build: start over "
                f"with {interface.setting('overwrite')}",
                out,
            )
        manifest, raw = version(number)
        return AppendBase(manifest, raw, number, newest)
    if config.resume:  # no journal: resuming is a no-op only if the append is published
        if latest < 2:
            raise InputError(
                f"{out}: no interrupted append to resume here; {interface.without('resume')}",
                out,
            )
        manifest, raw = version(latest - 1)
        return AppendBase(manifest, raw, latest - 1, newest)
    return AppendBase(newest, data, latest, newest)


def _journal(read: Reader, out: str, config: BuildConfig) -> dict[str, Any] | None:
    try:
        data = read(JOURNAL_NAME, JOURNAL_LIMIT + 1)
    except FileNotFoundError:
        return None
    try:
        record = json.loads(data) if len(data) <= JOURNAL_LIMIT else None
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise InputError(
            f"{out.rstrip('/')}/{JOURNAL_NAME}: the build journal is unreadable; start over with "
            f"{config.interface.setting('overwrite')}",
            out,
        )
    return record


def class_union(
    old: tuple[str, ...] | None, new: tuple[str, ...] | None, out: str, raw: str
) -> tuple[tuple[str, ...] | None, npt.NDArray[np.int32] | None]:
    """The classes of the build after an append of NEW (``raw``), and the mapping of NEW's
    class indices to them (None: unchanged).

    The build's classes keep their indices; NEW's other classes get the next indices, in
    NEW's order. Integer labels (classes named ``"0" .. "n-1"``: the labels are the indices)
    stay integers: the union is ``"0" .. str(max)``.

    Raises:
        InputError: one is labelled and the other not, or one has integer labels and the
            other class names.
    """
    if old is None or new is None:
        if old is None and new is None:
            return None, None
        has, lacks = (out, raw) if new is None else (raw, out)
        raise InputError(
            f"{raw}: {has} is labelled and {lacks} is not; an append must match the build's "
            "labelling (label every sample, or none)",
            raw,
        )
    if _integers(old) != _integers(new) and old and new:
        numbered, named = (out, raw) if _integers(old) else (raw, out)
        raise InputError(
            f"{raw}: {numbered} has integer labels (class indices) and {named} class names "
            f"(e.g. {(new if numbered == out else old)[0]!r}); an append must label as the build "
            "does",
            raw,
        )
    union = list(old)
    index = {name: i for i, name in enumerate(old)}
    for name in new:
        if name not in index:
            index[name] = len(union)
            union.append(name)
    if _integers(old) and _integers(new):  # "0".."n-1" either way: the longer one
        return tuple(union), None
    mapping = np.array([index[name] for name in new], dtype=np.int32)
    if np.array_equal(mapping, np.arange(len(new))):
        return tuple(union), None
    return tuple(union), mapping


def _integers(names: tuple[str, ...]) -> bool:
    return all(name == str(i) for i, name in enumerate(names))


def shard_keys(base: Manifest, shard: int, read: Reader, out: str) -> list[str]:
    """The keys of shard ``shard`` of ``base``, from its index (checked against the size and
    sha256 the manifest records).

    Raises:
        ManifestError: the index is missing, damaged or not the manifest's (an append onto a
            damaged build is refused: ``shardprep verify OUT`` tells what is wrong).
    """
    entry = base.shards[shard]
    where = f"{out.rstrip('/')}/{entry.index_file}"
    try:
        data = read(entry.index_file, entry.index_bytes + 1)
    except FileNotFoundError as err:
        raise _damaged(where, out, "missing") from err
    if len(data) != entry.index_bytes or hashlib.sha256(data).hexdigest() != entry.index_sha256:
        raise _damaged(where, out, "not the index the manifest records (size or sha256)")
    index = decode_index(data, where)
    blob = bytes(index.key_blob)
    ends = index.key_end.tolist()
    return [blob[a:b].decode() for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def _damaged(where: str, out: str, what: str) -> ManifestError:
    return ManifestError(
        f"{where}: {what}; an append onto a damaged build is refused (run shardprep verify "
        f"{out} to see what is damaged, and rebuild or restore it)",
        where,
    )


def written_keys(inventory: InventoryView, selection: Selection) -> Iterator[tuple[str, int]]:
    """``(key, inventory index)`` of every sample the append writes, copies included."""
    for lo in range(0, len(selection), KEY_CHUNK):
        positions = np.arange(lo, min(len(selection), lo + KEY_CHUNK), dtype=np.int64)
        sources = selection.sources(positions)
        copies = selection.copies(positions).tolist()
        rows = (
            inventory.gather(sources)
            if selection.source is not None
            else inventory.rows(lo, lo + len(positions))
        )
        for i, copy in enumerate(copies):
            key = rows.key(i)
            yield (f"{key}-r{copy}" if copy else key), int(sources[i])


def _source_path(root: str, source: str) -> str:
    """A sample's source as the user knows it: under RAW's root unless absolute or a URL."""
    if not root or "://" in source or os.path.isabs(source):
        return source
    return f"{root.rstrip('/')}/{source}"


def check_new_keys(
    inventory: InventoryView,
    selection: Selection,
    base: Manifest,
    read: Reader,
    out: str,
    *,
    raw: str | None = None,
    advice: str | None = None,
) -> None:
    """Refuse an append whose samples repeat a key of the build it appends to. ``raw``: name
    RAW rather than the sample's source (a Parquet row's source is the build's scratch copy);
    ``advice``: what to do instead of renaming the sample.

    Raises:
        KeyInBuildError: naming the key, NEW's sample and the shard (and version) of OUT.
        ManifestError: a base index is damaged (:func:`shard_keys`).
    """
    new: dict[str, int] = {}  # NEW's keys (their inventory index): O(NEW) in memory
    for key, source in written_keys(inventory, selection):
        new.setdefault(key, source)

    def first_held(shard: int) -> str | None:  # one index in memory per thread at most
        return next((k for k in shard_keys(base, shard, read, out) if k in new), None)

    with ThreadPoolExecutor(INDEX_THREADS, thread_name_prefix="shardprep-keys") as pool:
        for shard, found in enumerate(pool.map(first_held, range(len(base.shards)))):
            if found is None:
                continue
            path = raw or _source_path(inventory.root, inventory.sample(new[found]).source)
            held = (
                f"{out.rstrip('/')}/{base.shards[shard].file} (version "
                f"{version_of_shard(base, shard)} of the build)"
            )
            raise KeyInBuildError(found, path, held, advice)
