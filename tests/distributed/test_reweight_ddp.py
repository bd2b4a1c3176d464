"""Read-time class reweighting under real DDP (gloo ranks): equal per-rank counts and steps,
the target class counts over the epoch, a new draw each epoch, and the same order as a
single process simulating each rank.

The rank function lives at module level so spawned children can import it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.utils.data

import shardprep
from loader import ShardDataset
from tests.distributed.harness import run_ranks
from tests.processes import preloaded_forkserver

pytestmark = pytest.mark.distributed

COUNTS = {"a": 60, "b": 20, "c": 7}  # 87 samples; balanced: 29 per class per epoch
OPTIONS: dict[str, Any] = {"class_weights": "balanced", "shuffle_buffer": 16, "block_size": 8}


def _pairs(batch: list[dict[str, Any]]) -> list[list[Any]]:
    return [[s["__key__"], int(s["cls"]), s["__padded__"]] for s in batch]


def _weights(batch: list[dict[str, Any]]) -> list[list[Any]]:
    return [[s["__key__"], int(s["cls"]), s["__weight__"]] for s in batch]


def _loader(
    ds: ShardDataset, collate: Callable[[list[dict[str, Any]]], Any]
) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    return torch.utils.data.DataLoader(
        ds, batch_size=5, num_workers=2, collate_fn=collate, multiprocessing_context="forkserver"
    )


def reweighted_epochs(rank: int, world_size: int, out: str, uneven: str) -> dict[str, Any]:
    """Epochs 0 and 1 of read-time resampling, and one of read-time weights, on this rank."""
    ds = ShardDataset(out, uneven=uneven, **OPTIONS)
    assert (ds.rank, ds.world_size) == (rank, world_size)
    result: dict[str, Any] = {"len": ds.num_samples}
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        batches = []
        for batch in _loader(ds, _pairs):
            step = torch.ones(1)
            dist.all_reduce(step)  # as DDP's gradient sync: a rank with fewer steps hangs
            batches.append(batch)
        steps = torch.tensor([len(batches)])
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        assert int(steps.item()) == len(batches), "ranks took different numbers of steps"
        result[f"epoch{epoch}"] = batches
    weighted = ShardDataset(out, uneven=uneven, resample=False, **OPTIONS)
    result["weights"] = [s for batch in _loader(weighted, _weights) for s in batch]
    return result


@pytest.fixture
def out(make_class_folders: Callable[..., Path], tmp_path: Path) -> Path:
    raw = make_class_folders(COUNTS)
    target = tmp_path / "out"
    shardprep.build(str(raw), str(target), shards=5, workers=1, progress=False)
    return target


@pytest.mark.parametrize(("world_size", "uneven", "per_rank"), [(3, "drop", 29), (2, "pad", 44)])
def test_reweighted_epochs_under_ddp(
    out: Path, tmp_path: Path, world_size: int, uneven: str, per_rank: int
) -> None:
    (tmp_path / "ranks").mkdir()
    results = run_ranks(
        reweighted_epochs, world_size, tmp_path / "ranks", out=str(out), uneven=uneven
    )
    assert [r["len"] for r in results] == [per_rank] * world_size
    multisets = []
    for epoch in ("epoch0", "epoch1"):
        assert len({len(r[epoch]) for r in results}) == 1, "unequal step counts"
        samples = [s for r in results for batch in r[epoch] for s in batch]
        assert [sum(len(b) for b in r[epoch]) for r in results] == [per_rank] * world_size
        real = [s for s in samples if not s[2]]
        classes = Counter(cls for _, cls, _ in real)
        # 87 = 29 x 3: the whole epoch holds exactly the target counts, split over the
        # ranks (pad: 88 slots, the one extra a flagged repeat).
        assert sorted(classes.items()) == [(0, 29), (1, 29), (2, 29)]
        assert len(samples) - len(real) == per_rank * world_size - 87
        keys = Counter(key for key, _, _ in real)
        assert max(keys.values()) == 5  # c: 7 samples drawn 29 times -> 4 or 5 each
        multisets.append(keys)
    assert multisets[0] != multisets[1], "the same draw in two epochs"
    # Read-time weights: every sample once over the ranks, weight = target / actual share.
    weights = {key: (cls, w) for r in results for key, cls, w in r["weights"]}
    assert len(weights) == 87 - (87 % world_size if uneven == "drop" else 0)
    expected = {0: (1 / 3) / (60 / 87), 1: (1 / 3) / (20 / 87), 2: (1 / 3) / (7 / 87)}
    assert all(w == pytest.approx(expected[cls], rel=1e-12) for cls, w in weights.values())
    # Determinism: one process simulating each rank streams exactly what the rank did (its
    # workers start as the ranks' do, from a fork server that imported the loader: rank_main.py)
    with preloaded_forkserver(["loader.torch.dataset"]):
        for rank, r in enumerate(results):
            ds = ShardDataset(str(out), uneven=uneven, rank=rank, world_size=world_size, **OPTIONS)
            ds.set_epoch(1)
            assert [_json(b) for b in _loader(ds, _pairs)] == r["epoch1"]


def _json(batch: list[list[Any]]) -> list[list[Any]]:
    return [list(s) for s in batch]
