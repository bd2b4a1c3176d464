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
(each after its current job, all joined within ``JOIN_TIMEOUT_S`` in total). A job that waits
on something it can abandon (a remote request in flight) registers how to with
:func:`cancel_on_close` for the length of that wait: ``close()`` calls it before it joins, so
leaving an epoch midway does not wait for the reads in flight to finish. A process forked while they
run has none: its first job starts its own. With ``threads=0`` nothing runs ahead: every job is
run by the caller when it asks for it.

An interrupt (Ctrl-C, or whatever a signal handler raises) can land anywhere in the caller,
so the caller's side holds only what it cannot leave locked: C-level locks in ``with`` and a
``queue.SimpleQueue``. Never ``queue.Queue``, ``threading.Event`` or ``Condition``: an interrupt
can cut their Python-level ``__exit__`` before it releases their lock, and the next
``close()`` then waited on it forever (tests/unit/test_executor.py::
test_an_interrupt_in_the_callers_queue_operations_leaves_close_bounded).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from shardprep.format.threads import start_thread

__all__ = ["Cancelled", "Executor", "Flag", "Job", "cancel_on_close", "result_on"]

log = logging.getLogger(__name__)
T = TypeVar("T")

JOIN_TIMEOUT_S = 5.0  # close() waits this long in all for its threads' current jobs
POLL_S = 1.0  # an idle thread looks at the closed event this often
QUEUED, TAKEN, WITHDRAWN = 0, 1, 2
_running = threading.local()  # .cancels: the _Cancels of the executor whose thread this is


class Cancelled(Exception):  # noqa: N818 (what happened, as concurrent.futures names it)
    """A wait a job gave up because its executor was closed (the job's result is wanted by
    no one: the reader that submitted it has let go)."""


class Flag:
    """Set once, never cleared, waited for with a timeout: ``threading.Event`` made of C-level
    locks only, so that an interrupt on any thread using it cannot leave it locked."""

    __slots__ = ("_gate", "_guard", "_set")

    def __init__(self) -> None:
        self._set = False
        self._guard = threading.Lock()
        self._gate = threading.Lock()  # held until set: a waiter acquires it, then gives it back
        self._gate.acquire()

    def set(self) -> None:
        with self._guard:
            if self._set:
                return
            self._set = True
            self._gate.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Whether the flag is set, waiting ``timeout`` seconds at most for it."""
        if self._set:
            return True
        if self._gate.acquire(timeout=timeout):
            self._gate.release()  # (left held by an interrupt here: later waits see _set)
            return True
        return self._set


class _Cancels:
    """How to abandon the waits an executor's jobs are in now; ``fire`` (at close) calls each,
    and any registered after it, at once. C-level lock only (see the module docstring)."""

    __slots__ = ("_fired", "_hooks", "_lock", "_next")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hooks: dict[int, Callable[[], object]] = {}
        self._next = 0
        self._fired = False

    def add(self, hook: Callable[[], object]) -> int | None:
        """Register ``hook``; its token, or None when already fired (the caller calls it)."""
        with self._lock:
            if self._fired:
                return None
            self._next += 1
            self._hooks[self._next] = hook
            return self._next

    def discard(self, token: int) -> None:
        with self._lock:
            self._hooks.pop(token, None)

    def fire(self) -> None:
        with self._lock:
            self._fired = True
            hooks, self._hooks = list(self._hooks.values()), {}
        for hook in hooks:
            hook()


class cancel_on_close:  # noqa: N801 (a context manager used as a function)
    """``with cancel_on_close(hook) as scope:`` around a wait that ``hook()`` abandons (say, a
    request future's ``cancel``): if the executor running this job is closed meanwhile,
    ``hook`` is called once (at once if it was closed before) and ``scope.cancelled`` is true.
    Outside an executor's thread (the caller running a job itself) it does nothing."""

    __slots__ = ("_cancels", "_hook", "_token", "cancelled")

    def __init__(self, hook: Callable[[], object]) -> None:
        self._hook = hook
        self._cancels: _Cancels | None = getattr(_running, "cancels", None)
        self._token: int | None = None
        self.cancelled = False

    def _fire(self) -> None:
        self.cancelled = True
        self._hook()

    def __enter__(self) -> cancel_on_close:
        if self._cancels is not None:
            self._token = self._cancels.add(self._fire)
            if self._token is None:
                self._fire()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None and self._cancels is not None:
            self._cancels.discard(self._token)


def result_on(
    loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, T], timeout: float
) -> T:
    """The result of ``coroutine`` run on ``loop`` (an event loop on another thread: a client's
    requests), waited for at most ``timeout`` seconds (then it is cancelled and
    ``TimeoutError`` raised). On an executor's thread the wait is abandoned when the executor
    closes (``cancel_on_close``): the coroutine is cancelled and ``Cancelled`` raised. Its
    outcome is read on the loop even when no one waits for it any more (a request that failed
    just as it was cancelled), which asyncio would otherwise log as never retrieved."""

    async def read_outcome() -> T:
        task = asyncio.current_task()
        assert task is not None  # (a coroutine run by run_coroutine_threadsafe is a task)
        task.add_done_callback(_read_outcome)
        return await coroutine

    future = asyncio.run_coroutine_threadsafe(read_outcome(), loop)
    with cancel_on_close(future.cancel) as scope:
        try:
            return future.result(timeout)
        except concurrent.futures.CancelledError:
            if scope.cancelled:
                raise Cancelled("the request was dropped: its reader let go of it") from None
            raise
        except TimeoutError:
            future.cancel()  # the loop did not answer in time: nothing is left waiting
            raise


