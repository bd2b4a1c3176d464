"""Rank functions for mixture and rank-group runs (imported by ``rank_main``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.utils.data

from loader.compose.mix import BATCHINGS
from loader.torch.mixdataset import GroupedDataset, MixedDataset


def _epoch(
    ds: Any, stop: int | None = None, consumed: int = 0
) -> tuple[list[list[list[Any]]], Any]:
    """One epoch of [key, source] batches with an all_reduce per step; state after ``stop`` batches."""
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, multiprocessing_context="forkserver"
    )
    batches, state = [], None
    for step, batch in enumerate(loader):
        one = torch.ones(1)
        dist.all_reduce(one)  # as DDP's gradient sync: unequal steps would hang
        sources = batch["__source__"].tolist()
        batches.append([[str(k), s] for k, s in zip(batch["__key__"], sources, strict=True)])
        if stop is not None and step + 1 == stop:
            state = ds.state_after(batch)
            break
    assert stop is not None or len(batches) == len(ds) - consumed
    return batches, state


def mixture(rank: int, world_size: int, outs: list[str]) -> dict[str, Any]:
    """Both batchings: :func:`mixture_run` each."""
    return {batching: mixture_run(outs, batching, world_size) for batching in BATCHINGS}


def mixture_run(outs: list[str], batching: str, world_size: int) -> dict[str, Any]:
    """Epochs 0 and 1 of a 3-source mixture; epoch 1 again from a state after 5 batches."""
    options: dict[str, Any] = {
        "weights": [0.2, 0.3, 0.5],
        "batch_size": 30,
        "samples_per_epoch": 3000,
        "batching": batching,
    }
    ds = MixedDataset(outs, **options)
    result: dict[str, Any] = {"len": len(ds), "counts": ds.stream.counts(world_size)}
    result["epoch0"], _ = _epoch(ds)
    result["epoch1"], _ = _epoch(ds)
    again = MixedDataset(outs, **options)
    again.set_epoch(1)
    _, state = _epoch(again, stop=5)
    resumed = MixedDataset(outs, **options)
    resumed.resume(state)
    result["resumed"], _ = _epoch(resumed, consumed=5)
    return result


def groups(rank: int, world_size: int, outs: list[str]) -> dict[str, Any]:
    """Ranks 0-1 read outs[0], ranks 2-3 read outs[1]; two epochs."""
    ds = GroupedDataset([(outs[0], [0, 1]), (outs[1], [2, 3])], batch_size=16)
    return {"len": len(ds), "epochs": [_epoch(ds)[0] for _ in range(2)]}
