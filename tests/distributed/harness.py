"""Run a function on several real torch.distributed ranks (gloo, CPU) and collect their results.

Children are spawned processes that rendezvous through a file under
``tmp_path`` (no fixed port), write their result as JSON, and are joined
with a deadline. Every exit code is checked; a hang fails the test instead
of hanging the suite.
"""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _child(
    fn: Callable[..., Any], rank: int, world_size: int, tmp: str, kwargs: dict[str, Any]
) -> None:
    torch.set_num_threads(1)  # several ranks share 2 cores in CI
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size
    )
    try:
        result = fn(rank=rank, world_size=world_size, **kwargs)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))


def run_ranks(
    fn: Callable[..., Any], world_size: int, tmp_path: Path, timeout: float = 120, **kwargs: Any
) -> list[Any]:
    """Run ``fn(rank=, world_size=, **kwargs)`` on ``world_size`` ranks; their JSON results by rank."""
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_child, args=(fn, rank, world_size, str(tmp_path), kwargs))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout)
    hung = [rank for rank, p in enumerate(processes) if p.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    assert not hung, f"ranks {hung} did not finish within {timeout} s (a DDP hang?)"
    codes = [p.exitcode for p in processes]
    assert codes == [0] * world_size, f"rank exit codes {codes}"
    return [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(world_size)]
