"""Test hooks for tests/faults/test_killed_driver.py: a ``--map`` and a worker pool that hold.

``held`` is the identity map. With ``HELD_MAP_DIR`` set and ``HELD_MAP_DIR/hold`` holding a
number N, each process passes N samples through, then writes ``HELD_MAP_DIR/held-<pid>`` and
waits while the hold file exists (at most ``HOLD_LIMIT_S``): the build's writers are then
mid-shard, in a known state, when the test kills the build.

``python -m tests.faults.held_map pool START FOLDER`` opens a :func:`shardprep.workers.worker_pool`
of 2 workers started by START (fork, spawn); each worker writes ``FOLDER/held-<pid>`` and waits
(at most ``HOLD_LIMIT_S``) for the test to kill this process.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

from shardprep.workers import worker_pool

HOLD_LIMIT_S = 120.0
_passed = 0  # samples this process let through (one count per writer process)
_kept: list[Any] = []  # what keep() was given, for the worker's life


def keep(thing: Any) -> None:
    """A pool initializer that keeps what it is given (as the writers keep their context)."""
    _kept.append(thing)


def held(sample: dict[str, Any]) -> dict[str, Any]:
    """The identity; holds as the module doc says."""
    global _passed
    folder = os.environ.get("HELD_MAP_DIR")
    if folder:
        hold = Path(folder) / "hold"
        try:
            limit = int(hold.read_text())
        except FileNotFoundError:
            return sample
        if _passed >= limit:
            _wait_while(hold, Path(folder) / f"held-{os.getpid()}")
        _passed += 1
    return sample


def _wait_while(hold: Path, marker: Path) -> None:
    marker.touch()
    deadline = time.monotonic() + HOLD_LIMIT_S
    while hold.exists():  # a test hook waiting for the test to remove a file
        if time.monotonic() > deadline:
            raise TimeoutError(f"{hold} still exists after {HOLD_LIMIT_S} s (test hook)")
        time.sleep(0.02)


def _hold_worker(folder: str) -> int:
    _wait_while(Path(folder) / "hold", Path(folder) / f"held-{os.getpid()}")
    return os.getpid()


def pool(start: str, folder: str) -> None:
    """2 pool workers, each held (see the module doc); returns when they are released."""
    with worker_pool(2, context=multiprocessing.get_context(start)) as workers:
        futures = [workers.executor.submit(_hold_worker, folder) for _ in range(2)]
        for future in futures:
            future.result(timeout=HOLD_LIMIT_S + 30)


if __name__ == "__main__":  # the pool's functions must be this module's, not __main__'s
    from tests.faults.held_map import pool as run_pool

    assert sys.argv[1] == "pool", sys.argv
    run_pool(sys.argv[2], sys.argv[3])
