"""Scanner for a CSV or JSONL listing: one row per sample, a path column and an optional label.

Paths are relative to the listing's folder and must stay inside it. Columns
other than path and label become the sample's ``.json`` member. Each listed
file is stat'ed, not read.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from typing import Any

from shardprep.errors import InputError
from shardprep.inventory import UNLABELLED, Inventory, InventoryBuilder
from shardprep.scan.labels import LabelTable
from shardprep.scan.walk import Problems, Tick

__all__ = ["scan_listing"]

META_EXT = "json"


def _rows(listing: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) pairs of a .csv/.tsv or .jsonl listing."""
    lower = listing.lower()
    with open(listing, newline="", encoding="utf-8") as f:
        if lower.endswith((".csv", ".tsv")):
            reader = csv.DictReader(f, delimiter="\t" if lower.endswith(".tsv") else ",")
            for row in reader:
                yield reader.line_num, row
            return
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{listing}:{number}: invalid JSON ({err.msg})", listing) from err
            if not isinstance(row, dict):
                raise InputError(f"{listing}:{number}: each line must be a JSON object", listing)
            yield number, row


def scan_listing(
    listing: str, tick: Tick, path_column: str = "path", label_column: str | None = None
) -> Inventory:
    """Inventory of the files a listing names.

    ``label_column=None`` uses a ``label`` column when the listing has one.

    Raises:
        InputError: missing column, a path outside the listing's folder, a
            missing file, or labels on some rows only.
    """
    root = os.path.dirname(os.path.abspath(listing))
    builder = InventoryBuilder(root, with_meta=True)
    labels, problems = LabelTable(), Problems()
    first, unlabelled = True, 0
    for number, row in _rows(listing):
        where = f"{listing}:{number}"
        if first:
            if path_column not in row:
                raise InputError(
                    f"{where}: no {path_column!r} column (columns: {', '.join(map(str, row))}); "
                    "name the path column with --path-column",
                    listing,
                )
            if label_column is None:
                label_column = "label" if "label" in row else ""
            elif label_column not in row:
                raise InputError(f"{where}: no label column {label_column!r}", listing)
            first = False
        rel = str(row.get(path_column) or "")
        norm = os.path.normpath(rel) if rel else ""
        if not rel or os.path.isabs(rel) or norm.startswith(".."):
            problems.add(where, f"path {rel!r} is empty or outside the listing's folder {root}")
            continue
        full = os.path.join(root, norm)
        try:
            size = os.stat(full).st_size
        except OSError as err:
            problems.add(where, f"cannot stat {full} ({err.strerror})")
            continue
        stem, dot, ext = norm.replace(os.sep, "/").rpartition(".")
        if not dot or "/" in ext:
            problems.add(where, f"{rel!r} has no extension; it names the sample's part")
            continue
        label_text = row.get(label_column) if label_column else None
        label = UNLABELLED
        if label_text is not None and str(label_text).strip():
            label = labels.intern(str(label_text))
        else:
            unlabelled += 1
        meta = {k: v for k, v in row.items() if k not in (path_column, label_column)}
        builder.add(stem, label, [(ext, size, -1)], meta=json.dumps(meta).encode() if meta else b"")
        tick(1)
    if first:
        raise InputError(f"{listing}: the listing has no rows", listing)
    if len(labels) and unlabelled:
        problems.add(
            listing, f"{unlabelled} row(s) have no label while others do; label all or none"
        )
    problems.raise_if_any()
    return labels.freeze(builder)
