"""Lifeline: a worker process exits as soon as the process that started it dies.

Shared by the builder's worker pools (:mod:`shardprep.workers`: scan workers, shard writers
and the ``--map`` functions they run) and the loader's DataLoader workers
(``loader.torch.lifeline``). A process killed by its pid alone (SIGKILL, SIGTERM, the
out-of-memory killer, a scheduler) does not take its ``multiprocessing`` children with it:
they are re-parented to PID 1 and run on (a builder's writers went on writing their shards
for minutes into OUT, where a ``--resume`` started at once collided with them).

Here each worker watches the process that created it (``multiprocessing.parent_process()``:
whatever the start method) through a pidfd: a descriptor that becomes readable when that
process has exited. A daemon thread waits on it in ``poll`` (no timeout, no CPU) and calls
``os._exit`` then.

A pid can be reused once its process is gone, so before trusting the pidfd the watched
process's start time is compared with this one's: the parent started before its worker, a
stranger that took its pid after it died did not. A parent already gone when the watch
starts (the race a ``prctl(PR_SET_PDEATHSIG)`` would leave open) is seen the same way: no
pid, a zombie's pidfd that is readable at once, or a younger stranger; the worker exits then.

Without pidfds (not Linux, or a kernel before 5.3) the worker waits instead on
``parent_process().sentinel``, the pipe multiprocessing keeps to each child. That is exact
under ``spawn`` and ``forkserver``; under ``fork``, processes the parent forks later hold
that pipe too, so a worker may wait for them.

Stdlib only: the loader imports this module without the builder.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import threading

__all__ = ["EXIT_CODE", "started_before", "watch_parent"]

EXIT_CODE = 70  # what a worker whose parent died exits with (nobody but init reads it)

_watching: int | None = None  # the pid of the process whose watcher runs (a fork re-arms it)
_lock = threading.Lock()


def watch_parent(exit_code: int = EXIT_CODE) -> None:
    """Make this process exit (``os._exit(exit_code)``) when the process that started it exits.

    Call it first thing in a worker (it does nothing in a process that multiprocessing did
    not start). The first call per process starts the watching thread; later calls return
    at once. If the parent is already gone, this process exits now.
    """
    global _watching
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return
    with _lock:
        if _watching == os.getpid():
            return
        _watching = os.getpid()
    handle = _parent_handle(parent.pid, parent.sentinel)
    if handle is None:
        os._exit(exit_code)
    threading.Thread(
        target=_exit_when_readable,
        args=(handle, exit_code),
        name="shardprep-lifeline",
        daemon=True,
    ).start()


def _parent_handle(pid: int, sentinel: int) -> int | None:
    """A descriptor that becomes readable when process ``pid`` exits; None if it already has."""
    if not hasattr(os, "pidfd_open"):
        return sentinel
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except OSError:  # no pidfds here (ENOSYS, or a seccomp filter's EPERM)
        return sentinel
    if not started_before(pid, os.getpid()):  # a stranger holds the dead parent's pid
        os.close(fd)
        return None
    return fd


def started_before(first: int, second: int) -> bool:
    """Whether process ``first`` started no later than ``second`` (True if /proc cannot say)."""
    try:
        return _start_ticks(first) <= _start_ticks(second)
    except (OSError, ValueError, IndexError):
        return True


def _start_ticks(pid: int) -> int:
    """When process ``pid`` started, in clock ticks since boot (/proc/PID/stat, field 22)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    # After the command name (which may hold spaces and parentheses): state, then field 4 on.
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def _exit_when_readable(fd: int, exit_code: int) -> None:
    waiter = select.poll()
    waiter.register(fd, select.POLLIN)
    while not waiter.poll():  # blocks; an empty list only after a signal
        pass
    os._exit(exit_code)
