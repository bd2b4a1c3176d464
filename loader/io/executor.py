"""Executor: the threads every read of a worker is performed on, besides the worker's own.

One mechanism for all of a reader's concurrency (remote ranged GETs fetched ahead, a local
output's next window read ahead, and one read or one batch's reads shared by two threads):

- ``submit(fn)`` queues a job; the executor's threads take jobs by priority, then in
  submission order.
- ``result(job)`` is the caller asking for a job's value: a job no thread has taken yet is
  *withdrawn* and run by the caller itself (it never waits for work that has not started);
  otherwise it waits, at most ``timeout`` seconds, and re-raises the job's error as it is.
- ``together(work)`` runs ``work`` on the caller and, if a thread is free to take it at once,
  on that thread too (``work`` shares its items between the two through an iterator both
  draw from); it returns once both are done, or withdraws the offer when the caller finished
  first, so it never holds the caller up.

A job is taken by exactly one of a thread and the caller (a lock on its state), so each runs
once. A job drops its function after it ran or was withdrawn: the function's closure may hold
views of buffers that a pool reuses only once no view of them is left.

Threads start at the first job, in the process that submits it (never in a process that forks
DataLoader workers before reading: it submits nothing), are daemons, and stop in ``close()``
(each after its current job, joined within ``JOIN_TIMEOUT_S``). A process forked while they
run has none: its first job starts its own. With ``threads=0`` nothing runs ahead: every job is
run by the caller when it asks for it.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Executor", "Job"]

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 5.0  # close() waits this long for each thread's current job
QUEUED, TAKEN, WITHDRAWN = 0, 1, 2


class Job:
    """One unit of work: run once, by a thread or by the caller (never both)."""

    __slots__ = ("done", "error", "fn", "lock", "state", "value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn: Callable[[], Any] | None = fn
        self.state = QUEUED
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.lock = threading.Lock()

    def claim(self, state: int = TAKEN) -> bool:
        """Move a queued job to ``state`` (``TAKEN`` to run it, ``WITHDRAWN`` to drop it);
        False if someone else already did."""
        with self.lock:
            if self.state != QUEUED:
                return False
            self.state = state
        if state == WITHDRAWN:
            self.fn = None
        return True

    def run(self) -> None:
        fn, self.fn = self.fn, None
        try:
            if fn is not None:
                self.value = fn()
        except BaseException as err:  # handed to whoever asks for the result, who raises it
            self.error = err
        finally:
            self.done.set()


class Executor:
    """Up to ``threads`` daemon threads named ``name-<i>`` running submitted jobs."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 0:
            raise ValueError(f"threads must be >= 0, not {threads}")
        self.size, self.name = threads, name
        self._queue: queue.PriorityQueue[tuple[int, int, Job | None]] = queue.PriorityQueue()
        self._sequence = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._pid = -1  # the process the threads run in
        self._closed = False
        # (still there when a generator is closed at interpreter exit, after the modules'
        # globals are gone: the daemon threads then end with the process)
        self._finalizing = sys.is_finalizing
        self._getpid = os.getpid

    # --- jobs -------------------------------------------------------------------------

    def submit(self, fn: Callable[[], Any], priority: int = 1) -> Job:
        """Queue ``fn`` (lower ``priority`` first); a thread runs it unless the caller asks
        for its result first."""
        if self._closed:
            raise RuntimeError(f"{self.name}: the executor is closed")
        job = Job(fn)
        if self.size:
            self._start()
            with self._lock:
                self._sequence += 1
                self._queue.put((priority, self._sequence, job))
        return job

    def result(self, job: Job, timeout: float, hung: Callable[[], BaseException]) -> Any:
        """``job``'s value: run here if no thread took it, else awaited for ``timeout``
        seconds at most (then ``hung()`` is raised); the job's error is raised as it is."""
        if job.claim():
            job.run()
        elif not job.done.wait(timeout):
            raise hung()
        if job.error is not None:
            raise job.error
        return job.value

    def together(
        self, work: Callable[[], bool], timeout: float, hung: Callable[[], BaseException]
    ) -> bool:
        """``work()`` here and, if a thread takes it before this call's own ``work()`` ends,
        there too; whether both returned true. Raises what the other ``work`` raised."""
        job = self.submit(work, priority=0) if self.size else None
        try:
            mine = work()
        finally:
            theirs: Any = None
            if job is not None and not job.claim(WITHDRAWN):  # taken: wait for it to end
                if not job.done.wait(timeout):
                    raise hung()
                if job.error is not None:
                    raise job.error
                theirs = job.value
        return mine and theirs is not False

    # --- threads ----------------------------------------------------------------------

    def _start(self) -> None:
        """Start the threads in this process if they are not running here (first job, or the
        first job of a process forked from one where they ran). The caller starts one, which
        starts the others before taking jobs: the caller is not held up starting them one by
        one (each start waits for the new thread to run, behind the GIL of the busy ones)."""
        pid = self._getpid()
        if self._pid == pid:
            return
        with self._lock:
            if self._pid == pid:
                return
            self._queue = queue.PriorityQueue()  # (a fork's copy may hold the parent's jobs)
            self._threads = []
            self._pid = pid
            self._spawn(0)  # raises (and the submit with it) when not even one thread starts

    def _spawn(self, i: int) -> None:
        thread = threading.Thread(target=self._work, args=(i,), name=f"{self.name}-{i}")
        thread.daemon = True
        thread.start()
        self._threads.append(thread)

    def _work(self, i: int) -> None:
        if i == 0:  # the starter: the other threads first, then jobs like them
            for k in range(1, self.size):
                with self._lock:
                    if self._closed:
                        break
                    try:
                        self._spawn(k)
                    except RuntimeError as err:  # "can't start new thread": fewer, slower
                        log.warning("%s: %d of %d threads (%s)", self.name, k, self.size, err)
                        break
        self._serve()

    def _serve(self) -> None:
        jobs = self._queue
        while True:
            job = jobs.get()[2]
            if job is None:
                return
            if job.claim():
                job.run()
            del job  # (nothing of a finished job stays referenced while the next is awaited)

    def close(self) -> None:
        """Drop queued jobs and stop every thread (each after its current job, bounded);
        idempotent. Jobs not yet run are withdrawn: asking for one runs it on the caller."""
        if self._closed:
            return
        self._closed = True
        if self._finalizing() or self._pid != self._getpid():
            return  # nothing to wake or wait for here
        with self._lock:  # (no thread is started once this is set: see _work)
            threads, self._threads = self._threads, []
        for i in range(self.size):  # one for each thread there is or may still be started
            self._queue.put((-1, i, None))  # ahead of every job
        for thread in threads:
            thread.join(JOIN_TIMEOUT_S)
            if thread.is_alive():
                log.warning("%s still busy %.0f s after close", thread.name, JOIN_TIMEOUT_S)
