"""Run a command with a hard deadline, killing its whole process tree whatever happens.

``subprocess.run(timeout=...)`` kills only the direct child: grandchildren
(process-pool workers, DataLoader workers, torchrun's ranks) keep its pipes
open, and ``run`` then waits for them forever. Here the command gets its own
session, and on a timeout, an error or a normal exit every process left in
that session is SIGKILLed before this returns.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "kill_session",
    "preloaded_forkserver",
    "run_bounded",
    "session_processes",
    "wait_until_gone",
]


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
    Clearing those frames frees it (and stops its workers) at once. A pass left before its end
    (or refused at a batch) is likewise stopped on exit, not by a later gc's 5 s per worker;
    one iterated to its end has stopped its workers itself.
    """
    try:
        iterator = iter(loader)
    except BaseException as error:
        traceback.clear_frames(error.__traceback__)
        raise
    try:
        yield iterator
    finally:
        if not getattr(iterator, "_shutdown", False):  # a pass iterated to its end stopped them
            for queue in getattr(iterator, "_index_queues", ()):
                queue.put(None)
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()


def session_processes(sid: int, zombies: bool = True) -> list[int]:
    """The pids of the processes in session ``sid``, from /proc.

    A zombie (exited, its memory and descriptors freed, not yet reaped; this machine's
    init reaps orphans about once a second) is left out with ``zombies=False``.
    """
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # it exited while we looked
            continue
        # Fields after the command name (which may hold spaces and parentheses): state, ppid,
        # pgrp, session, ...
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and (zombies or fields[0] != "Z"):
            found.append(int(entry))
    return sorted(found)


def wait_until_gone(sid: int, within: float) -> dict[int, str]:
    """Poll until no live process is left in session ``sid``; what is left after ``within`` s
    (pid -> the start of its command line)."""
    deadline = time.monotonic() + within
    while True:
        left = session_processes(sid, zombies=False)
        if not left or time.monotonic() > deadline:
            return {pid: _command(pid) for pid in left}
        time.sleep(0.02)  # polling /proc, bounded by the deadline


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
    except OSError:
        return "?"


def kill_session(sid: int) -> None:
    """SIGKILL every process left in session ``sid``, and wait (bounded) until none runs."""
    deadline = time.monotonic() + 30
    while left := session_processes(sid, zombies=False):
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert time.monotonic() < deadline, f"processes {left} survive SIGKILL"
        time.sleep(0.02)


@contextlib.contextmanager
def preloaded_forkserver(modules: Sequence[str]) -> Iterator[None]:
    """Inside, ``"forkserver"`` workers of this process fork from a server that imported ``modules``.

    As in a fresh process that called ``multiprocessing.set_forkserver_preload(modules)``
    before its first DataLoader. In a pytest process that call alone does nothing when an earlier
    test already started the (one, process-wide) fork server without it: every worker then
    imports torch again when it unpickles a ShardDataset, about 3 s each on 2 busy cores (10
    epochs x 4 workers of docs/integrations.md's StatefulDataLoader block: 30 s instead of 5).
    So the running server is stopped first; on exit the one started inside is stopped and the
    preload list restored, and the next user starts a server as before. Workers already started
    keep running (a fork server does not own its children). ``ForkServer._stop`` is CPython's
    own hook for its tests; the server exits as soon as its alive pipe closes.
    """
    server: Any = multiprocessing.forkserver._forkserver  # the process-wide one (private API)
    before = list(server._preload_modules)
    server._stop()
    multiprocessing.set_forkserver_preload(list(modules))
    try:
        yield
    finally:
        server._stop()
        multiprocessing.set_forkserver_preload(before)
