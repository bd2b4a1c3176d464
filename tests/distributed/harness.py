"""Run a function on several real torch.distributed ranks (gloo, CPU) and collect their results.

Each rank is a separate Python process, forked by one launcher process
(``tests.distributed.launch``) that imported torch once for all of them. The
launcher is started in its own session, so that it, its ranks and every
DataLoader worker they start form one process group: on a deadline, on the
first failed rank, or on any error here, the whole group is killed with
SIGKILL. Nothing can outlive the test and keep pytest (and CI) waiting. Ranks
rendezvous through a file under ``tmp_path`` (no fixed port) and write their
result as JSON (``tests.distributed.rank_main``).

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
    command = [sys.executable, "-m", "tests.distributed.launch", target, str(world_size)]
    command += [str(tmp_path), json.dumps(kwargs)]
    with (tmp_path / "launch.log").open("wb") as out:
        launcher = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
    try:
        try:
            launcher.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            codes = _codes(tmp_path, world_size)
            hung = [r for r, code in enumerate(codes) if code is None]
            raise AssertionError(
                f"ranks {hung} did not finish within {timeout} s (a DDP hang?)\n" + _tails(logs)
            ) from None
    finally:
        kill_group(launcher)  # the ranks and their workers share the launcher's session
    codes = _codes(tmp_path, world_size)
    assert launcher.returncode == 0 and codes == [0] * world_size, (
        f"rank exit codes {codes}, launcher exit code {launcher.returncode}\n"
        + _tails([*logs, tmp_path / "launch.log"])
    )
    return [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(world_size)]


def _codes(tmp_path: Path, world_size: int) -> list[int | None]:
    """Each rank's exit code as the launcher wrote it (None: running, or no launcher report)."""
    path = tmp_path / "exit-codes.json"
    codes: list[int | None] = json.loads(path.read_text()) if path.exists() else []
    return codes or [None] * world_size


def _tails(logs: list[Path]) -> str:
    return "\n".join(
        f"--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}"
        for log in logs
        if log.exists()
    )
