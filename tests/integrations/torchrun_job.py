"""torchrun + a plain DataLoader on 2 ranks (gloo); run by test_torchrun.py.

Usage: ``torchrun --standalone --nproc-per-node 2 torchrun_job.py DATA WORKDIR``.
The ShardDataset (``decode=True``, batches of 8) is built BEFORE
``init_process_group``; each rank then streams two epochs, syncing every step
with an all-reduce (as DDP's backward does), and resumes epoch 1 after batch
``RESUME_AFTER`` from ``state_after`` in a fresh dataset. Each rank writes
``WORKDIR/rank<r>.json``.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path
from typing import Any

BATCH_SIZE = 8
NUM_WORKERS = 2
EPOCHS = 2
RESUME_AFTER = 2  # resume epoch 1 after its batches 0..2


def describe(batch: dict[str, Any]) -> dict[str, Any]:
    """The decoded batch as JSON: keys, and each field's type, dtype, shape and values."""
    import torch

    fields = {}
    for name in ("cls", "npy", "png"):
        value = batch[name]
        fields[name] = {
            "type": type(value).__name__,
            "dtype": str(value.dtype) if isinstance(value, torch.Tensor) else None,
            "shape": list(value.shape) if isinstance(value, torch.Tensor) else None,
        }
    return {
        "keys": list(batch["__key__"]),
        "position": dict(batch["__position__"]),  # epoch, batch, num_workers
        "fields": fields,
        "cls": batch["cls"].tolist(),
        "npy": batch["npy"].tolist(),
        "pixels": batch["png"][:, :, 0, 0].tolist(),  # each image is one colour
    }


def stream(loader: Any) -> list[dict[str, Any]]:
    """One pass over ``loader``; an all-reduce per step makes unequal step counts hang."""
    import torch
    import torch.distributed as dist

    steps = []
    for batch in loader:
        dist.all_reduce(torch.ones(1))
        steps.append(describe(batch))
    return steps


def main() -> None:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from loader import ShardDataset

    data, workdir = sys.argv[1], Path(sys.argv[2])
    multiprocessing.set_forkserver_preload(
        ["loader.torch.dataset"]
    )  # workers unpickle a ShardDataset
    options: dict[str, Any] = {"batch_size": BATCH_SIZE, "decode": True, "shuffle_buffer": 16}
    dataset = ShardDataset(data, **options)  # before the process group exists
    dist.init_process_group("gloo")
    try:
        # forkserver, never fork: gloo's threads can deadlock a forked worker on Python 3.11
        loader_options: dict[str, Any] = {
            "batch_size": None,
            "num_workers": NUM_WORKERS,
            "multiprocessing_context": "forkserver",
        }
        loader = DataLoader(dataset, **loader_options)
        result: dict[str, Any] = {
            "rank": dataset.rank,
            "world_size": dataset.world_size,
            "len": len(loader),
            "epochs": [stream(loader) for _ in range(EPOCHS)],
        }
        # a restart after batch RESUME_AFTER of epoch 1: a new dataset resumes from state_after
        last = result["epochs"][1][RESUME_AFTER]
        state = dataset.state_after({"__position__": last["position"]})
        restarted = ShardDataset(data, **options)
        restarted.resume(json.loads(json.dumps(state)))  # as saved and read back
        result["state"] = state
        result["resumed"] = stream(DataLoader(restarted, **loader_options))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    (workdir / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
