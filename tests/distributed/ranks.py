"""Functions that run on each rank of a distributed test (imported by ``rank_main``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.data

from loader import ShardDataset

OPTIONS: dict[str, Any] = {"shuffle_buffer": 64, "block_size": 32}


def epoch_batches(
    ds: ShardDataset,
    sync: bool = True,
    loader: torch.utils.data.DataLoader | None = None,  # type: ignore[type-arg]
    state_at: int | None = None,
    consumed: int = 0,
) -> tuple[list[list[list[Any]]], dict[str, Any] | None]:
    """One epoch of batches as [key, padded] pairs, and ``ds.state_after`` batch ``state_at``.

    With ``sync``, every step does an all_reduce, as DDP's gradient sync does:
    if one rank ran out of batches early, the others hang and the test times out.
    """
    if loader is None:
        loader = torch.utils.data.DataLoader(
            ds, batch_size=None, num_workers=2, multiprocessing_context="forkserver"
        )
    batches, state = [], None
    for step, batch in enumerate(loader):
        if sync:
            one = torch.ones(1)
            dist.all_reduce(one)
            assert int(one.item()) == dist.get_world_size()
        batches.append(
            [[str(k), bool(p)] for k, p in zip(batch["__key__"], batch["__padded__"], strict=True)]
        )
        if step == state_at:
            state = ds.state_after(batch)
    steps = torch.tensor([len(batches)])
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    assert int(steps.item()) == len(batches), "ranks took different numbers of steps"
    # A resumed pass delivers the epoch's batches after the `consumed` ones.
    assert len(batches) == len(loader) - consumed, "len(loader) differs from what arrived"
    return batches, state


def train_like(rank: int, world_size: int, out: str, uneven: str) -> dict[str, Any]:
    """Epochs 0 and 1 at batch 16 (no set_epoch), epoch 0 at batch 1, and a mid-epoch resume."""
    ds = ShardDataset(out, uneven=uneven, batch_size=16, **OPTIONS)
    assert (ds.rank, ds.world_size) == (rank, world_size)
    result: dict[str, Any] = {"len": len(ds), "num_samples": ds.num_samples}
    result["epoch0_b16"], _ = epoch_batches(ds)
    single = ShardDataset(out, uneven=uneven, batch_size=1, **OPTIONS)
    result["epoch0_b1"], _ = epoch_batches(single, sync=False)  # 333 steps: count-checked only
    result["epoch1_b16"], state = epoch_batches(ds, state_at=6)  # the next epoch by itself
    assert state is not None
    resumed = ShardDataset(out, uneven=uneven, batch_size=16, **OPTIONS)
    resumed.resume(state)  # as if the job crashed after 7 batches of epoch 1
    result["state"] = state
    result["resumed"], _ = epoch_batches(resumed, consumed=state["batches"])
    return result


def built_before_group(
    rank: int, world_size: int, out: str, init_group: Callable[[], None]
) -> dict[str, Any]:
    """A dataset made before init_process_group (as in a LightningModule's __init__), 2 epochs."""
    ds = ShardDataset(out, batch_size=10, **OPTIONS)
    init_group()
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=None,
        num_workers=2,
        multiprocessing_context="forkserver",
        persistent_workers=True,
    )
    epochs = [epoch_batches(ds, loader=loader)[0] for _ in range(2)]
    return {"rank": ds.rank, "epochs": epochs}


built_before_group.initializes_group = True  # type: ignore[attr-defined]


def before_group_then_train_like(
    rank: int,
    world_size: int,
    before: str,
    out: str,
    uneven: str,
    init_group: Callable[[], None],
) -> dict[str, Any]:
    """:func:`built_before_group` over ``before``, then :func:`train_like` over ``out`` on the
    same ranks: one start of the ranks for both (a start costs seconds on 2 cores)."""
    first = built_before_group(rank, world_size, before, init_group)
    return {"before_group": first, "train_like": train_like(rank, world_size, out, uneven)}


before_group_then_train_like.initializes_group = True  # type: ignore[attr-defined]


def rank_1_fails(rank: int, world_size: int, marker: str) -> dict[str, Any]:
    """Rank 1 raises; the other ranks wait for it in a collective it never joins."""
    if rank == 1:
        raise RuntimeError(f"{marker}: rank 1 failed on purpose")
    dist.barrier()
    return {"rank": rank}


def rank_1_hangs(rank: int, world_size: int, pids: str) -> dict[str, Any]:
    """Every rank writes its session id to ``pids/rank{r}``, then rank 1 never returns."""
    import os
    import time
    from pathlib import Path

    Path(pids, f"rank{rank}").write_text(str(os.getsid(0)))
    while rank == 1:  # a hung rank: the harness's deadline must end it
        time.sleep(0.5)
    dist.barrier()
    return {"rank": rank}
