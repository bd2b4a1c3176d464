"""Dataset splits in an input's names: a detected layout never merges two splits into one.

A Hugging Face export names its files by split (``data/train-00000-of-00002.parquet``,
``data/test-00000-of-00001.parquet``) or puts each split in a folder (``train/``, ``test/``,
``validation/``), and so do many image datasets (``train/cat/1.jpg``, ``val/cat/2.jpg``).
A build makes one dataset of its input, so a detected layout holding more than one split
is refused, naming a file or folder of each (:func:`refuse_splits`); the ``--format`` the
message names reads every split into one dataset, on purpose. Pure; no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from shardprep.format.errors import InputError
from shardprep.format.interface import CLI, Interface

__all__ = ["SPLIT_NAMES", "refuse_splits", "split_folder", "split_of_file"]

SPLIT_NAMES = ("train", "test", "validation", "valid", "val", "dev")
"""The words a split is named by (compared case-insensitively)."""

_FILE_PREFIX = re.compile(r"(train|test|validation|valid|val|dev)[-_.]", re.IGNORECASE)


def split_folder(name: str) -> str | None:
    """The split a folder ``name`` is (``train``, ``Val`` ...), lower case, or None."""
    lower = name.lower()
    return lower if lower in SPLIT_NAMES else None


def split_of_file(rel: str) -> str | None:
    """The split of the file at ``rel`` (relative to the input), lower case, or None: its
    first folder named as a split, else its file name's split prefix (``train-...``,
    ``test_...``, ``validation.``...)."""
    *folders, name = rel.strip("/").split("/")
    for folder in folders:
        found = split_folder(folder)
        if found is not None:
            return found
    match = _FILE_PREFIX.match(name)
    return match.group(1).lower() if match else None


def refuse_splits(
    raw: str, named: Iterable[tuple[str | None, str]], fmt: str, interface: Interface = CLI
) -> None:
    """Refuse ``raw`` if ``named`` ((split or None, where) pairs, in input order) holds more
    than one split; ``fmt`` is the ``--format`` value that reads them all on purpose.

    Raises:
        InputError: two or more splits, naming the first file or folder of each.
    """
    first: dict[str, str] = {}
    for split, where in named:
        if split is not None:
            first.setdefault(split, where)
    if len(first) < 2:
        return
    found = ", ".join(f"{split} ({where})" for split, where in first.items())
    raise InputError(
        f"{raw}: holds {len(first)} dataset splits: {found}; a build makes one dataset, so "
        "the splits would be mixed into one: point RAW at one split (its folder; move a "
        "split's files into a folder of their own if the splits share one), or pass "
        f"{interface.setting('input_format', fmt)} to read every split into one dataset",
        raw,
    )
