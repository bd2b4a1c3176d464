"""Start every rank of one ``harness.run_ranks`` call from one process that imported torch once.

``python -m tests.distributed.launch MODULE:FN WORLD TMP KWARGS`` imports torch,
torch.distributed and the rank function's module, then forks ``WORLD`` ranks. Each rank is its
own process, as under torchrun (their DataLoader workers fork from one fork server the launcher
started with torch and the loader imported): ``rank_main.main`` sets up the process group, its output goes to
``TMP/rank{r}.log`` and its result to ``TMP/rank{r}.json``. A fresh interpreter per rank would
import torch again in each (about 2 CPU-seconds on 2 busy cores, the largest part of a short
rank); the fork is taken before any thread or process group exists, so the ranks start clean.

The launcher runs in the session ``run_ranks`` gave it, and so do its ranks and their
DataLoader workers: ``run_ranks`` kills that whole session on a deadline or an error. The
launcher waits for its ranks, stops waiting ``GRACE_S`` after the first rank that fails (the others
would wait for it in a collective), and writes every rank's exit code (``null``: still running) to
``TMP/exit-codes.json``.

The ranks and the launcher end with ``gc.freeze()``: their atexit handlers still run, but
CPython's finalization no longer walks the ~170,000 objects of torch and the loader in a last
cyclic collection (about 0.5 CPU-s per process; 44-49 s -> 36 s for tests/distributed/test_ddp.py
and test_reweight_ddp.py on 2 cores, 2026-11-29). A rank's result is written before it ends.
"""

from __future__ import annotations

import gc
import importlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch  # noqa: F401  (imported once here, inherited by every rank)
import torch.distributed  # noqa: F401

import loader.torch.dataset  # noqa: F401
import loader.torch.mixdataset  # noqa: F401
from tests.distributed import rank_main

#: After a rank fails, how long the others get to end by themselves (a rank whose peer closed
#: the process group fails too, and often first: the failed rank's traceback is still being
#: written when its peers see the group close).
GRACE_S = 5.0


def _share_forkserver() -> None:
    """In a rank: use the launcher's fork server, which imported torch and the loader once.

    CPython checks its fork server with ``os.waitpid``, which fails in a process that did not
    start it (a rank, forked after the server started); the server itself serves any process
    that holds its address and its "alive" pipe, as a forked rank does.
    """
    server: Any = multiprocessing.forkserver._forkserver  # the process-wide one (private API)
    server.ensure_running = lambda: None  # running: started by the launcher before the fork


def _rank(target: str, rank: int, world_size: int, tmp: str, kwargs: dict[str, object]) -> int:
    """In the forked child: the rank, its output in ``rank{rank}.log``; its exit code."""
    _share_forkserver()
    log = os.open(Path(tmp, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    try:
        rank_main.main(target, rank, world_size, tmp, kwargs)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # the rank's own error: its traceback in its log, as a failed exit
        traceback.print_exc()
        return 1
    return 0


def launch(target: str, world_size: int, tmp: str, kwargs: dict[str, object]) -> dict[int, int]:
    """Fork the ranks, wait for them; ``{rank: exit code}`` of those that ended."""
    module, _ = target.split(":")
    importlib.import_module(module)  # before the fork: each rank finds it imported
    # One fork server for the ranks' DataLoader workers, not one per rank (each a fresh
    # interpreter importing torch again); started before the fork, in this thread-free process.
    multiprocessing.set_forkserver_preload(rank_main.FORKSERVER_PRELOAD)
    multiprocessing.forkserver.ensure_running()
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:  # the rank: it leaves through SystemExit, as a script ends (atexit runs)
            code = _rank(target, rank, world_size, tmp, kwargs)
            gc.freeze()  # no last collection at exit (module docstring)
            raise SystemExit(code)
        pids[pid] = rank
    codes: dict[int, int] = {}
    grace_ends: float | None = None  # set at the first failed rank
    while len(codes) < world_size:
        if grace_ends is None:
            pid, status = os.wait()
        else:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if time.monotonic() > grace_ends:
                    break  # the others wait for the failed rank: run_ranks kills them
                time.sleep(0.05)  # polling the ranks' exits, bounded by GRACE_S
                continue
        if pid not in pids:
            continue  # not a rank (a process a rank left to this one)
        codes[pids[pid]] = os.waitstatus_to_exitcode(status)
        if codes[pids[pid]] != 0 and grace_ends is None:
            grace_ends = time.monotonic() + GRACE_S
    return codes


def main(target: str, world_size: int, tmp: str, kwargs: dict[str, object]) -> None:
    codes = launch(target, world_size, tmp, kwargs)
    by_rank = [codes.get(rank) for rank in range(world_size)]
    Path(tmp, "exit-codes.json").write_text(json.dumps(by_rank))
    gc.freeze()  # no last collection at exit (module docstring)
    sys.exit(0 if by_rank == [0] * world_size else 1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))
