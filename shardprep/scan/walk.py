"""Sorted, metadata-only directory walking and problem collection for the scanners.

Reads directory entries and stats files; never opens a file's data.
"""

from __future__ import annotations

import heapq
import os
import stat
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from shardprep.format.errors import InputError

__all__ = ["OS_JUNK_NAMES", "FileEntry", "Problems", "is_skipped_name", "walk_files"]

OS_JUNK_NAMES = frozenset({"thumbs.db", "ehthumbs.db", "ehthumbs_vista.db", "desktop.ini"})
"""Files an operating system writes into folders of images, never data: Windows' thumbnail
caches and folder settings (compared case-insensitively, as Windows names them). macOS's
``.DS_Store`` and ``._*`` files are hidden names, skipped as every ``.`` name is."""


def is_skipped_name(name: str) -> bool:
    """True for a name every folder scan skips: hidden (``.x``: ``.DS_Store``,
    ``.ipynb_checkpoints``) or an OS's own file (:data:`OS_JUNK_NAMES`: ``Thumbs.db``,
    ``desktop.ini``)."""
    return name.startswith(".") or name.lower() in OS_JUNK_NAMES


Tick = Callable[[int], None]

RUN_NAMES = 1 << 16  # a folder with more names is sorted in runs on disk, then merged


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

    Hidden names and OS junk files are skipped (:func:`is_skipped_name`).
    Files of a folder come before its sub-folders. Broken symlinks and
    unlistable folders are recorded in ``problems``; an unreadable file is
    reported by the writer when it opens it (checking here would cost a
    syscall per file).
    """
    here = os.path.join(top, rel_dir) if rel_dir else top
    try:
        names = sorted_names(here)
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


def sorted_names(folder: str, run: int | None = None) -> Iterator[str]:
    """The names in ``folder`` that are not skipped (:func:`is_skipped_name`), sorted, holding at most ``run`` (default ``RUN_NAMES``) of them in memory.

    A folder of millions of files is read in runs of ``run`` names, each
    sorted and spilled to an anonymous temporary file, then merged; smaller
    folders are sorted in memory. The listing happens before this returns
    (an unlistable folder raises ``OSError`` here), the merge as it is iterated.
    """
    run = run or RUN_NAMES
    runs: list[BinaryIO] = []
    batch: list[str] = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if is_skipped_name(entry.name):
                continue
            batch.append(entry.name)
            if len(batch) >= run:
                runs.append(_spill_run(sorted(batch)))
                batch = []
    batch.sort()
    if not runs:
        return iter(batch)
    return heapq.merge(*(_read_run(f) for f in runs), batch)


def _spill_run(names: list[str]) -> BinaryIO:
    """Write sorted ``names`` (length-prefixed file-system bytes) to an anonymous temporary file."""
    f = tempfile.TemporaryFile(prefix="shardprep-names-")  # noqa: SIM115 (closed by _read_run)
    for name in names:
        raw = os.fsencode(name)
        f.write(struct.pack("<I", len(raw)) + raw)
    f.seek(0)
    return f


def _read_run(f: BinaryIO) -> Iterator[str]:
    """The names of one spilled run, in order; closes (and so deletes) the file at the end."""
    with f:
        while header := f.read(4):
            (length,) = struct.unpack("<I", header)
            yield os.fsdecode(f.read(length))
