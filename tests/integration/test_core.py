"""loader.core without torch: importable where ``import torch`` fails, and the same samples as ShardDataset."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.utils.data

from loader import ShardDataset
from loader.core import ShardStream
from loader.read.npbatch import PackedBytes
from tests.processes import run_bounded

# A meta path finder that makes every ``import torch`` fail, installed before anything else.
NO_TORCH = """
import sys

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
        return None

sys.meta_path.insert(0, _NoTorch())
"""

PROBE = (
    NO_TORCH
    + """
import hashlib, json
import loader
from loader.core import ShardStream

out, rank, world, workers, batch, epoch = sys.argv[1], *map(int, sys.argv[2:7])
stream = ShardStream(out, batch_size=batch, shuffle_buffer=16, block_size=4)
slots = [
    list(stream.iterate(epoch, rank=rank, world_size=world, worker=w, num_workers=workers))
    for w in range(workers)
]
batches = []
for i in range(sum(map(len, slots))):  # the DataLoader's round-robin over worker slots
    b = slots[i % workers][i // workers]
    batches.append([
        b["__key__"].tolist(),
        [hashlib.sha256(p).hexdigest() for p in b["bin"].tolist()],
    ])
try:
    loader.ShardDataset
except ImportError as err:
    refused = str(err)
else:
    refused = None
print(json.dumps({
    "batches": batches,
    "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch"),
    "refused": refused,
}))
"""
)


def _digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def test_core_without_torch_yields_what_shard_dataset_yields(built: Path) -> None:
    rank, world, workers, batch, epoch = 1, 2, 2, 5, 1
    result = run_bounded(
        [sys.executable, "-c", PROBE, str(built), *map(str, (rank, world, workers, batch, epoch))],
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout)
    assert probe["torch"] == []
    assert probe["refused"] is not None and "torch is blocked" in probe["refused"]
    ds = ShardDataset(
        str(built),
        batch_size=batch,
        shuffle_buffer=16,
        block_size=4,
        rank=rank,
        world_size=world,
    )
    ds.set_epoch(epoch)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    expected = [[list(b["__key__"]), [_digest(p) for p in b["bin"].tolist()]] for b in loader]
    assert len(expected) == len(ds) == 11  # 103 // 2 = 51 samples per rank, batches of 5
    assert probe["batches"] == expected


def test_core_sample_mode_and_numpy_batches(built: Path) -> None:
    stream = ShardStream(str(built), decode=True)
    samples = list(stream.iterate(0, rank=0, world_size=3))
    assert len(samples) == stream.samples_per_rank(3) == 34
    every = [
        s["__key__"]
        for r in range(3)
        for w in range(2)
        for s in stream.iterate(0, rank=r, world_size=3, worker=w, num_workers=2)
    ]
    assert len(every) == len(set(every)) == 102  # 103 - 103 % 3, disjoint
    batches = ShardStream(str(built), batch_size=8, decode=True)
    first: dict[str, Any] = next(batches.iterate(0))
    assert isinstance(first["cls"], np.ndarray) and first["cls"].shape == (8,)
    assert isinstance(first["__key__"], np.ndarray) and first["__key__"].shape == (8,)
    raw = next(ShardStream(str(built), batch_size=8).iterate(0))
    assert isinstance(raw["bin"], PackedBytes) and len(raw["bin"]) == 8
    assert raw["__position__"] == {"epoch": 0, "num_workers": 1, "batch": 0}
    # resume: start skips that many items of the slot
    whole = [b["__key__"].tolist() for b in ShardStream(str(built), batch_size=8).iterate(2)]
    later = [
        b["__key__"].tolist() for b in ShardStream(str(built), batch_size=8).iterate(2, start=5)
    ]
    assert later == whole[5:] and len(whole) == 13
    with pytest.raises(ValueError, match="non-negative"):
        batches.iterate(0, start=-1)


ROOT = Path(__file__).resolve().parents[2]


def test_jax_example_trains_without_torch(example_out: Path) -> None:
    """docs/examples/train_jax.py on the README's example, torch blocked: 2 processes, equal steps,
    disjoint keys, and it learns (the mean loss of epoch 2 well under epoch 0's, on both)."""
    pytest.importorskip("jax", reason="the JAX example needs jax (in the test extras)")
    script = ROOT / "docs" / "examples" / "train_jax.py"
    runner = (
        NO_TORCH
        + "import runpy; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    epochs: list[list[dict[str, Any]]] = []
    for index in range(2):
        result = run_bounded(
            [sys.executable, "-c", runner, str(script), str(example_out), "--epochs", "3",
             "--batch-size", "16", "--process-index", str(index), "--process-count", "2"],
            timeout=180,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        epochs.append([json.loads(line) for line in result.stdout.splitlines()])
    for epoch in range(3):
        steps = [e[epoch]["steps"] for e in epochs]
        assert steps == [32, 32]  # 1000 // 2 = 500 samples per process: 31 batches of 16 and 4
        keys = [k for e in epochs for k in e[epoch]["keys"]]
        assert len(keys) == len(set(keys)) == 1000
    for process in epochs:
        first, last = process[0]["mean_loss"], process[2]["mean_loss"]
        assert process[0]["loss"][0] == pytest.approx(math.log(2))  # zero weights: p = 1/2
        # it learns: measured 0.41 -> 0.12 and 0.47 -> 0.12 (it diverged to thousands when
        # a decoded (3, 32, 32) image was histogrammed as if it were 3 bytes long)
        assert last < 0.5 * first and last < 0.25, [p["mean_loss"] for p in process]
    assert epochs[0][0]["keys"] != epochs[0][1]["keys"]  # a new order each epoch
