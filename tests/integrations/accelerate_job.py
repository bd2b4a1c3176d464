"""An accelerate job on 2 ranks (``torchrun``, ``Accelerator(cpu=True)``); run by test_accelerate.py.

Usage: ``torchrun --standalone --nproc-per-node 2 accelerate_job.py DATA WORKDIR``.
Each part writes ``WORKDIR/<part>/rank<r>.json``: the keys of every step, or the error.

* ``recipe``: the supported way. The DataLoader is NOT passed to
  ``accelerator.prepare`` (ShardDataset already splits by rank); model and
  optimizer are, and batches move with ``send_to_device``. Every step runs a
  DDP backward (an all-reduce), so unequal step counts would hang.
* ``prepared-*``: what ``accelerator.prepare(dataloader)`` does to it instead,
  for batch-mode and sample-mode loaders, with ``dispatch_batches=False`` and
  with the default (``True`` for an IterableDataset). The default comes last:
  it fails on rank 0 inside accelerate and leaves rank 1 in a broadcast that
  ends only when rank 0's process is gone.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

BATCH_SIZE = 32
NUM_WORKERS = 2
PARTS = (
    "recipe",
    "prepared-batches-nodispatch",
    "prepared-samples-nodispatch",
    "prepared-batches-dispatch",
)


def run_part(part: str, data: str, workdir: Path) -> None:
    import torch
    from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
    from accelerate.utils import send_to_device
    from torch.utils.data import DataLoader

    from loader import ShardDataset

    dispatch = part.endswith("-dispatch")
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(dispatch_batches=None if dispatch else False),
        # a safety net: a rank left waiting in a collective fails instead of hanging
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=60))],
    )
    samples = "samples" in part
    dataset = ShardDataset(data, batch_size=None if samples else BATCH_SIZE)
    loader: Any = DataLoader(
        dataset,
        batch_size=BATCH_SIZE if samples else None,
        num_workers=NUM_WORKERS,
        multiprocessing_context="forkserver",  # never fork inside a gloo rank (Python 3.11)
    )
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    result: dict[str, Any] = {"world_size": accelerator.num_processes, "steps": []}
    if part == "recipe":
        result["len"] = len(loader)
    else:
        loader = accelerator.prepare(loader)
        result["wrapper"] = type(loader).__name__
    try:
        for batch in loader:
            batch = send_to_device(batch, accelerator.device)
            result["steps"].append(list(batch["__key__"]))
            real = (~batch["__padded__"]).float().unsqueeze(1)
            loss = model(real).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    except Exception as error:  # the finding is the error itself
        result["error"] = "".join(traceback.format_exception_only(error)).strip()
        # the traceback's frames hold the DataLoader's iterator in a reference cycle: freed only
        # at a later gc, whose finalizers may close its queues first, when torch then waits 5 s
        # for each worker before terminating it. Cleared, the iterator goes now, workers too.
        traceback.clear_frames(error.__traceback__)
    record = workdir / part
    record.mkdir(parents=True, exist_ok=True)
    (record / f"rank{accelerator.process_index}.json").write_text(json.dumps(result))
    if "error" not in result:
        accelerator.wait_for_everyone()


def main() -> None:
    data, workdir = sys.argv[1], Path(sys.argv[2])
    # workers unpickle a ShardDataset, or accelerate's wrapper around one: import them once
    multiprocessing.set_forkserver_preload(["loader.torch.dataset", "accelerate.data_loader"])
    for part in PARTS:
        run_part(part, data, workdir)


if __name__ == "__main__":
    main()
