"""Rank functions for elastic-resume runs (imported by ``rank_main``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.utils.data

from loader import ShardDataset

OPTIONS: dict[str, Any] = {"batch_size": 8, "shuffle_buffer": 16, "block_size": 16}


def _loader(ds: ShardDataset, workers: int) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    context = "forkserver" if workers else None
    return torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=workers, multiprocessing_context=context
    )


def _step() -> None:
    """An all_reduce per step, as DDP's gradient sync: a rank with fewer batches hangs the others."""
    one = torch.ones(1)
    dist.all_reduce(one)


def elastic_pass(
    rank: int,
    world_size: int,
    out: str,
    uneven: str,
    workers: int,
    stop: int | None = None,
    state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Epoch 0 (after ``resume(state)`` if given) until ``stop`` batches; then, if resumed, epoch 1."""
    ds = ShardDataset(out, uneven=uneven, **OPTIONS)
    if state is not None:
        ds.resume(state)
    result: dict[str, Any] = {"batches": [], "state": None, "next": None}
    for step, batch in enumerate(_loader(ds, workers)):
        _step()
        keys = zip(batch["__key__"], batch["__padded__"], strict=True)
        result["batches"].append([[str(k), bool(p)] for k, p in keys])
        if stop is not None and step + 1 == stop:
            result["state"] = ds.state_after(batch)
            break
    steps = torch.tensor([len(result["batches"])])
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    assert int(steps.item()) == len(result["batches"]), "ranks took different numbers of steps"
    if state is not None:
        result["next"] = [
            [str(k) for k in b["__key__"]] for b in _loader(ds, workers) if _step() is None
        ]
    return result


def stateful_pass(
    rank: int,
    world_size: int,
    out: str,
    workers: int,
    stop: int | None = None,
    state: dict[str, Any] | None = None,
    how: str = "resume",
) -> dict[str, Any]:
    """Epoch 0 through torchdata's StatefulDataLoader until ``stop`` batches (its state_dict() is
    the result's state), or the rest of it from a saved ``state``: ``how="load"`` through the
    loader's ``load_state_dict`` (Lightning's way; ``ds.resume(state)`` is given it too, so that
    ``len()`` knows the resumed epoch), ``"resume"`` through ``ds.resume(state)`` alone."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = ShardDataset(out, **OPTIONS)
    if state is not None:
        ds.resume(state)  # "load" too: so that len() knows the epoch (docs/loader.md, Elastic)
    context = "forkserver" if workers else None
    loader = StatefulDataLoader(
        ds, batch_size=None, num_workers=workers, multiprocessing_context=context
    )
    if state is not None and how == "load":
        loader.load_state_dict(state)
    result: dict[str, Any] = {"batches": [], "positions": [], "state": None}
    for step, batch in enumerate(loader):
        _step()
        result["batches"].append([str(k) for k in batch["__key__"]])
        result["positions"].append(int(batch["__position__"]["batch"]))
        if stop is not None and step + 1 == stop:
            result["state"] = loader.state_dict()
            break
    steps = torch.tensor([len(result["batches"])])
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    assert int(steps.item()) == len(result["batches"]), "ranks took different numbers of steps"
    return result


def run_passes(
    rank: int, world_size: int, out: str, passes: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One pass per keyword set of ``passes``, in turn on the same ranks (each with its own
    dataset and loader): ``kind="elastic"`` runs :func:`elastic_pass`, ``"stateful"``
    :func:`stateful_pass`. One start of the ranks serves every case at its world size."""
    kinds = {"elastic": elastic_pass, "stateful": stateful_pass}
    results = []
    for options in passes:
        options = dict(options)
        run: Any = kinds[options.pop("kind")]
        results.append(run(rank, world_size, out, **options))
    return results
