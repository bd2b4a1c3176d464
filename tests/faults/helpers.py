"""Shared by the fault-injection tests: the CLI in-process, and output-folder fingerprints."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

from click.testing import CliRunner, Result

from shardprep.cli import cli


def invoke(*args: str) -> Result:
    """Run the CLI in-process; a fault must give one message, never a traceback."""
    result = CliRunner().invoke(cli, list(args))
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def error_lines(result: Result) -> list[str]:
    """The lines of stderr that start with ``Error:``."""
    return [line for line in result.stderr.splitlines() if line.startswith("Error:")]


def tree_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file in ``folder`` (hidden ones included), by name."""
    return {
        name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
        for name in sorted(os.listdir(folder))
    }


def write(path: Path, data: bytes | str = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def class_folders(root: Path, seed: int, per_class: int = 20) -> Path:
    """Three class folders ``c0``..``c2`` under ``root`` of ``per_class`` random files each
    (300 + 7 * i bytes), the same for the same seed."""
    rng = random.Random(seed)
    for c in range(3):
        for i in range(per_class):
            write(root / f"c{c}" / f"{i:02d}.bin", rng.randbytes(300 + 7 * i))
    return root
