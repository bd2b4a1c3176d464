"""Sorted, metadata-only directory walking and problem collection for the scanners.

Reads directory entries and stats files; never opens a file's data.
"""

from __future__ import annotations

import os
import stat
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
        # Names only (not DirEntry objects): a folder of a million files stays small in memory.
        names = sorted(name for name in os.listdir(here) if not name.startswith("."))
        folder = os.open(here, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as err:
        problems.add(here, f"cannot list folder ({err.strerror})")
        return
    subdirs = []
    try:
        for name in names:
            try:
                info = os.stat(name, dir_fd=folder)
            except FileNotFoundError:
                path = os.path.join(here, name)
                problems.add(
                    path, "broken symlink" if os.path.islink(path) else "vanished during the scan"
                )
                continue
            except OSError as err:
                problems.add(os.path.join(here, name), f"cannot stat ({err.strerror})")
                continue
            if stat.S_ISDIR(info.st_mode):
                subdirs.append(name)
            elif stat.S_ISREG(info.st_mode):
                yield FileEntry(rel_dir, name, info.st_size)
            else:
                problems.add(
                    os.path.join(here, name), "not a regular file (device, pipe or socket)"
                )
    finally:
        os.close(folder)
    for name in subdirs:
        yield from walk_files(top, problems, f"{rel_dir}/{name}" if rel_dir else name)
