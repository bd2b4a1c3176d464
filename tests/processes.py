"""Run a command with a hard deadline, killing its whole process tree whatever happens.

``subprocess.run(timeout=...)`` kills only the direct child: grandchildren
(process-pool workers, DataLoader workers, torchrun's ranks) keep its pipes
open, and ``run`` then waits for them forever. Here the command gets its own
session, and on a timeout, an error or a normal exit every process left in
that session is SIGKILLed before this returns.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from typing import Any

__all__ = ["run_bounded"]


def run_bounded(
    command: Sequence[str], timeout: float, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Like ``subprocess.run(command, capture_output=True, text=True)``, never outliving ``timeout``.

    Raises:
        AssertionError: the command did not finish in time (its output so far is in the message).
    """
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(process)
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"{' '.join(command)} did not finish within {timeout} s\n{stdout}\n{stderr}"
        ) from None
    finally:
        _kill_session(process)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _kill_session(process: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):  # the session is already empty
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
