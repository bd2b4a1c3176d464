"""Scanner for a CSV or JSONL listing: one row per sample, a path column and an optional label.

Paths are relative to the listing's folder and must stay inside it. Columns
other than path and label become the sample's ``.json`` member. Each listed
file is stat'ed, not read.
"""

from __future__ import annotations

import csv
import errno
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardprep.errors import InputError
from shardprep.inventory import UNLABELLED, Inventory, InventoryBuilder
from shardprep.scan.class_folders import OrderedMap
from shardprep.scan.labels import LabelTable
from shardprep.scan.walk import Problems, Tick

__all__ = ["scan_listing"]

META_EXT = "json"
_EXTRA = "\0extra"  # csv.DictReader's key for fields beyond the header (never a column name)


def _rows(listing: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) pairs of a .csv/.tsv or .jsonl listing.

    A UTF-8 byte-order mark (what Excel writes) is skipped.

    Raises:
        InputError: a CSV row with more or fewer fields than the header, or a
            JSONL line that is not a JSON object; the message names the line.
    """
    lower = listing.lower()
    with open(listing, newline="", encoding="utf-8-sig") as f:
        if lower.endswith((".csv", ".tsv")):
            reader = csv.DictReader(
                f, delimiter="\t" if lower.endswith(".tsv") else ",", restkey=_EXTRA
            )
            header = len(reader.fieldnames or ())
            for row in reader:
                extra = row.pop(_EXTRA, [])
                missing = list(row.values()).count(None)
                if extra or missing:
                    raise InputError(
                        f"{listing}:{reader.line_num}: {header + len(extra) - missing} fields, "
                        f"the header has {header}; quote fields that hold the delimiter",
                        listing,
                    )
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


CHUNK_ROWS = 20_000  # rows per scan task


def scan_listing(
    listing: str,
    tick: Tick,
    path_column: str = "path",
    label_column: str | None = None,
    ordered_map: OrderedMap | None = None,
) -> Inventory:
    """Inventory of the files a listing names.

    ``label_column=None`` uses a ``label`` column when the listing has one.
    The rows are read here and checked and stat-ed in chunks of
    ``CHUNK_ROWS``, one task each, run by ``ordered_map`` (an engine's, see
    :mod:`shardprep.engine`) when given; chunks are merged in row order with
    their labels interned in that order, so the result is the same as a
    serial scan.

    Raises:
        InputError: missing column, a path outside the listing's folder, a
            missing file, or labels on some rows only.
    """
    root = os.path.dirname(os.path.abspath(listing))
    builder = InventoryBuilder(root, with_meta=True)
    labels, problems = LabelTable(), Problems()
    labelled_line, unlabelled = 0, 0
    unlabelled_lines: list[int] = []
    chunks = _chunks(listing, path_column, label_column)
    header = next(chunks, None)
    if header is None:
        raise InputError(f"{listing}: the listing has no rows", listing)
    columns = header
    jobs = (_ChunkJob(listing, root, columns[0], columns[1], rows) for rows in chunks)
    run = ordered_map if ordered_map is not None else map
    for part in run(_scan_chunk, jobs):  # merged one at a time, in row order
        mapping = np.array([labels.intern(text) for text in part.labels], dtype=np.int32)
        part.builder.relabel(mapping)
        builder.extend(part.builder)
        problems.items += part.problems.items
        labelled_line = labelled_line or part.labelled_line
        unlabelled += part.unlabelled
        unlabelled_lines += part.unlabelled_lines[: 10 - len(unlabelled_lines)]
        tick(len(part.builder))
    if len(labels) and unlabelled:
        for number in unlabelled_lines:
            problems.add(
                f"{listing}:{number}",
                f"no label, while line {labelled_line} has one ({unlabelled} row(s) without); "
                "label every row or none",
            )
    problems.raise_if_any()
    return labels.freeze(builder)


def _chunks(listing: str, path_column: str, label_column: str | None) -> Iterator[Any]:
    """First the (path column, label column or "") pair, then lists of CHUNK_ROWS rows.

    Raises:
        InputError: the first row lacks the path column, or a given label column.
    """
    rows = _rows(listing)
    first = next(rows, None)
    if first is None:
        return
    number, row = first
    if path_column not in row:
        raise InputError(
            f"{listing}:{number}: no {path_column!r} column (columns: {', '.join(map(str, row))}); "
            "name the path column with --path-column",
            listing,
        )
    if label_column is None:
        label_column = "label" if "label" in row else ""
    elif label_column not in row:
        raise InputError(f"{listing}:{number}: no label column {label_column!r}", listing)
    yield path_column, label_column
    chunk = [first]
    for item in rows:
        chunk.append(item)
        if len(chunk) >= CHUNK_ROWS:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


@dataclass(frozen=True)
class _ChunkJob:
    listing: str
    root: str
    path_column: str
    label_column: str  # "" when the listing has no labels
    rows: list[tuple[int, dict[str, Any]]]


@dataclass
class _ChunkPart:
    """One chunk's samples, labels as ids into its own ``labels`` texts."""

    builder: InventoryBuilder
    labels: list[str]
    problems: Problems
    labelled_line: int  # first line with a label, 0 if none
    unlabelled: int
    unlabelled_lines: list[int]  # the first 10


