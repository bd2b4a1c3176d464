"""Item 7 of issue 9: bounded memory against zstd frames and index entries that claim too much.

A frame replaced by a streamed frame of zeros that expands to 2 GiB, a frame whose
header declares 100 GiB, and the loader and ``verify`` reading them: an error naming
the shard and the frame, at bounded memory (peak RSS measured in a child process).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard

from tests.faults.shard_surgery import copy_output, index_of, rewrite_index, rewrite_shard

ROOT = Path(__file__).resolve().parents[2]
BOMB_BYTES = 2 << 30
PEAK_LIMIT_KIB = 300 << 10  # growth of the child's peak RSS while reading, in KiB


def _streamed_zeros(total: int, declare: bool) -> bytes:
    """A zstd frame of ``total`` zero bytes, compressed in 1 MiB steps (never allocated whole)."""
    compressor = zstandard.ZstdCompressor(level=1, write_checksum=True)
    stream = compressor.compressobj(size=total if declare else -1)
    zeros = bytes(1 << 20)
    parts = [stream.compress(zeros) for _ in range(total // len(zeros))]
    parts.append(stream.flush())
    return b"".join(parts)


def _declaring(size: int) -> bytes:
    """A tiny frame whose header claims ``size`` bytes: one 128 KiB RLE block, no checksum."""
    header = b"\x28\xb5\x2f\xfd" + bytes([0xC0, 0x38]) + struct.pack("<Q", size)
    block = (1 | 1 << 1 | (128 << 10) << 3).to_bytes(3, "little") + b"\x00"  # last, RLE
    return header + block


def _replace_frame(out: Path, shard: int, frame: int, new: bytes) -> None:
    """Put ``new`` in place of zstd frame ``frame``; index and manifest updated to agree."""
    index = index_of(out, shard)
    offsets = index.frame_offset
    path = out / f"shard-{shard:05d}.tar.zst"
    data = path.read_bytes()
    start, stop = int(offsets[frame]), int(offsets[frame + 1])
    rewrite_shard(out, shard, data[:start] + new + data[stop:])
    delta = len(new) - (stop - start)

    def shift(arrays: dict[str, Any]) -> None:
        shifted = arrays["frame_offset"].astype(np.int64)
        shifted[frame + 1 :] += delta
        arrays["frame_offset"] = shifted.astype(np.uint64)

    rewrite_index(out, shard, shift)


CHILD = """
import json, resource, sys
sys.path.insert(0, sys.argv[2])
from loader import CorruptShardError, ShardDataset
from shardprep.verify import verify_output
out = sys.argv[1]
dataset = ShardDataset(out, shuffle=False)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
result = {"count": 0}
try:
    for sample in dataset:
        result["count"] += 1
except CorruptShardError as err:
    result.update(error=type(err).__name__, key=err.key, shard=err.shard, message=str(err))
result["load_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
result["problems"] = verify_output(out).problems
result["verify_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
print(json.dumps(result))
"""


def _read_in_child(out: Path) -> dict[str, Any]:
    """Load and verify ``out`` in a fresh interpreter; killed if it runs past 120 s."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=120,  # subprocess.run kills the child when it expires
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
@pytest.mark.parametrize("declare", [False, True], ids=["no-size", "declares-2GiB"])
def test_zstd_bomb_is_an_error_at_bounded_memory(
    built_zstd: Path, tmp_path: Path, declare: bool
) -> None:
    out = copy_output(built_zstd, tmp_path / "out")
    bomb = _streamed_zeros(BOMB_BYTES, declare)
    assert len(bomb) < 200_000  # GiBs of output from a small frame
    index = index_of(out, 3)
    _replace_frame(out, 3, 1, bomb)
    result = _read_in_child(out)
    first = int(index.frame_sample[1])  # frame 1's first sample: its bytes are zeros now
    assert result["error"] == "CorruptShardError"
    assert result["shard"].endswith("shard-00003.tar.zst")
    assert result["key"] == index.key(first)
    assert "zstd frame 1" in result["message"]
    declared = f"declares {BOMB_BYTES} bytes" if declare else "declares no size"
    assert declared in result["message"]
    assert result["load_kib"] < PEAK_LIMIT_KIB, result
    assert result["verify_kib"] < PEAK_LIMIT_KIB, result
    assert any(
        p.startswith("shard-00003.tar.zst: zstd frame 1 at offset") and declared in p
        for p in result["problems"]
    ), result["problems"]


def test_a_frame_declaring_100_gib_names_shard_and_frame(built_zstd: Path, tmp_path: Path) -> None:
    out = copy_output(built_zstd, tmp_path / "out")
    frame = _declaring(100 << 30)
    assert zstandard.frame_content_size(frame) == 100 << 30
    _replace_frame(out, 5, 2, frame)
    result = _read_in_child(out)
    assert result["error"] == "CorruptShardError"
    assert result["shard"].endswith("shard-00005.tar.zst")
    assert "zstd frame 2" in result["message"]
    assert f"declares {100 << 30} bytes" in result["message"]
    assert result["load_kib"] < PEAK_LIMIT_KIB and result["verify_kib"] < PEAK_LIMIT_KIB, result
    assert any(p.startswith("shard-00005.tar.zst: zstd frame 2") for p in result["problems"])
