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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardprep.format.errors import InputError
from shardprep.format.interface import CLI, Interface
from shardprep.inventory import UNLABELLED, InventoryBuilder, InventoryView, SinkFactory
from shardprep.remote_input import remote_sizes
from shardprep.scan.class_folders import OrderedMap
from shardprep.scan.labels import LabelTable
from shardprep.scan.walk import Problems, Tick
from shardprep.storage import is_url

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
    storage_options: Mapping[str, Any] | None = None,
    sink: SinkFactory = InventoryBuilder,
    interface: Interface = CLI,
) -> InventoryView:
    """Inventory of the files a listing names (``interface``: how refusals name the options,
    ``--path-column`` or ``path_column=``).

    ``label_column=None`` uses a ``label`` column when the listing has one.
    The rows are read here and checked and stat-ed in chunks of
    ``CHUNK_ROWS``, one task each, run by ``ordered_map`` (an engine's, see
    :mod:`shardprep.engine`) when given; chunks are merged in row order with
    their labels interned in that order, so the result is the same as a
    serial scan. Paths are either all relative to the listing's folder, or
    all URLs of one protocol (``s3://bucket/img/0001.jpg``, as the first row's
    path decides), whose sizes are asked for here, concurrently, with
    ``storage_options`` (:func:`~shardprep.remote_input.remote_sizes`). A URL
    sample's stem, and so its key, is its URL without the ``protocol://``.

    Raises:
        InputError: missing column, a path outside the listing's folder, a
            missing file or object, labels on some rows only, URLs and relative paths mixed.
    """
    root = os.path.dirname(os.path.abspath(listing))
    labels, problems = LabelTable(), Problems()
    labelled_line, unlabelled = 0, 0
    unlabelled_lines: list[int] = []
    chunks = _chunks(listing, path_column, label_column, interface)
    header = next(chunks, None)
    if header is None:
        raise InputError(f"{listing}: the listing has no rows", listing)
    path_col, label_col, scheme = header
    builder = sink(scheme or root, True)
    urls: list[str] = []  # URL listings: sizes are asked for after the rows are read
    url_lines: list[int] = []
    jobs = (_ChunkJob(listing, root, path_col, label_col, rows, scheme) for rows in chunks)
    run = ordered_map if ordered_map is not None else map
    for part in run(_scan_chunk, jobs):  # merged one at a time, in row order
        mapping = labels.merge(part.labels)
        part.builder.relabel(mapping)
        builder.extend(part.builder)
        problems.items += part.problems.items
        labelled_line = labelled_line or part.labelled_line
        unlabelled += part.unlabelled
        unlabelled_lines += part.unlabelled_lines[: 10 - len(unlabelled_lines)]
        urls += part.urls
        url_lines += part.url_lines
        if not scheme:
            tick(len(part.builder))
    if urls:  # the sizes of the listed objects, asked for concurrently
        sizes = remote_sizes(urls, storage_options)
        for number, found in zip(url_lines, sizes, strict=True):
            if isinstance(found, OSError):
                problems.add(f"{listing}:{number}", f"cannot stat {found.strerror or found}")
        if not problems.items:
            builder.set_part_sizes([int(s) for s in sizes if not isinstance(s, OSError)])
            tick(len(urls))
    if len(labels) and unlabelled:
        for number in unlabelled_lines:
            problems.add(
                f"{listing}:{number}",
                f"no label, while line {labelled_line} has one ({unlabelled} row(s) without); "
                "label every row or none",
            )
    problems.raise_if_any()
    return labels.freeze(builder)


def _chunks(
    listing: str, path_column: str, label_column: str | None, interface: Interface = CLI
) -> Iterator[Any]:
    """First (path column, label column or "", "protocol://" or ""), then lists of CHUNK_ROWS rows.

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
            f"name the path column with {interface.option('path_column')}",
            listing,
        )
    if label_column is None:
        label_column = "label" if "label" in row else ""
    elif label_column not in row:
        raise InputError(f"{listing}:{number}: no label column {label_column!r}", listing)
    first_path = str(row.get(path_column) or "")
    scheme = first_path.partition("://")[0] + "://" if is_url(first_path) else ""
    yield path_column, label_column, scheme
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
    scheme: str = ""  # "protocol://" when the listing names URLs


@dataclass
class _ChunkPart:
    """One chunk's samples, labels as ids into its own ``labels`` table."""

    builder: InventoryBuilder
    labels: LabelTable
    problems: Problems
    labelled_line: int  # first line with a label, 0 if none
    unlabelled: int
    unlabelled_lines: list[int]  # the first 10
    urls: list[str] = field(default_factory=list)  # URL listings: each sample's URL, in order
    url_lines: list[int] = field(default_factory=list)  # ... and its line


