"""Run a function on several real torch.distributed ranks (gloo, CPU) and collect their results.

Each rank is a separate Python process (``tests.distributed.rank_main``)
started in its own session, so that it and every DataLoader worker it forks
form one process group: on a deadline, on the first failed rank, or on any
error here, the whole group is killed with SIGKILL. Nothing can outlive the
test and keep pytest (and CI) waiting. Ranks rendezvous through a file under
``tmp_path`` (no fixed port) and write their result as JSON.

Inside the ranks, DataLoader workers start with ``forkserver``: on CPython
3.11, ``os.fork()`` in a process whose threads (gloo's) hold locks can
deadlock the child forever (python/cpython#112275).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process and everything in its session; reap it."""
    with contextlib.suppress(ProcessLookupError):  # already gone, with all its children
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def run_ranks(
    fn: Callable[..., Any], world_size: int, tmp_path: Path, timeout: float = 120, **kwargs: Any
) -> list[Any]:
    """Run ``fn(rank=, world_size=, **kwargs)`` on ``world_size`` ranks; their JSON results by rank."""
    target = f"{fn.__module__}:{fn.__qualname__}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    logs = [tmp_path / f"rank{rank}.log" for rank in range(world_size)]
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for rank, log in enumerate(logs):
            command = [sys.executable, "-m", "tests.distributed.rank_main", target, str(rank)]
            command += [str(world_size), str(tmp_path), json.dumps(kwargs)]
            with log.open("wb") as out:
                processes.append(
                    subprocess.Popen(
                        command,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=ROOT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in processes):
            failed = [r for r, p in enumerate(processes) if p.returncode not in (None, 0)]
            if failed:
                break  # the others would wait for it in a collective: stop them now
            if time.monotonic() > deadline:
                hung = [r for r, p in enumerate(processes) if p.poll() is None]
                raise AssertionError(
                    f"ranks {hung} did not finish within {timeout} s (a DDP hang?)\n" + _tails(logs)
                )
            try:
                processes[0].wait(timeout=0.2)  # a bounded wait, not a sleep: wakes on exit
            except subprocess.TimeoutExpired:
                continue
    finally:
        for process in processes:
            kill_group(process)  # also reaps workers left by a rank that exited
    codes = [p.returncode for p in processes]
    assert codes == [0] * world_size, f"rank exit codes {codes}\n" + _tails(logs)
    return [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(world_size)]


def _tails(logs: list[Path]) -> str:
    return "\n".join(
        f"--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}"
        for log in logs
        if log.exists()
    )
