"""Scanner for ``RAW/<class>/<file>``: one sample per file, the class is the folder name.

Classes are the sorted names of the top-level folders, numbered 0..C-1, and
files may sit at any depth below their class folder. Metadata only.
"""

from __future__ import annotations

import os

from shardprep.errors import InputError
from shardprep.inventory import Inventory, InventoryBuilder
from shardprep.scan.walk import Problems, Tick, walk_files

__all__ = ["scan_class_folders"]


def class_folder_names(root: str) -> list[str]:
    """Sorted non-hidden sub-folders of ``root``.

    Raises:
        InputError: ``root`` also holds files (then it is not a class-folder layout).
    """
    names, files = [], []
    with os.scandir(root) as it:
        for entry in it:
            if entry.name.startswith("."):
                continue
            (names if entry.is_dir() else files).append(entry.name)
    if files:
        raise InputError(
            f"{root}: class-folder input must contain only folders, but it has files "
            f"such as {sorted(files)[0]!r}; move them into a class folder or use --format keyed",
            path=root,
        )
    return sorted(names)


def scan_class_folders(root: str, tick: Tick) -> Inventory:
    """Inventory of every file below ``root/<class>/``; ``tick(n)`` reports progress."""
    classes = class_folder_names(root)
    builder = InventoryBuilder(root)
    problems = Problems()
    for label, name in enumerate(classes):
        before = len(builder)
        for entry in walk_files(os.path.join(root, name), problems):
            rel_dir = f"{name}/{entry.rel_dir}" if entry.rel_dir else name
            stem, dot, ext = entry.name.rpartition(".")
            if not dot or not stem:
                problems.add(
                    os.path.join(root, rel_dir, entry.name),
                    "file has no extension; the extension names the sample's part "
                    "(e.g. .jpg): rename it or move it out of the input",
                )
                continue
            builder.add(f"{rel_dir}/{stem}", label, [(ext, entry.size, -1)])
            if len(builder) % 4096 == 0:
                tick(4096)
        if len(builder) == before:
            problems.add(
                os.path.join(root, name), "class folder has no files; remove it or add samples"
            )
    tick(len(builder) % 4096)
    problems.raise_if_any()
    return builder.freeze(tuple(classes))
