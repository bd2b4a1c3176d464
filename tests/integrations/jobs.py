"""Run a multi-process training job as a subprocess that cannot outlive the test.

Each job runs in its own session (``start_new_session=True``), so the ranks,
the processes Lightning re-launches and every DataLoader worker share one
process group; ``os.killpg(..., SIGKILL)`` in a ``finally`` ends them all,
whether the job finished, failed, hung or the test was interrupted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def job_env() -> dict[str, str]:
    """The environment for a job: one thread per process (2 shared cores), the repo importable."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    # a rank variable leaking from an outer launcher would confuse the job's own launcher
    for name in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        env.pop(name, None)
    return env


def run_job(args: list[str], timeout: float) -> str:
    """Run ``args`` (a command line) to completion within ``timeout`` s; its output.

    Raises:
        AssertionError: the job exited non-zero or timed out (a DDP hang), with its output.
    """
    proc = subprocess.Popen(
        args,
        cwd=ROOT,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            raise AssertionError(
                f"job timed out after {timeout} s (a hang?): {args}\n{output[-6000:]}"
            ) from None
        assert proc.returncode == 0, f"job exited {proc.returncode}: {args}\n{output[-6000:]}"
        return output
    finally:
        with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
            os.killpg(proc.pid, signal.SIGKILL)  # ranks, relaunched ranks and workers alike
        proc.wait()


def python_job(script: str, *args: str) -> list[str]:
    """The command line running ``tests/integrations/<script>`` with this interpreter."""
    return [sys.executable, str(HERE / script), *args]


def torchrun_job(script: str, *args: str, nproc: int = 2) -> list[str]:
    """The command line running ``tests/integrations/<script>`` under torchrun on ``nproc`` ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(HERE / script),
        *args,
    ]


def read_ranks(folder: Path, world_size: int = 2) -> list[Any]:
    """The JSON each rank wrote to ``folder/rank<r>.json``."""
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world_size)]
