"""A small real filesystem for disk-full and read-only tests: a tmpfs, mounted and unmounted."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``where`` with mount ``options`` (``size=256k``, ``ro,size=64k``);
    the test is skipped where mounting is not permitted (needs root)."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'not permitted'})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)
