"""Shared by the fault-injection tests: the CLI in-process, output-folder fingerprints, and
small inputs (class folders, the example images, a damaged Parquet page)."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import shardprep
from shardprep.cli import cli
from shardprep.example import write_example


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


def tree_bytes(folder: Path) -> dict[str, bytes]:
    """The bytes of every file in ``folder``, by name."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


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


def example_raw(tmp_path_factory: pytest.TempPathFactory, name: str, samples: int) -> Path:
    """``<mktemp(name)>/raw``: ``samples`` example images in 3 classes (seed 0)."""
    base = tmp_path_factory.mktemp(name)
    write_example(str(base / "raw"), samples, 3, 0)
    return base / "raw"


def map_reference(raw: Path, shards: int, map_spec: str) -> Path:
    """``raw``'s sibling ``reference``: RAW built with ``map_spec`` (1 worker), as it should be."""
    out = raw.parent / "reference"
    shardprep.build(str(raw), str(out), shards=shards, workers=1, map=map_spec, progress=False)
    return out


def flip_page_byte(raw: Path, row_group: int, column: int) -> None:
    """Flip one byte in the middle of the data pages of ``column`` in ``row_group`` of the
    Parquet file ``raw`` (written uncompressed, so the flip lands in a payload)."""
    import pyarrow.parquet as pq

    chunk = pq.ParquetFile(raw).metadata.row_group(row_group).column(column)
    data = bytearray(raw.read_bytes())
    data[chunk.data_page_offset + chunk.total_compressed_size // 2] ^= 0xFF
    raw.write_bytes(bytes(data))
