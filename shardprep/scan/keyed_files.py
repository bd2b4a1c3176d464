"""Scanner for files grouped by key: ``0001.jpg`` + ``0001.json`` (+ ``0001.cls``) is one sample.

Files with the same name up to the first dot in the same folder form a sample,
at any folder depth, as in WebDataset. A ``.cls`` part holds the label (read
here, the only data the scan reads); without ``.cls`` parts the data is
unlabelled. Metadata otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import groupby
from typing import Any

from shardprep.format.errors import InputError
from shardprep.format.interface import CLI, Interface
from shardprep.inventory import UNLABELLED, InventoryBuilder, InventoryView, SinkFactory
from shardprep.keys import split_name
from shardprep.remote_input import read_heads
from shardprep.scan.labels import LabelTable, cls_file_text
from shardprep.scan.parquet import is_parquet_name
from shardprep.scan.prefix import TopLevel, first_files, join, walk_input
from shardprep.scan.walk import FileEntry, Problems, Tick
from shardprep.storage import is_url

__all__ = ["scan_keyed_files"]

LABEL_EXT = "cls"


def _label_text(path: str, data: bytes | BaseException, problems: Problems) -> str | None:
    """The label in a ``.cls`` part's first ``LABEL_BYTES`` bytes, or None (a problem recorded)."""
    try:
        if isinstance(data, BaseException):
            raise data
        text = cls_file_text(data)
    except (OSError, UnicodeDecodeError) as err:
        problems.add(path, f"cannot read label ({err})")
        return None
    if not text.strip():
        problems.add(path, "empty .cls label file")
        return None
    return text


LABEL_BYTES = 1024


def _read_labels(
    paths: list[str], problems: Problems, storage_options: Mapping[str, Any] | None
) -> dict[str, str | None]:
    """The label of each ``.cls`` path (None where unreadable; ``problems`` says why).

    Local files are read one by one; URLs together, concurrently (one ranged GET each).
    """
    if not paths:
        return {}
    if is_url(paths[0]):
        found: list[bytes | BaseException] = list(read_heads(paths, LABEL_BYTES, storage_options))
    else:
        found = []
        for path in paths:
            try:
                with open(path, "rb") as f:
                    found.append(f.read(LABEL_BYTES))
            except OSError as err:
                found.append(err)
    return {p: _label_text(p, d, problems) for p, d in zip(paths, found, strict=True)}


def scan_keyed_files(
    root: str,
    tick: Tick,
    same_type_parts: bool = True,
    sink: SinkFactory = InventoryBuilder,
    storage_options: Mapping[str, Any] | None = None,
    interface: Interface = CLI,
) -> InventoryView:
    """Inventory of every key group below ``root``; ``tick(n)`` reports progress
    (``interface``: how refusals name the options, ``--format`` or ``input_format=``).

    ``root`` is a folder or a URL prefix (listed once, with ``storage_options``:
    :func:`~shardprep.scan.prefix.walk_input`); a folder's ``.cls`` labels are read together.

    ``same_type_parts=False`` (auto-detected layout) refuses a sample with two
    parts of the same last extension (``a.v1.png`` + ``a.v2.png``): those are
    more likely two samples with dotted names than one sample, so the user
    must say (``--format keyed`` follows WebDataset and merges them). It also refuses a
    ``.parquet`` file: a Parquet file is never one sample's part on a guess (``--format
    keyed`` takes it as one; ``--format parquet`` reads its rows).
    """
    builder = sink(root, False)
    labels = LabelTable()
    problems = Problems()
    unlabelled, first_unlabelled = 0, ""

    def by_folder(entry: FileEntry) -> str:
        return entry.rel_dir

    walked = walk_input(root, problems, storage_options, interface)
    for rel_dir, entries in groupby(walked, key=by_folder):
        groups: dict[str, list[FileEntry]] = {}
        label_paths = []
        for entry in entries:
            groups.setdefault(split_name(entry.name)[0], []).append(entry)
            if split_name(entry.name)[1] == LABEL_EXT:
                label_paths.append(join(root, rel_dir, entry.name))
        texts = _read_labels(label_paths, problems, storage_options)
        for stem in sorted(groups):
            parts, label, refused = [], UNLABELLED, False
            for entry in groups[stem]:
                ext = split_name(entry.name)[1]
                path = join(root, rel_dir, entry.name)
                if not ext:
                    problems.add(path, "file has no extension, so it cannot be a part of a sample")
                elif not same_type_parts and is_parquet_name(entry.name):
                    problems.add(path, _parquet_refusal(interface))
                    refused = True
                elif ext == LABEL_EXT:
                    text = texts[path]
                    label = labels.intern(text, path, path) if text is not None else UNLABELLED
                else:
                    parts.append((ext, entry.size, -1))
            if refused:  # (its other files would only add "a label but no data parts")
                continue
            sample = f"{rel_dir}/{stem}" if rel_dir else stem
            if not same_type_parts and _same_type(parts):
                names = ", ".join(repr(e.name) for e in groups[stem])
                problems.add(
                    join(root, sample),
                    f"{names} would be one sample (WebDataset groups files by the name up to "
                    "the first dot) with two parts of the same type; if they are separate "
                    "samples rename them so they differ before the first dot, if they are "
                    f"parts of one sample pass {interface.setting('input_format', 'keyed')}",
                )
                continue
            if not parts:
                problems.add(join(root, sample), "sample has a label but no data parts")
                continue
            if label == UNLABELLED:
                unlabelled += 1
                first_unlabelled = first_unlabelled or sample
            builder.add(sample, label, parts)
            tick(1)
    if len(labels) and unlabelled:
        problems.add(
            join(root, first_unlabelled),
            f"no .cls label, while other samples have one ({unlabelled} such samples); "
            "label every sample or none",
        )
    problems.raise_if_any()
    return labels.freeze(builder)


def _parquet_refusal(interface: Interface) -> str:
    """Why a ``.parquet`` file in detected keyed input is refused, and what to pass."""
    fmt = interface.setting
    return (
        "a Parquet file in keyed input (the input was detected as keyed files: its first "
        "folder with files holds no Parquet); a Parquet file is never read as a sample's part "
        f"on a guess: pass {fmt('input_format', 'parquet')} to read rows as samples, or "
        f"{fmt('input_format', 'keyed')} to take each file as a part"
    )


def _same_type(parts: list[tuple[str, int, int]]) -> bool:
    """True if two parts share their last extension (``v1.png``, ``v2.png``)."""
    last = [ext.rpartition(".")[2] for ext, _size, _offset in parts]
    return len(set(last)) < len(last)


def is_label_file(name: str) -> bool:
    """True if ``name`` is a ``.cls`` label part (``0001.cls``) by WebDataset's first-dot rule."""
    return split_name(name)[1] == LABEL_EXT


def first_files_have_labels(
    root: str,
    storage_options: Mapping[str, Any] | None = None,
    top: TopLevel | None = None,
    interface: Interface = CLI,
) -> bool:
    """True if the first folder below ``root`` (sorted walk) that holds files holds a ``.cls``.

    Used by auto-detection: a folder of folders is keyed data only when it is
    labelled by ``.cls`` parts. Labelled keyed data has one in every folder
    with samples, and the scanners refuse a ``.cls`` file elsewhere, so
    looking at the first folder decides without depending on folder order.
    ``root`` is a folder or a URL prefix (:func:`~shardprep.scan.prefix.first_files`).
    """
    names = first_files(root, storage_options, top, interface)
    if names is None:
        raise InputError(f"{root}: no files found; point RAW at the dataset folder", path=root)
    return any(is_label_file(n) for n in names)