def _scan_chunk(job: _ChunkJob) -> _ChunkPart:
    """Check and stat one chunk of rows (runs wherever the engine runs tasks)."""
    listing, root, path_column, label_column = (
        job.listing,
        job.root,
        job.path_column,
        job.label_column,
    )
    scheme = job.scheme
    builder = InventoryBuilder(scheme or root, with_meta=True)
    labels, problems, confined = LabelTable(), Problems(), _Confinement(root)
    labelled_line, unlabelled = 0, 0
    unlabelled_lines: list[int] = []
    urls: list[str] = []
    url_lines: list[int] = []
    for number, row in job.rows:
        where = f"{listing}:{number}"
        rel = str(row.get(path_column) or "")
        located = _url_row(rel, scheme) if scheme else _local_row(rel, root, confined)
        if isinstance(located, str):
            problems.add(where, located)
            continue
        path, stem, ext, size = located
        label_value = row.get(label_column) if label_column else None
        label = UNLABELLED
        if isinstance(label_value, bool) or not isinstance(label_value, (str, int, type(None))):
            problems.add(where, f"label {label_value!r} is not a string or an integer")
            continue
        if label_value is not None and str(label_value).strip():
            label = labels.intern(label_value, f"{where}: {label_column!r}", listing)
            labelled_line = labelled_line or number
        else:
            unlabelled += 1
            if len(unlabelled_lines) < 10:
                unlabelled_lines.append(number)
        meta = {k: v for k, v in row.items() if k not in (path_column, label_column)}
        builder.add(stem, label, [(ext, size, -1)], meta=json.dumps(meta).encode() if meta else b"")
        if scheme:
            urls.append(path)
            url_lines.append(number)
    return _ChunkPart(
        builder,
        labels,
        problems,
        labelled_line,
        unlabelled,
        unlabelled_lines,
        urls,
        url_lines,
    )


def _local_row(rel: str, root: str, confined: _Confinement) -> tuple[str, str, str, int] | str:
    """(path, stem, extension, size) of a path relative to the listing, or the problem with it."""
    if is_url(rel):
        return (
            f"path {rel!r} is a URL while the first row's path is not; a listing names "
            "either paths relative to its folder or URLs of one protocol"
        )
    norm = os.path.normpath(rel) if rel else ""
    if not rel or os.path.isabs(rel) or norm == ".." or norm.startswith(".." + os.sep):
        return f"path {rel!r} is empty or outside the listing's folder {root}"
    stem, dot, ext = norm.replace(os.sep, "/").rpartition(".")
    if not dot or "/" in ext:
        return f"{rel!r} has no extension; it names the sample's part"
    full = os.path.join(root, norm)
    try:
        return full, stem, ext, confined.size(full)
    except _Outside as err:
        return (
            f"{rel!r} resolves to {err}, outside the listing's folder {root} "
            "(symlinks are resolved); copy the file in or move the listing up"
        )
    except OSError as err:
        return f"cannot stat {full} ({err.strerror or err})"


def _url_row(url: str, scheme: str) -> tuple[str, str, str, int] | str:
    """(url, stem, extension, size 0 until asked) of a listed URL, or the problem with it."""
    if not url.startswith(scheme):
        return (
            f"path {url!r} is not a {scheme} URL like the first row's; a listing names "
            "either URLs of one protocol or paths relative to its folder"
        )
    stem, dot, ext = url[len(scheme) :].rpartition(".")
    if not dot or "/" in ext or not stem:
        return f"{url!r} has no extension; it names the sample's part"
    return url, stem, ext, 0


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
