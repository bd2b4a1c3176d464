"""Lifeline: a DataLoader worker exits as soon as the process that started it dies.

torch's workers watch their parent with ``os.getppid()`` every 5 seconds. That
parent is the training process under ``fork`` and ``spawn``, but under
``forkserver`` (what torchrun users are told to use) it is the fork server, which
outlives the trainer: a SIGKILLed or ``os._exit``-ed trainer then left its
workers, the fork server and their semaphores in ``/dev/shm`` behind for good
(every worker holds the fork server's "alive" pipe and the resource tracker's
pipe open, so neither of those ever sees its end either).

Here each worker, when its iteration starts, watches the process that created
it (``multiprocessing.parent_process()``: the process that called
``iter(dataloader)``, whatever the start method) through a pidfd: a descriptor
that becomes readable when that process has exited. A daemon thread waits on it
in ``poll`` (no timeout, no CPU) and calls ``os._exit`` then. Once the workers
are gone, the fork server and the resource tracker read the end of their pipes
and exit, and the tracker unlinks the queues' semaphores; nothing else of a
worker outlives it (its batch ring is a memfd, freed with its last holder).

A pid can be reused once its process is gone, so before trusting the pidfd the
watched process's start time is compared with this one's: the trainer started
before its worker, a stranger that took its pid after it died did not.

Without pidfds (not Linux, or a kernel before 5.3) the worker waits instead on
``parent_process().sentinel``, the pipe multiprocessing keeps to each child. That
is exact under ``spawn`` and ``forkserver``; under ``fork``, processes the trainer
forks later hold that pipe too, so a worker may wait for them (torch's own
``getppid`` check still applies there).
"""

from __future__ import annotations

import multiprocessing
import os
import select
import threading

__all__ = ["EXIT_CODE", "watch_trainer"]

EXIT_CODE = 70  # what a worker whose trainer died exits with (nobody but init reads it)

_watching: int | None = None  # the pid of the process whose watcher runs (a fork re-arms it)
_lock = threading.Lock()


def watch_trainer() -> None:
    """Make this process exit when the process that started it exits.

    Call it in a DataLoader worker (it does nothing in a process that
    multiprocessing did not start). The first call per process starts the
    watching thread; later calls return at once. If the trainer is already
    gone, this process exits now.
    """
    global _watching
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return
    with _lock:
        if _watching == os.getpid():
            return
        _watching = os.getpid()
    handle = _trainer_handle(parent.pid, parent.sentinel)
    if handle is None:
        os._exit(EXIT_CODE)
    threading.Thread(
        target=_exit_when_readable, args=(handle,), name="shardprep-lifeline", daemon=True
    ).start()


def _trainer_handle(pid: int, sentinel: int) -> int | None:
    """A descriptor that becomes readable when process ``pid`` exits; None if it already has."""
    if not hasattr(os, "pidfd_open"):
        return sentinel
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except OSError:  # no pidfds here (ENOSYS, or a seccomp filter's EPERM)
        return sentinel
    if not started_before(pid, os.getpid()):  # a stranger holds the dead trainer's pid
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


def _exit_when_readable(fd: int) -> None:
    waiter = select.poll()
    waiter.register(fd, select.POLLIN)
    while not waiter.poll():  # blocks; an empty list only after a signal
        pass
    os._exit(EXIT_CODE)
