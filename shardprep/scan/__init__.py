"""Scan: find every sample of the raw input and record its metadata (never its data).

``scan(raw, fmt)`` detects the layout (or takes ``fmt``), dispatches to one
scanner module per layout, then checks the whole inventory (no samples,
duplicate keys) before anything is written.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from enum import Enum

import numpy as np
import numpy.typing as npt

from shardprep.errors import DuplicateKeyError, InputError
from shardprep.inventory import Inventory
from shardprep.keys import KEY_BYTES_TABLE
from shardprep.scan.class_folders import scan_class_folders
from shardprep.scan.keyed_files import looks_keyed, scan_keyed_files
from shardprep.scan.listing import scan_listing
from shardprep.scan.tar_shards import scan_tar_shards
from shardprep.scan.walk import Tick
from shardprep.shardformat import MANIFEST_NAME

__all__ = ["InputFormat", "detect_format", "scan"]


class InputFormat(str, Enum):
    """The raw-input layouts shardprep understands."""

    AUTO = "auto"
    CLASS_FOLDERS = "class-folders"
    KEYED = "keyed"
    LISTING = "listing"
    TAR = "tar"


def detect_format(raw: str) -> InputFormat:
    """Guess the layout of ``raw`` (see docs/cli.md for the rules).

    Raises:
        InputError: ``raw`` is missing, empty or of no known layout.
    """
    if not os.path.exists(raw):
        raise InputError(f"{raw}: no such file or folder", raw)
    if os.path.isfile(raw):
        lower = raw.lower()
        if lower.endswith((".csv", ".tsv", ".jsonl", ".ndjson")):
            return InputFormat.LISTING
        if lower.endswith(".tar"):
            return InputFormat.TAR
        raise InputError(
            f"{raw}: a file input must be a .csv/.tsv/.jsonl listing or a .tar shard", raw
        )
    entries = [e for e in os.scandir(raw) if not e.name.startswith(".")]
    if not entries:
        raise InputError(f"{raw}: the folder is empty; point RAW at the dataset", raw)
    files = [e for e in entries if not e.is_dir()]
    # A shardprep output also holds .idx sidecars and manifest.json next to its .tar shards.
    shards = [e for e in files if not (e.name.endswith(".idx") or e.name == MANIFEST_NAME)]
    if shards and all(e.name.endswith(".tar") for e in shards):
        return InputFormat.TAR
    if files:
        return InputFormat.KEYED
    return InputFormat.KEYED if looks_keyed(raw) else InputFormat.CLASS_FOLDERS


def scan(
    raw: str,
    fmt: InputFormat = InputFormat.AUTO,
    tick: Tick | None = None,
    path_column: str = "path",
    label_column: str | None = None,
    workers: int = 1,
) -> Inventory:
    """Scan ``raw`` into an Inventory, sorted and validated; ``tick(n)`` reports progress.

    ``workers`` > 1 scans class folders in parallel processes (same result).

    Raises:
        InputError: the input is unusable; the message lists the offending paths.
        DuplicateKeyError: two sources map to the same sample key.
    """
    fmt = InputFormat(fmt)
    if fmt is InputFormat.AUTO:
        fmt = detect_format(raw)
    elif not os.path.exists(raw):
        raise InputError(f"{raw}: no such file or folder", raw)
    count: Callable[[int], None] = tick or (lambda _n: None)
    if fmt is InputFormat.LISTING:
        inventory = scan_listing(raw, count, path_column, label_column)
    elif fmt is InputFormat.CLASS_FOLDERS:
        inventory = scan_class_folders(os.path.abspath(raw), count, workers)
    else:
        scanner = {
            InputFormat.KEYED: scan_keyed_files,
            InputFormat.TAR: scan_tar_shards,
        }[fmt]
        inventory = scanner(os.path.abspath(raw), count)
    if not len(inventory):
        raise InputError(f"{raw}: no samples found", raw)
    check_unique_keys(inventory)
    return inventory


def check_unique_keys(inventory: Inventory) -> None:
    """Raise DuplicateKeyError if two samples map to one key.

    Compares 64-bit hashes of the keys (8 bytes per sample, not a set of
    strings), then confirms a clash on the keys themselves.
    """
    hashes = _key_hashes(inventory)
    order = np.argsort(hashes, kind="stable")
    same = np.flatnonzero(hashes[order][1:] == hashes[order][:-1])
    for pos in same:
        a, b = int(order[pos]), int(order[pos + 1])
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
