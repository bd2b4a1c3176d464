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
import traceback
from collections.abc import Iterator, Sequence
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


@contextlib.contextmanager
def dataloader_iterator(loader: Any) -> Iterator[Any]:
    """``iter(loader)``, whose worker processes are told to stop on exit.

    When a worker's IterableDataset raises, torch marks the worker done without
    sending it its end-of-work ``None``, and the iterator's shutdown then waits
    up to ``MP_STATUS_CHECK_INTERVAL`` (5 s) for the worker's next poll. Tests
    that provoke such errors send the ``None`` themselves, then shut down.

    An error raised by ``iter(loader)`` itself (torchdata's StatefulDataLoader starts its
    workers there) leaves the half-made iterator in the traceback's frames: freed only at a
    later gc, whose finalizers may close its queues first, when torch waits 5 s per worker.
    Clearing those frames frees it (and stops its workers) at once.
    """
    try:
        iterator = iter(loader)
    except BaseException as error:
        traceback.clear_frames(error.__traceback__)
        raise
    try:
        yield iterator
    finally:
        for queue in getattr(iterator, "_index_queues", ()):
            queue.put(None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
