"""Sorted, metadata-only directory walking and problem collection for the scanners.

Reads directory entries and stats files; never opens a file's data.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from shardprep.errors import InputError

__all__ = ["FileEntry", "Problems", "walk_files"]

Tick = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class FileEntry:
    """A regular file found by the walk: folder relative to the root, name, size."""

    rel_dir: str  # "" for the root itself, else "a/b" (no trailing slash)
    name: str
    size: int


@dataclass
class Problems:
    """Collects every input problem so the user sees them all in one error."""

    items: list[tuple[str, str]] = field(default_factory=list)

    def add(self, path: str, message: str) -> None:
        """Record that ``path`` cannot be used, and why."""
        self.items.append((path, message))

    def raise_if_any(self, shown: int = 10) -> None:
        """Raise one InputError naming the first ``shown`` problems and the total."""
        if not self.items:
            return
        lines = [f"  {path}: {message}" for path, message in self.items[:shown]]
        more = len(self.items) - shown
        if more > 0:
            lines.append(f"  ... and {more} more")
        raise InputError(
            f"{len(self.items)} input problem(s), nothing was written:\n" + "\n".join(lines),
            path=self.items[0][0],
        )


def walk_files(top: str, problems: Problems, rel_dir: str = "") -> Iterator[FileEntry]:
    """Yield every non-hidden regular file below ``top`` in sorted order.

    Names starting with ``.`` are skipped (``.DS_Store``, ``.ipynb_checkpoints``).
    Files of a folder come before its sub-folders. Broken symlinks and
    unlistable folders are recorded in ``problems``; an unreadable file is
    reported by the writer when it opens it (checking here would cost a
    syscall per file).
    """
    here = os.path.join(top, rel_dir) if rel_dir else top
    try:
        with os.scandir(here) as it:
            entries = sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError as err:
        problems.add(here, f"cannot list folder ({err.strerror})")
        return
    subdirs = []
    for entry in entries:
        try:
            if entry.is_dir():
                subdirs.append(entry.name)
                continue
            st = entry.stat()
        except FileNotFoundError:
            why = "broken symlink" if entry.is_symlink() else "vanished during the scan"
            problems.add(entry.path, why)
            continue
        except OSError as err:
            problems.add(entry.path, f"cannot stat ({err.strerror})")
            continue
        yield FileEntry(rel_dir, entry.name, st.st_size)
    for name in subdirs:
        yield from walk_files(top, problems, f"{rel_dir}/{name}" if rel_dir else name)
