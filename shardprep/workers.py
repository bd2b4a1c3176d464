"""Worker processes that Ctrl-C stops promptly and cleanly.

A terminal's Ctrl-C sends SIGINT to every process of the foreground group.
If a ``ProcessPoolExecutor`` worker takes it while it writes a result to the
pool's pipe, the half-written message leaves the pool's reader thread waiting
forever, and ``shutdown(wait=True)`` with it. So here:

- workers ignore SIGINT (it is blocked from before they are forked until they
  ignore it, so none is lost into a half-started worker);
- the calling thread keeps SIGINT blocked while the pool lives and polls for
  it (:meth:`WorkerPool.interrupted`), so a Ctrl-C is noticed only between
  two well-defined steps of the caller, never inside the pool's machinery;
- on any exception the caller's ``stop`` callback runs (it tells running
  tasks to give up at their next checkpoint), pending tasks are cancelled and
  the pool is shut down and joined.

Only the main thread with Python's default SIGINT handler polls; another
thread blocks SIGINT for itself (the main thread still gets it), and a main
thread with its own handler keeps it: there only the workers ignore SIGINT.
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

__all__ = ["WorkerPool", "mp_context", "worker_pool"]

_SIGINT = {signal.SIGINT}
T = TypeVar("T")


class WorkerPool:
    """A ``ProcessPoolExecutor`` (``.executor``) plus Ctrl-C polling; made by :func:`worker_pool`."""

    def __init__(self, executor: ProcessPoolExecutor, polls_sigint: bool) -> None:
        self.executor = executor
        self._polls_sigint = polls_sigint

    def interrupted(self) -> bool:
        """True (once per Ctrl-C) if SIGINT arrived since the last call; consumes it."""
        return self._polls_sigint and signal.sigtimedwait(_SIGINT, 0) is not None

    def wait(self, futures: Iterable[Future[T]], timeout: float = 0.25) -> set[Future[T]]:
        """The futures done within ``timeout`` s (at least one, or none on timeout).

        Raises:
            KeyboardInterrupt: Ctrl-C was pressed (noticed here, between two waits).
        """
        done, _ = wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
        if self.interrupted():
            raise KeyboardInterrupt
        return done


def mp_context() -> BaseContext:
    """The multiprocessing context of the pools: fork where available, else spawn."""
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method)


def _start_worker(initializer: Callable[..., None] | None, initargs: tuple[Any, ...]) -> None:
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
) -> Iterator[WorkerPool]:
    """A pool of ``workers`` forked processes (spawned where fork is missing).

    On an exception inside the block (a task's error, KeyboardInterrupt),
    ``stop()`` is called, queued tasks are cancelled and the block exits only
    when every worker has finished; the exception then propagates.
    """
    main = threading.current_thread() is threading.main_thread()
    polls = main and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # Blocked in this thread before the executor forks its workers and starts its
    # thread (at the first submit), which inherit the mask.
    blocked = _SIGINT if polls or not main else set()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        executor = ProcessPoolExecutor(
            workers,
            mp_context=mp_context(),
            initializer=_start_worker,
            initargs=(initializer, initargs),
        )
        try:
            yield WorkerPool(executor, polls)
        except BaseException:
            if stop is not None:
                stop()
            executor.shutdown(wait=True, cancel_futures=True)
            raise
        executor.shutdown(wait=True)
    finally:
        # A Ctrl-C still pending (one that came during the shutdown) is raised here.
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
