"""Worker processes that Ctrl-C stops promptly and cleanly.

A terminal's Ctrl-C sends SIGINT to every process of the foreground group.
If a ``ProcessPoolExecutor`` worker takes it while it writes a result to the
pool's pipe, the half-written message leaves the pool's reader thread waiting
forever, and ``shutdown(wait=True)`` with it; if the main thread takes it as a
KeyboardInterrupt inside ``submit`` (between forking a worker and recording
it), that worker is never told to exit and outlives the build. So here:

- workers ignore SIGINT (set first thing in each worker; until then they run
  the handler below, which only sets a flag in their own copy);
- while the pool lives, the main thread's SIGINT handler only records the
  Ctrl-C, and the caller polls for it (:meth:`WorkerPool.interrupted`) between
  two well-defined steps, never inside the pool's machinery. (Blocking the
  signal would not do: threads started by libraries, such as OpenBLAS's,
  would still take it for the main thread.)
- every worker exits as soon as the build's process dies, however it dies (SIGKILL or
  SIGTERM to its pid alone, the out-of-memory killer): a process killed by pid does not
  take its pool with it, and its writers went on writing into OUT
  (:func:`shardprep.format.lifeline.watch_parent`, set first thing in each worker);
- on any exception the caller's ``stop`` callback runs (it tells running
  tasks to give up at their next checkpoint), pending tasks are cancelled and
  the pool is shut down and joined; then the previous handler is restored and
  a Ctrl-C that was not polled is raised as KeyboardInterrupt.

Only the main thread with Python's default SIGINT handler does this. Another
thread blocks SIGINT for itself while it starts workers (they inherit the
mask) and leaves Ctrl-C to the main thread; a main thread with its own
handler keeps it. Either way the workers ignore SIGINT.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager
from multiprocessing.context import BaseContext
from typing import Any, TypeVar

from shardprep.format.lifeline import watch_parent
from shardprep.format.sigint import deferred

__all__ = ["WorkerPool", "mp_context", "worker_pool"]

_SIGINT = {signal.SIGINT}
T = TypeVar("T")


class WorkerPool:
    """A ``ProcessPoolExecutor`` (``.executor``) plus Ctrl-C polling; made by :func:`worker_pool`."""

    def __init__(self, executor: ProcessPoolExecutor, ctrl_c: threading.Event | None) -> None:
        self.executor = executor
        self._ctrl_c = ctrl_c

    def interrupted(self) -> bool:
        """True (once per Ctrl-C) if Ctrl-C was pressed since the last call."""
        if self._ctrl_c is None or not self._ctrl_c.is_set():
            return False
        self._ctrl_c.clear()
        return True

    def wait(self, futures: Iterable[Future[T]], timeout: float = 0.25) -> set[Future[T]]:
        """The futures done within ``timeout`` s (at least one, or none on timeout).

        Raises:
            KeyboardInterrupt: Ctrl-C was pressed (noticed here, between two waits).
        """
        done, _ = wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
        if self.interrupted():
            raise KeyboardInterrupt
        return done


def mp_context(network: bool = False) -> BaseContext:
    """The multiprocessing context of the pools: fork where available, else spawn.

    ``network=True`` (workers that open network connections, e.g. read URLs through
    fsspec) always spawns: a process forked while another of its threads holds a lock
    (an fsspec event loop, a DNS lookup in an executor thread) can inherit that lock held
    and hang on its first request.
    """
    method = (
        "fork" if "fork" in multiprocessing.get_all_start_methods() and not network else "spawn"
    )
    return multiprocessing.get_context(method)


def _start_worker(initializer: Callable[..., None] | None, initargs: tuple[Any, ...]) -> None:
    watch_parent()  # first: a build killed by pid must not leave its workers running
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGINT)
    if initializer is not None:
        initializer(*initargs)


@contextmanager
def worker_pool(
    workers: int,
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
    stop: Callable[[], None] | None = None,
    context: BaseContext | None = None,
    kill_on: tuple[type[BaseException], ...] = (),
) -> Iterator[WorkerPool]:
    """A pool of ``workers`` forked processes (spawned where fork is missing, or as ``context``
    starts them).

    On an exception inside the block (a task's error, KeyboardInterrupt),
    ``stop()`` is called, queued tasks are cancelled and the block exits only
    when every worker has finished; the exception then propagates. An
    exception of a type in ``kill_on`` (a stall: a worker may be stuck in a
    read that never returns) kills the workers first instead of waiting for them.
    """
    main = threading.current_thread() is threading.main_thread()
    # The main thread records a Ctrl-C (polled; one during the final shutdown is raised after it).
    # Another thread blocks SIGINT for itself; the workers it forks inherit the mask.
    with deferred() as ctrl_c:
        previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, set() if main else _SIGINT)
        try:
            executor = ProcessPoolExecutor(
                workers,
                mp_context=context or mp_context(),
                initializer=_start_worker,
                initargs=(initializer, initargs),
            )
            try:
                yield WorkerPool(executor, ctrl_c)
            except BaseException as err:
                if stop is not None:
                    stop()
                if isinstance(err, kill_on):
                    _kill_workers(executor)
                executor.shutdown(wait=True, cancel_futures=True)
                raise
            executor.shutdown(wait=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)


def _kill_workers(executor: ProcessPoolExecutor) -> None:
    """SIGKILL every worker process of ``executor`` (Python 3.14 has ``kill_workers``)."""
    kill = getattr(executor, "kill_workers", None)
    if kill is not None:
        kill()
        return
    for process in list(getattr(executor, "_processes", {}).values()):
        process.kill()
