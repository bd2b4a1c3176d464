"""One rank of ``harness.run_ranks`` (forked by ``tests.distributed.launch``; also runs alone:
``python -m tests.distributed.rank_main MODULE:FN RANK WORLD TMP KWARGS``)."""

from __future__ import annotations

import importlib
import json
import multiprocessing
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

#: What the ranks' fork server imports before it forks DataLoader workers.
FORKSERVER_PRELOAD = ["torch", "loader.torch.dataset", "loader.torch.mixdataset"]


def main(target: str, rank: int, world_size: int, tmp: str, kwargs: dict[str, object]) -> None:
    torch.set_num_threads(1)  # several ranks share 2 cores in CI
    # Workers fork from a clean, thread-free server that already imported torch and loader.
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    module, name = target.split(":")
    fn = getattr(importlib.import_module(module), name)

    def init_group() -> None:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=90),
        )

    try:
        if getattr(fn, "initializes_group", False):  # it builds things before the group exists
            result = fn(rank=rank, world_size=world_size, init_group=init_group, **kwargs)
        else:
            init_group()
            result = fn(rank=rank, world_size=world_size, **kwargs)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]))
