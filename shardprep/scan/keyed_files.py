"""Scanner for files grouped by key: ``0001.jpg`` + ``0001.json`` (+ ``0001.cls``) is one sample.

Files with the same name up to the first dot in the same folder form a sample,
at any folder depth, as in WebDataset. A ``.cls`` part holds the label (read
here, the only data the scan reads); without ``.cls`` parts the data is
unlabelled. Metadata otherwise.
"""

from __future__ import annotations

import os
from itertools import groupby

from shardprep.errors import InputError
from shardprep.inventory import UNLABELLED, Inventory, InventoryBuilder
from shardprep.keys import split_name
from shardprep.scan.labels import LabelTable
from shardprep.scan.walk import FileEntry, Problems, Tick, walk_files

__all__ = ["scan_keyed_files"]

LABEL_EXT = "cls"


def _read_label(path: str, problems: Problems) -> str | None:
    try:
        with open(path, "rb") as f:
            text = f.read(1024).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        problems.add(path, f"cannot read label ({err})")
        return None
    if not text:
        problems.add(path, "empty .cls label file")
        return None
    return text


def scan_keyed_files(root: str, tick: Tick) -> Inventory:
    """Inventory of every key group below ``root``; ``tick(n)`` reports progress."""
    builder = InventoryBuilder(root)
    labels = LabelTable()
    problems = Problems()
    unlabelled: list[str] = []

    def by_folder(entry: FileEntry) -> str:
        return entry.rel_dir

    for rel_dir, entries in groupby(walk_files(root, problems), key=by_folder):
        groups: dict[str, list[FileEntry]] = {}
        for entry in entries:
            groups.setdefault(split_name(entry.name)[0], []).append(entry)
        for stem in sorted(groups):
            parts, label = [], UNLABELLED
            for entry in groups[stem]:
                ext = split_name(entry.name)[1]
                path = os.path.join(root, rel_dir, entry.name)
                if not ext:
                    problems.add(path, "file has no extension, so it cannot be a part of a sample")
                elif ext == LABEL_EXT:
                    text = _read_label(path, problems)
                    label = labels.intern(text) if text is not None else UNLABELLED
                else:
                    parts.append((ext, entry.size, -1))
            sample = f"{rel_dir}/{stem}" if rel_dir else stem
            if not parts:
                problems.add(os.path.join(root, sample), "sample has a label but no data parts")
                continue
            if label == UNLABELLED:
                unlabelled.append(sample)
            builder.add(sample, label, parts)
            tick(1)
    if len(labels) and unlabelled:
        problems.add(
            os.path.join(root, unlabelled[0]),
            f"no .cls label, while other samples have one ({len(unlabelled)} such samples); "
            "label every sample or none",
        )
    problems.raise_if_any()
    return labels.freeze(builder)


def looks_keyed(root: str) -> bool:
    """True if some folder below ``root`` holds two files sharing a key (``a.jpg``, ``a.json``).

    Used by auto-detection to tell keyed files in sub-folders from class folders.
    Stops at the first folder that has files.
    """
    for _dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        names = [n for n in filenames if not n.startswith(".")]
        if names:
            stems = [split_name(n)[0] for n in names]
            return len(set(stems)) < len(stems)
    raise InputError(f"{root}: no files found; point RAW at the dataset folder", path=root)
