"""Functions that run on each rank of a distributed test (importable by spawned children)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.utils.data

from loader import ShardDataset


def _keys(batch: list[dict[str, Any]]) -> list[list[Any]]:
    return [[s["__key__"], s["__padded__"]] for s in batch]


def epoch_batches(ds: ShardDataset, batch_size: int, sync: bool = True) -> list[list[list[Any]]]:
    """One epoch of batches as [key, padded] pairs.

    With ``sync``, every step does an all_reduce, as DDP's gradient sync does:
    if one rank ran out of batches early, the others hang and the test times out.
    """
    # Children of a spawned process default to spawn; fork is what torchrun ranks get.
    loader = torch.utils.data.DataLoader(
        ds, batch_size=batch_size, num_workers=2, collate_fn=_keys, multiprocessing_context="fork"
    )
    batches = []
    for batch in loader:
        if sync:
            step = torch.ones(1)
            dist.all_reduce(step)
            assert int(step.item()) == dist.get_world_size()
        batches.append(batch)
    steps = torch.tensor([len(batches)])
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    assert int(steps.item()) == len(batches), "ranks took different numbers of steps"
    return batches


def train_like(rank: int, world_size: int, out: str, uneven: str) -> dict[str, Any]:
    """Epochs 0 and 1 at batch 16, epoch 0 at batch 1, and a mid-epoch resume."""
    ds = ShardDataset(out, uneven=uneven, shuffle_buffer=64, block_size=32)
    assert (ds.rank, ds.world_size) == (rank, world_size)
    result: dict[str, Any] = {"len": len(ds)}
    result["epoch0_b16"] = epoch_batches(ds, 16)
    result["epoch0_b1"] = epoch_batches(ds, 1, sync=False)  # 333 steps: count-checked only
    ds.set_epoch(1)
    result["epoch1_b16"] = epoch_batches(ds, 16)
    loader = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=2)
    state = ds.state_dict(7, loader)  # as if 7 batches of epoch 1 were consumed, then a crash
    resumed = ShardDataset(out, uneven=uneven, shuffle_buffer=64, block_size=32)
    resumed.load_state_dict(state)
    result["state"] = state
    result["resumed"] = epoch_batches(resumed, 16)
    return result
