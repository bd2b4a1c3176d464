"""docs/loader.md's table of what ``decode=True`` gives, per extension, for ShardDataset batches
and loader.core batches (images are covered by test_example_training)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch

import shardprep
from loader import ShardDataset
from loader.core import ShardStream
from loader.read.npbatch import PackedBytes
from loader.torch.batch import Packed


def test_decode_true_gives_what_the_docs_say(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(6):
        array = io.BytesIO()
        np.save(array, np.full(3, i, dtype=np.float32))
        (raw / f"{i:03d}.npy").write_bytes(array.getvalue())
        (raw / f"{i:03d}.cls").write_text(str(i % 2))
        (raw / f"{i:03d}.weight").write_text("1.5")
        (raw / f"{i:03d}.txt").write_text("hi")
        (raw / f"{i:03d}.json").write_text(json.dumps({"a": i}))
        (raw / f"{i:03d}.bin").write_bytes(b"xx")
    out = tmp_path / "out"
    shardprep.build(str(raw), str(out), shards=2, input_format="keyed", progress=False)

    sample = next(iter(ShardDataset(str(out), decode=True)))
    assert {k: type(v) for k, v in sample.items() if not k.startswith("__")} == {
        "cls": int, "weight": float, "txt": str, "json": dict, "npy": np.ndarray, "bin": bytes,
    }  # fmt: skip

    batch = next(iter(ShardDataset(str(out), batch_size=3, decode=True)))
    assert isinstance(batch["cls"], torch.Tensor) and batch["cls"].dtype == torch.int64
    assert isinstance(batch["weight"], torch.Tensor) and batch["weight"].dtype == torch.float64
    assert batch["txt"] == ["hi"] * 3
    assert [type(v) for v in batch["json"]] == [dict] * 3
    assert batch["npy"].dtype == torch.float32 and tuple(batch["npy"].shape) == (3, 3)
    assert isinstance(batch["bin"], Packed)

    core = next(
        iter(ShardStream(str(out), batch_size=3, decode=True).iterate(0, rank=0, world_size=1))
    )
    assert core["cls"].dtype == np.int64 and core["weight"].dtype == np.float64
    assert isinstance(core["npy"], np.ndarray) and core["npy"].shape == (3, 3)
    assert core["txt"] == ["hi"] * 3
    assert isinstance(core["bin"], PackedBytes)