def _scan_chunk(job: _ChunkJob) -> _ChunkPart:
    """Check and stat one chunk of rows (runs wherever the engine runs tasks)."""
    listing, root, path_column, label_column = (
        job.listing,
        job.root,
        job.path_column,
        job.label_column,
    )
    builder = InventoryBuilder(root, with_meta=True)
    labels, problems, confined = LabelTable(), Problems(), _Confinement(root)
    labelled_line, unlabelled = 0, 0
    unlabelled_lines: list[int] = []
    for number, row in job.rows:
        where = f"{listing}:{number}"
        rel = str(row.get(path_column) or "")
        norm = os.path.normpath(rel) if rel else ""
        if not rel or os.path.isabs(rel) or norm == ".." or norm.startswith(".." + os.sep):
            problems.add(where, f"path {rel!r} is empty or outside the listing's folder {root}")
            continue
        stem, dot, ext = norm.replace(os.sep, "/").rpartition(".")
        if not dot or "/" in ext:
            problems.add(where, f"{rel!r} has no extension; it names the sample's part")
            continue
        full = os.path.join(root, norm)
        try:
            size = confined.size(full)
        except _Outside as err:
            problems.add(
                where,
                f"{rel!r} resolves to {err}, outside the listing's folder {root} "
                "(symlinks are resolved); copy the file in or move the listing up",
            )
            continue
        except OSError as err:
            problems.add(where, f"cannot stat {full} ({err.strerror or err})")
            continue
        label_value = row.get(label_column) if label_column else None
        label = UNLABELLED
        if isinstance(label_value, bool) or not isinstance(label_value, (str, int, type(None))):
            problems.add(where, f"label {label_value!r} is not a string or an integer")
            continue
        if label_value is not None and str(label_value).strip():
            label = labels.intern(str(label_value))
            labelled_line = labelled_line or number
        else:
            unlabelled += 1
            if len(unlabelled_lines) < 10:
                unlabelled_lines.append(number)
        meta = {k: v for k, v in row.items() if k not in (path_column, label_column)}
        builder.add(stem, label, [(ext, size, -1)], meta=json.dumps(meta).encode() if meta else b"")
    return _ChunkPart(
        builder, labels.texts(), problems, labelled_line, unlabelled, unlabelled_lines
    )


class _Outside(Exception):
    """A listed path resolves outside the listing's folder; the message is the real path."""


class _Confinement:
    """Sizes of listed files, refusing any that resolves (symlinks followed) outside ``root``.

    Real paths of folders are cached, so a row costs one ``lstat`` unless the
    file itself is a symlink.
    """

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self._real_dirs: dict[str, str] = {}

    def _inside(self, real: str) -> bool:
        return real == self.root or real.startswith(self.root.rstrip(os.sep) + os.sep)

    def size(self, path: str) -> int:
        """Size of the regular file at ``path``.

        Raises:
            _Outside: it resolves outside the root.
            OSError: it is missing, unreadable or not a regular file.
        """
        folder, name = os.path.split(path)
        real_dir = self._real_dirs.get(folder)
        if real_dir is None:
            real_dir = self._real_dirs[folder] = os.path.realpath(folder)
        info = os.lstat(os.path.join(real_dir, name))
        real = os.path.join(real_dir, name)
        if stat.S_ISLNK(info.st_mode):
            real = os.path.realpath(real)
            if self._inside(real):
                info = os.stat(real)
        if not self._inside(real):
            raise _Outside(real)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return info.st_size
