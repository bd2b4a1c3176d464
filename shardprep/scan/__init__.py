"""Scan: find every sample of the raw input and record its metadata (never its data).

``scan(raw, fmt)`` detects the layout (or takes ``fmt``), dispatches to one
scanner module per layout, then checks the whole inventory (no samples,
duplicate keys) before anything is written.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

import numpy as np
import numpy.typing as npt

from shardprep.format.errors import DuplicateKeyError, InputError
from shardprep.format.interface import CLI, Interface
from shardprep.format.shardformat import MANIFEST_NAME
from shardprep.inventory import Inventory, InventoryBuilder, InventoryView, SinkFactory
from shardprep.keys import KEY_BYTES_TABLE, split_name
from shardprep.out_spill import OutSpill
from shardprep.scan.class_folders import OrderedMap, scan_class_folders
from shardprep.scan.keyed_files import first_files_have_labels, is_label_file, scan_keyed_files
from shardprep.scan.listing import scan_listing
from shardprep.scan.parquet import PARQUET_SUFFIXES, is_parquet_name, is_sidecar, scan_parquet
from shardprep.scan.parquet_keys import duplicate_advice
from shardprep.scan.prefix import TopLevel, first_folder, top_level
from shardprep.scan.splits import refuse_splits, split_folder
from shardprep.scan.tar_shards import scan_tar_shards
from shardprep.scan.walk import Tick
from shardprep.storage import is_url

__all__ = ["InputFormat", "detect_format", "scan"]


class InputFormat(str, Enum):
    """The raw-input layouts shardprep understands."""

    AUTO = "auto"
    CLASS_FOLDERS = "class-folders"
    KEYED = "keyed"
    LISTING = "listing"
    PARQUET = "parquet"
    TAR = "tar"


def detect_format(
    raw: str, storage_options: Mapping[str, Any] | None = None, interface: Interface = CLI
) -> InputFormat:
    """Decide the layout of ``raw`` from its top level (see docs/cli.md for the rules;
    ``interface``: how refusals name the options, ``--format`` or ``input_format=``).

    ``raw`` is a path or a URL prefix (``s3://bucket/train``): the same rules read the top
    level of either (:func:`~shardprep.scan.prefix.top_level`: a scandir, or one listing).
    A ``.parquet`` file is Parquet input, and so is a folder whose data files are Parquet,
    sidecars aside (:func:`~shardprep.scan.parquet.is_sidecar`: ``_SUCCESS``, ``*.crc``,
    ``README*``, ``dataset_info.json``...): its top-level data files if it has any, else
    those of its first folder with files (Hive partitions ``label=3/``, a ``data/``
    folder; folders starting with ``_`` aside). Parquet files beside other data files in
    that folder are refused as ambiguous (``--format`` decides); the Parquet scan then
    refuses other data files anywhere below (:func:`~shardprep.scan.parquet.list_parquet`).

    Otherwise a folder that holds only folders is class folders unless its first folder
    with files holds ``.cls`` label parts (then it is keyed); a class folder named like a
    partition (``label=3/`` of JPEGs) is a class of that name. The scan then
    refuses what contradicts the choice wherever it is (a ``.cls`` file in a
    class folder, a keyed sample without a label), so the outcome never
    depends on which folder sorts first.

    Raises:
        InputError: ``raw`` is missing, empty, of no known layout, or ambiguous
            (files and folders side by side without ``.cls`` labels, Parquet files beside
            other data files): the message asks for ``--format``; a URL whose storage
            cannot be reached.
    """
    top = top_level(
        raw, storage_options, interface
    )  # raises for a missing RAW, an unreachable store
    if top.is_file:
        lower = raw.lower()
        if lower.endswith((".csv", ".tsv", ".jsonl", ".ndjson")):
            return InputFormat.LISTING
        if lower.endswith(".tar"):
            return InputFormat.TAR
        if lower.endswith(PARQUET_SUFFIXES):
            return InputFormat.PARQUET
        raise InputError(
            f"{raw}: a file input must be a .csv/.tsv/.jsonl listing, a .tar shard or a "
            "Parquet file (.parquet, .pq, .parq)",
            raw,
        )
    files, folders = top.file_names, top.folders
    if not files and not folders:
        what = "prefix holds no objects" if is_url(raw) else "folder is empty"
        raise InputError(f"{raw}: the {what}; point RAW at the dataset", raw)
    # A shardprep output also holds .idx sidecars and manifest.json next to its .tar shards.
    shards = [n for n in files if not (n.endswith(".idx") or n == MANIFEST_NAME)]
    if shards and all(n.endswith(".tar") for n in shards):
        return InputFormat.TAR
    data = [n for n in files if not is_sidecar(n)]  # README, _SUCCESS, *.crc ... aside
    if _parquet_data(raw, raw, data, interface):
        return InputFormat.PARQUET
    first: list[str] | None = None
    if not data and folders:  # the data lie in folders: Parquet if the first one's are
        tables = [f for f in folders if not f.startswith("_")]  # Spark's _temporary aside
        found = first_folder(raw, storage_options, TopLevel(False, [], tables), interface)
        if found is not None:
            where, first = found
            if _parquet_data(raw, where, first, interface):
                return InputFormat.PARQUET
    if files and (not folders or any(is_label_file(n) for n in files)):
        return _one_split(raw, folders, InputFormat.KEYED, interface)
    if files:
        fmt = interface.setting
        raise InputError(
            f"{raw}: ambiguous layout: the top level holds files (e.g. {files[0]!r}) and "
            f"folders (e.g. {folders[0]!r}) but no .cls labels; pass "
            f"{fmt('input_format', 'keyed')} to read every file as keyed samples, or move the "
            f"files out to read the folders as classes ({fmt('input_format', 'class-folders')})",
            raw,
        )
    if first is None or any(f.startswith("_") for f in folders):
        labelled = first_files_have_labels(raw, storage_options, top, interface)
    else:  # (the same first folder: listed once)
        labelled = any(is_label_file(n) for n in first)
    layout = InputFormat.KEYED if labelled else InputFormat.CLASS_FOLDERS
    return _one_split(raw, folders, layout, interface)


def _one_split(
    raw: str, folders: list[str], layout: InputFormat, interface: Interface
) -> InputFormat:
    """``layout``, unless the top-level ``folders`` are two or more splits (``train/`` and
    ``test/``: refused, :func:`~shardprep.scan.splits.refuse_splits`)."""
    named = ((split_folder(f), f"{f}/") for f in folders)
    refuse_splits(raw, named, layout.value, interface)
    return layout


def _parquet_data(raw: str, where: str, names: list[str], interface: Interface = CLI) -> bool:
    """True if the data files ``names`` (sidecars aside) of the folder ``where`` are
    Parquet, False if none is.

    Raises:
        InputError: some are Parquet and some are not: ambiguous, ``--format`` decides.
    """
    data = [n for n in names if not is_sidecar(n)]
    parquet = [n for n in data if is_parquet_name(n)]
    if not parquet:
        return False
    other = next((n for n in data if not is_parquet_name(n)), None)
    if other is not None:
        fmt = interface.setting
        raise InputError(
            f"{raw}: ambiguous layout: {'the top level' if where == raw else where} holds "
            f".parquet files (e.g. {parquet[0]!r}) and other files (e.g. {other!r}); pass "
            f"{fmt('input_format', 'parquet')} to read the .parquet files alone (one sample "
            f"per row; the others are skipped), or {fmt('input_format', 'keyed')} to read "
            "every file as a sample",
            raw,
        )
    return True


def scan(
    raw: str,
    fmt: InputFormat = InputFormat.AUTO,
    tick: Tick | None = None,
    path_column: str = "path",
    label_column: str | None = None,
    workers: int = 1,
    detected: bool = False,
    ordered_map: OrderedMap | None = None,
    storage_options: Mapping[str, Any] | None = None,
    sink: SinkFactory = InventoryBuilder,
    part_sink: SinkFactory = InventoryBuilder,
    key_column: str | None = None,
    scratch: str | None = None,
    interface: Interface = CLI,
    spill_to: OutSpill | None = None,
) -> InventoryView:
    """Scan ``raw`` into an Inventory, sorted and validated; ``tick(n)`` reports progress.

    ``sink`` makes what the samples are collected in: in memory by default,
    or a :class:`~shardprep.spill.InventoryStore` on disk (the build's), which
    is then returned; ``part_sink`` what each parallel class-folder task
    collects its folder in before the merge.

    ``workers`` > 1 scans class folders in parallel processes (same result);
    ``ordered_map`` (an engine's) runs those per-folder tasks, one task per
    input tar and one per chunk of listing rows, instead. ``raw`` may be a URL prefix
    (``s3://bucket/train``) of class folders, keyed files, tar shards or Parquet files,
    listed as a folder is walked (:mod:`shardprep.scan.prefix`); ``storage_options``
    are fsspec's, for such a URL or a listing that names URLs. Parquet input copies
    its payloads into a new sub-folder of ``scratch`` (the build's scratch folder; a
    temporary folder the caller removes when None: the inventory's root; ``spill_to``: into
    OUT's storage instead, for a build on a Ray cluster, :mod:`shardprep.out_spill`), and
    takes its key from ``key_column`` (:mod:`shardprep.scan.parquet`).
    ``fmt=AUTO`` detects the layout; ``detected=True`` says the caller already
    did (``detect_format``). A detected layout is read strictly: what the
    detection cannot tell apart is refused with a message asking for
    ``--format`` (keyed files merging two parts of the same type, class
    folders whose files collide on a key, a ``.parquet`` file among keyed files or class
    folders) instead of guessed. ``interface`` is how messages name the build's options
    (``--format`` for the CLI, ``input_format=`` for ``shardprep.build``; it travels with
    the class-folder tasks).

    Raises:
        InputError: the input is unusable or ambiguous; the message lists the offending paths.
        DuplicateKeyError: two sources map to the same sample key.
    """
    fmt = InputFormat(fmt)
    if fmt is InputFormat.AUTO:
        fmt, detected = detect_format(raw, storage_options, interface), True
    elif is_url(raw) and fmt is InputFormat.LISTING:
        raise InputError(
            f"{raw}: a listing is read from a local file (its rows may name URLs); copy it "
            "here and point RAW at the copy",
            raw,
        )
    elif not is_url(raw) and not os.path.exists(raw):
        raise InputError(f"{raw}: no such file or folder", raw)
    elif fmt is InputFormat.KEYED:  # (class folders and tars list the top level anyway)
        top_level(
            raw, storage_options, interface
        )  # a URL prefix with no objects: refused as missing
    count: Callable[[int], None] = tick or (lambda _n: None)
    root = raw.rstrip("/") if is_url(raw) else os.path.abspath(raw)  # a folder or URL prefix
    options = storage_options
    if fmt is InputFormat.LISTING:
        inventory = scan_listing(
            raw, count, path_column, label_column, ordered_map, options, sink, interface
        )
    elif fmt is InputFormat.CLASS_FOLDERS:
        inventory = scan_class_folders(
            root, count, workers, ordered_map, sink, part_sink, options, detected, interface
        )
    elif fmt is InputFormat.PARQUET:
        inventory = scan_parquet(
            raw,
            count,
            scratch,
            label_column,
            key_column,
            options,
            sink,
            detected,
            interface,
            spill_to,
        )
    elif fmt is InputFormat.KEYED:
        inventory = scan_keyed_files(root, count, not detected, sink, options, interface)
    else:
        inventory = scan_tar_shards(root, count, ordered_map, sink, options, interface)
    if not len(inventory):
        raise InputError(f"{raw}: no samples found", raw)
    try:
        check_unique_keys(inventory)
    except DuplicateKeyError as err:
        if fmt is InputFormat.PARQUET:
            raise DuplicateKeyError(err.key, err.paths, duplicate_advice(interface)) from err
        first, second = err.paths[:2]
        if not (detected and fmt is InputFormat.CLASS_FOLDERS and _one_keyed_sample(first, second)):
            raise
        raise InputError(
            f"{first!r} and {second!r} become one sample key {err.key!r}: {raw} was read as "
            "class folders (its top level holds only folders and no .cls labels), one file "
            "per sample. If files sharing a name are parts of one sample, this is keyed data: "
            f"pass {interface.setting('input_format', 'keyed')}; if they are separate "
            "samples, rename one of them",
            first,
        ) from err
    return inventory


def _one_keyed_sample(first: str, second: str) -> bool:
    """True if WebDataset would group these two files into one sample (same folder and stem)."""
    (dir_a, name_a), (dir_b, name_b) = os.path.split(first), os.path.split(second)
    return dir_a == dir_b and split_name(name_a)[0] == split_name(name_b)[0]


KEYS_PER_BUCKET = 1 << 16  # hashes sorted at once by the duplicate-key check (1 MiB)


def check_unique_keys(inventory: InventoryView, per_bucket: int = KEYS_PER_BUCKET) -> None:
    """Raise DuplicateKeyError if two samples map to one key.

    Compares 64-bit hashes of the keys (not a set of strings), then confirms a
    clash on the keys themselves. Memory stays bounded: up to ``per_bucket``
    samples the hashes are sorted in memory; beyond, (hash, index) pairs are
    spilled to one file per hash bucket and each bucket is checked on its own
    (two equal keys always share a bucket).
    """
    n = len(inventory)
    buckets = -(-n // per_bucket)
    if buckets <= 1:
        hashes = [_key_hashes(rows) for _, rows in inventory.chunks(1 << 16)]
        _check_hashes(inventory, np.concatenate(hashes or [np.zeros(0, np.int64)]), None)
        return
    pair = np.dtype([("hash", np.int64), ("index", np.int64)])
    with tempfile.TemporaryDirectory(prefix="shardprep-keys-") as folder:
        paths = [os.path.join(folder, str(b)) for b in range(buckets)]
        for lo, rows in inventory.chunks(1 << 16):
            pairs = np.empty(len(rows), pair)
            pairs["hash"] = _key_hashes(rows)
            pairs["index"] = np.arange(lo, lo + len(rows))
            bucket = pairs["hash"].view(np.uint64) % np.uint64(buckets)
            order = np.argsort(bucket, kind="stable")
            bounds = np.searchsorted(bucket[order], np.arange(buckets + 1))
            for b in np.flatnonzero(np.diff(bounds)).tolist():
                with open(paths[b], "ab") as f:
                    f.write(pairs[order[bounds[b] : bounds[b + 1]]].tobytes())
        for path in paths:
            if os.path.exists(path):
                pairs = np.fromfile(path, pair)
                _check_hashes(inventory, pairs["hash"], pairs["index"])


def _check_hashes(
    inventory: InventoryView,
    hashes: npt.NDArray[np.int64],
    indices: npt.NDArray[np.int64] | None,
) -> None:
    """Raise DuplicateKeyError for the first pair of equal hashes whose keys are equal."""
    order = np.argsort(hashes, kind="stable")
    same = np.flatnonzero(hashes[order][1:] == hashes[order][:-1])
    where = order if indices is None else indices[order]
    for pos in same:
        a, b = sorted((int(where[pos]), int(where[pos + 1])))
        if inventory.key(a) == inventory.key(b):
            raise DuplicateKeyError(
                inventory.key(a), [inventory.sample(a).source, inventory.sample(b).source]
            )


def _key_hashes(inventory: Inventory, chunk: int = 1 << 16) -> npt.NDArray[np.int64]:
    """hash() of every sample's key as UTF-8 bytes, computed ``chunk`` samples at a time.

    For ASCII names the keys are computed with byte operations on the whole
    name blob (what ``key_from_stem`` does, without a str per sample).
    Transient Python objects stay bounded by ``chunk``.
    """
    n = len(inventory)
    hashes = np.empty(n, dtype=np.int64)
    ascii_names = inventory.stem_blob.isascii()
    blob = inventory.stem_blob.translate(KEY_BYTES_TABLE) if ascii_names else b""
    for low in range(0, n, chunk):
        high = min(n, low + chunk)
        if not ascii_names:
            hashes[low:high] = [hash(inventory.key(i).encode()) for i in range(low, high)]
            continue
        start = int(inventory.stem_end[low - 1]) if low else 0
        values = []
        for end in inventory.stem_end[low:high].tolist():
            key = blob[start:end].replace(b"/", b"__")
            values.append(hash(key if key[:1] not in (b"_", b"") else b"k" + key))
            start = end
        hashes[low:high] = values
    return hashes