def _read_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


class _Jobs:
    """The executor's queue: (priority, sequence, job) on a heap under a C-level lock, and one
    token per entry in a ``SimpleQueue`` to wake a thread. A job left on the heap without its
    token (an interrupt between the two) is run by the caller when it asks for it."""

    __slots__ = ("_heap", "_lock", "_sequence", "_wake")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Job | None]] = []
        self._lock = threading.Lock()
        self._sequence = 0
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()

    def put(self, priority: int, job: Job | None) -> None:
        """Queue ``job`` (None: a stop, for one thread)."""
        with self._lock:
            self._sequence += 1
            heapq.heappush(self._heap, (priority, self._sequence, job))
        self._wake.put(None)

    def get(self, timeout: float) -> tuple[bool, Job | None]:
        """(True, the first entry's job) once there is one; (False, None) after ``timeout``."""
        try:
            self._wake.get(timeout=timeout)
        except queue.Empty:
            return False, None
        with self._lock:
            return True, heapq.heappop(self._heap)[2]


class Job:
    """One unit of work: run once, by a thread or by the caller (never both)."""

    __slots__ = ("done", "error", "fn", "lock", "runner", "state", "value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn: Callable[[], Any] | None = fn
        self.state = QUEUED
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = Flag()
        self.lock = threading.Lock()
        self.runner = ""  # the name of the thread that ran it

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
        self.runner = threading.current_thread().name
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
        self._queue = _Jobs()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._pid = -1  # the process the threads run in
        # set first thing by close() (one store: an interrupt cannot split it), and by the
        # collector if the executor is dropped unclosed; the threads see it within POLL_S
        # even if no sentinel reaches them (an interrupt inside close)
        self._closed = Flag()
        self._cancels = _Cancels()  # the waits of the jobs running now, abandoned at close
        self._stop: weakref.finalize[Any, Executor] | None = None
        # (still there when a generator is closed at interpreter exit, after the modules'
        # globals are gone: the daemon threads then end with the process)
        self._finalizing = sys.is_finalizing
        self._getpid = os.getpid

    # --- jobs -------------------------------------------------------------------------

    def submit(self, fn: Callable[[], Any], priority: int = 1) -> Job:
        """Queue ``fn`` (lower ``priority`` first); a thread runs it unless the caller asks
        for its result first."""
        if self._closed.is_set():
            raise RuntimeError(f"{self.name}: the executor is closed")
        job = Job(fn)
        if self.size:
            self._start()
            self._queue.put(priority, job)
        return job

    def result(
        self, job: Job, timeout: float, hung: Callable[[], BaseException], what: str = "a job"
    ) -> Any:
        """``job``'s value: run here if no thread took it, else awaited for ``timeout``
        seconds at most (then ``hung()`` is raised); the job's error is raised as it is, except
        one that is not an ``Exception`` raised on a thread (``SystemExit``, an interrupt
        delivered there): the caller gets a ``RuntimeError`` naming the thread and ``what`` the
        job was doing, not the thread's exit."""
        if job.claim():
            job.run()
        elif not job.done.wait(timeout):
            raise hung()
        return _outcome(job, what)

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
                theirs = _outcome(job, "its share of a read")
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
        if self._pid != -1:  # a forked child: a thread of the parent's may have held the lock at
            self._lock = threading.Lock()  # the fork, and no thread here would release it
        with self._lock:
            if self._pid == pid:
                return
            self._queue = _Jobs()  # (a fork's copy may hold the parent's jobs)
            self._threads = []
            self._pid = pid
            # dropped unclosed (an interrupt before close ran): the collector stops them
            self._cancels = _Cancels()  # (a fork's copy may hold the parent's waits)
            self._stop = weakref.finalize(
                self, _stop, self._queue, self._closed, self._cancels, self.size
            )
            self._spawn(0)  # raises (and the submit with it) when not even one thread starts

    def _spawn(self, i: int) -> None:
        """Start thread ``i``; it holds the queue and the closed event, not the executor (so
        that an executor dropped unclosed is collected, and its finalizer stops them)."""
        more = _Starter(self) if i == 0 and self.size > 1 else None
        thread = threading.Thread(
            target=_work,
            args=(self._queue, self._closed, self._cancels, more),
            name=f"{self.name}-{i}",
        )
        thread.daemon = True
        self._threads.append(thread)  # first: close() joins it even if its start is cut
        start_thread(thread)

    def _spawn_others(self) -> None:
        for k in range(1, self.size):
            with self._lock:
                if self._closed.is_set():
                    return
                try:
                    self._spawn(k)
                except RuntimeError as err:  # "can't start new thread": fewer, slower
                    log.warning("%s: %d of %d threads (%s)", self.name, k, self.size, err)
                    return

    def close(self) -> None:
        """Drop queued jobs, abandon the waits of the running ones (``cancel_on_close``) and
        stop every thread (each after its current job, all within ``JOIN_TIMEOUT_S``);
        idempotent. Jobs not yet run are withdrawn: asking for one runs it on the caller."""
        self._closed.set()  # first: whatever interrupts the rest, the threads stop
        if self._finalizing() or self._pid != self._getpid():
            return  # nothing to wake or wait for here
        with self._lock:  # (no thread is started once closed is set: see _spawn_others)
            threads = [t for t in self._threads if t.is_alive()]
        _stop(self._queue, self._closed, self._cancels, self.size)
        end = time.monotonic() + JOIN_TIMEOUT_S
        for thread in threads:
            thread.join(max(0.0, end - time.monotonic()))
        busy = [t.name for t in threads if t.is_alive()]
        if busy:
            log.warning("%s still busy %.0f s after close", ", ".join(busy), JOIN_TIMEOUT_S)


class _Starter:
    """Thread 0's errand of starting the others, holding the executor only until it is done."""

    def __init__(self, executor: Executor) -> None:
        self.executor: Executor | None = executor

    def run(self) -> None:
        executor, self.executor = self.executor, None
        if executor is not None:
            executor._spawn_others()


def _stop(jobs: _Jobs, closed: Flag, cancels: _Cancels, size: int) -> None:
    """Tell the threads to stop: the closed flag, a stop each ahead of every job, and the
    running jobs' waits abandoned."""
    closed.set()
    for _ in range(size):
        jobs.put(-1, None)
    cancels.fire()


def _work(jobs: _Jobs, closed: Flag, cancels: _Cancels, starter: _Starter | None) -> None:
    _running.cancels = cancels
    if starter is not None:  # thread 0: the other threads first, then jobs like them
        starter.run()
        del starter
    while not closed.is_set():
        got, job = jobs.get(POLL_S)
        if not got:
            continue
        if job is None:
            return
        if job.claim():
            job.run()
        del job  # (nothing of a finished job stays referenced while the next is awaited)


def _outcome(job: Job, what: str) -> Any:
    """A finished job's value, or its error raised (see ``Executor.result``)."""
    error = job.error
    if error is None:
        return job.value
    if isinstance(error, Exception) or job.runner == threading.current_thread().name:
        raise error
    raise RuntimeError(
        f"thread {job.runner} stopped with {error!r} while running {what}; "
        "see the error logged before this one"
    ) from error
