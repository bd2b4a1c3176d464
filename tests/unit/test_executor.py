"""loader.io.executor.Executor: the one thread mechanism of a reader. A job no thread has taken
runs on the caller; a taken job's error is raised as it is (a thread's exit becomes a
RuntimeError naming the thread); a stuck job's wait is bounded; together() withdraws an offer
no thread took; the threads stop on close, even when close is cut short, and when the executor
is dropped unclosed; a process forked while they run starts its own at its first job."""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loader.io.executor import Executor, cancel_on_close
from tests.processes import run_bounded

ROOT = Path(__file__).resolve().parents[2]

NAME = "test-executor"
DEADLINE_S = 30.0


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(NAME + "-")]


def _until(condition: object, timeout: float = DEADLINE_S) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _hung() -> BaseException:
    return TimeoutError("stuck")


@pytest.fixture
def busy() -> Iterator[tuple[Executor, threading.Event]]:
    """An executor of one thread, held inside a first job until the event is set."""
    executor = Executor(1, NAME)
    release, holding = threading.Event(), threading.Event()

    def hold() -> str:
        holding.set()
        assert release.wait(DEADLINE_S)
        return "held"

    executor.submit(hold)
    assert holding.wait(DEADLINE_S)
    yield executor, release
    release.set()
    executor.close()
    assert _until(lambda: not _threads())


def test_a_job_no_thread_took_runs_on_the_caller(busy: tuple[Executor, threading.Event]) -> None:
    executor, release = busy
    ran_on: list[str] = []

    def job_fn() -> int:
        ran_on.append(threading.current_thread().name)
        return 7

    job = executor.submit(job_fn)
    assert executor.result(job, 1.0, _hung) == 7  # the thread is held: the caller ran it
    assert ran_on == [threading.current_thread().name]
    assert not release.is_set()


def test_a_taken_jobs_error_is_raised_as_it_is() -> None:
    executor = Executor(1, NAME)
    started = threading.Event()

    def fail() -> None:
        started.set()
        raise FileNotFoundError(2, "gone", "shard-00001.tar")

    try:
        job = executor.submit(fail)
        assert started.wait(DEADLINE_S)
        with pytest.raises(FileNotFoundError, match="shard-00001.tar"):
            executor.result(job, DEADLINE_S, _hung)
    finally:
        executor.close()
    assert not _threads()


def test_a_threads_exit_becomes_a_runtime_error_naming_it() -> None:
    executor = Executor(1, NAME)
    started = threading.Event()

    def leave() -> None:
        started.set()
        raise SystemExit(3)

    try:
        job = executor.submit(leave)
        assert started.wait(DEADLINE_S) and job.done.wait(DEADLINE_S)
        with pytest.raises(RuntimeError, match=rf"{NAME}-0 stopped with SystemExit\(3\).*shard 4"):
            executor.result(job, DEADLINE_S, _hung, "a read of shard 4")
    finally:
        executor.close()


def test_waiting_for_a_stuck_job_is_bounded(busy: tuple[Executor, threading.Event]) -> None:
    executor, _ = busy
    second = Executor(1, NAME + "-second")
    stuck = threading.Event()
    job = second.submit(lambda: stuck.wait(DEADLINE_S))
    assert _until(lambda: job.state != 0)  # taken by the thread
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="stuck"):
        second.result(job, 0.2, _hung)
    assert time.monotonic() - started < 5
    stuck.set()
    second.close()


def test_together_withdraws_the_offer_no_thread_took(
    busy: tuple[Executor, threading.Event],
) -> None:
    executor, release = busy
    done: list[str] = []
    claim = iter(range(20))

    def work() -> bool:
        for i in claim:
            done.append(f"{threading.current_thread().name}:{i}")
        return True

    assert executor.together(work, DEADLINE_S, _hung)
    me = threading.current_thread().name
    assert done == [f"{me}:{i}" for i in range(20)]  # all here, none waited for
    assert not release.is_set()


def test_together_shares_work_with_a_free_thread() -> None:
    executor = Executor(1, NAME)
    names: set[str] = set()
    both = threading.Barrier(2, timeout=DEADLINE_S)

    def work() -> bool:
        names.add(threading.current_thread().name)
        both.wait()  # returns only once the thread runs it too
        return True

    try:
        assert executor.together(work, DEADLINE_S, _hung)
    finally:
        executor.close()
    assert names == {threading.current_thread().name, f"{NAME}-0"}


def test_close_stops_every_thread() -> None:
    executor = Executor(4, NAME)
    jobs = [executor.submit(lambda i=i: i) for i in range(8)]  # type: ignore[misc]
    assert sorted(executor.result(j, DEADLINE_S, _hung) for j in jobs) == list(range(8))
    assert _until(lambda: len(_threads()) == 4)
    executor.close()
    assert _threads() == []
    with pytest.raises(RuntimeError, match="closed"):
        executor.submit(lambda: 0)


def test_threads_stop_when_close_is_cut_short() -> None:
    """An interrupt inside close() after its first store (the closed event) and before the
    sentinels: the threads still stop, within the poll interval."""
    executor = Executor(2, NAME)
    executor.result(executor.submit(lambda: 1), DEADLINE_S, _hung)
    assert _until(lambda: len(_threads()) == 2)
    executor._closed.set()  # what an interrupted close() leaves behind
    assert _until(lambda: not _threads(), timeout=10)


def test_threads_stop_when_the_executor_is_dropped_unclosed() -> None:
    executor = Executor(2, NAME)
    executor.result(executor.submit(lambda: 1), DEADLINE_S, _hung)
    assert _until(lambda: len(_threads()) == 2)
    del executor
    gc.collect()
    assert _until(lambda: not _threads(), timeout=10)


CHILD_FORK = """
import os, threading, traceback
from loader.io.executor import Executor, cancel_on_close

NAME = "test-executor"


def names():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(NAME + "-"))


def on_a_thread(executor):
    \"\"\"The name of the thread that ran a job awaited until a thread took it (not stolen).\"\"\"
    job = executor.submit(lambda: threading.current_thread().name)
    assert job.done.wait(30), "no thread ran the job"
    return executor.result(job, 30, lambda: TimeoutError("stuck"))


executor = Executor(2, NAME)
parent = on_a_thread(executor)
before = names()
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # the child: no thread of the parent's; its first job starts its own
    code = 1
    try:
        os.close(read)
        at_fork = names()
        ran_on = on_a_thread(executor)
        started = names()
        executor.close()
        os.write(write, repr((at_fork, ran_on, started, names())).encode())
        code = 0
    except BaseException:
        traceback.print_exc()  # (os._exit skips the interpreter's printing of it)
    finally:
        os._exit(code)
os.close(write)
got = b""
while chunk := os.read(read, 1 << 16):
    got += chunk
_, status = os.waitpid(pid, 0)
after = names()  # the parent's threads are untouched by the child's
executor.close()
print(repr((parent, before, eval(got), after, names(), os.waitstatus_to_exitcode(status))))
"""


def test_a_forked_child_starts_its_own_threads() -> None:
    """Fork after the threads started (in a fresh process, under a deadline): the child has
    none of them, its first job starts its own (named as the parent's), which run its jobs and
    stop on its close; the parent's keep running until the parent closes."""
    done = run_bounded([sys.executable, "-c", CHILD_FORK], timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    parent, before, child, after, closed, code = eval(done.stdout)
    both = [f"{NAME}-0", f"{NAME}-1"]
    assert parent in both
    assert before == both
    at_fork, ran_on, started, child_closed = child
    assert at_fork == []
    assert ran_on in both
    assert started == both
    assert child_closed == []
    assert after == both
    assert closed == []
    assert code == 0


# The child scripts' driver: cut_each runs ``work`` on a fresh executor once per moment, raising a
# KeyboardInterrupt at the n-th of ``events`` on the calling thread ("call": a function starts,
# "return": a call returns; where CPython runs signal handlers), until a run is not cut; close()
# must return within its bound after each. It prints the runs cut, the executor's threads left
# alive and any error that was not the KeyboardInterrupt.
CUT_EACH = """
import sys, threading, time
from loader.io.executor import JOIN_TIMEOUT_S, Executor
from tests.interrupts import interrupt_at

def hung():
    return TimeoutError("hung")

def cut_each(make, work, events, name):
    n, cut, other = 1, 0, []
    while True:
        ex = make(name)
        sys.settrace(interrupt_at(n, events))
        try:
            work(ex)
            done = True
        except KeyboardInterrupt:
            done, cut = False, cut + 1
        except BaseException as err:
            done = False
            other.append((n, repr(err)))
        finally:
            sys.settrace(None)
        began = time.monotonic()
        ex.close()
        took = time.monotonic() - began
        assert took < JOIN_TIMEOUT_S, f"close took {took:.1f} s after an interrupt at {n}"
        if done:
            break
        n += 1
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while time.monotonic() < deadline and any(
        t.name.startswith(name + "-") and t.is_alive() for t in threading.enumerate()
    ):
        time.sleep(0.05)  # polling interval only: the threads see the closed flag within POLL_S
    left = [t for t in threading.enumerate() if t.name.startswith(name + "-") and t.is_alive()]
    print("CUT", cut, "LEFT", len(left), "OTHER", other)
"""

CHILD_INTERRUPTS = (
    CUT_EACH
    + """
def started(name):
    ex = Executor(1, name)
    ex.result(ex.submit(lambda: 0), 5.0, hung)  # its thread runs: not part of what is cut
    return ex

def calls(ex):
    ex.result(ex.submit(lambda: 1), 5.0, hung)
    ex.together(lambda: True, 5.0, hung)

cut_each(started, calls, ("call",), "test-interrupt")
"""
)


def test_an_interrupt_in_the_callers_queue_operations_leaves_close_bounded() -> None:
    """A KeyboardInterrupt raised as each Python function starts (one run each: a moment where
    CPython runs signal handlers) in a submit, a result and a together() on the caller's
    thread, the library's code and the standard library's it calls: close() returns within
    its bound after each, and no thread is left. With
    ``queue.PriorityQueue`` and ``threading.Event`` on the caller's side, an interrupt at the
    start of their ``Condition.__exit__`` left its lock held, and close() then waited on it
    forever (1 run in about 25 of test_hunt_localahead.py::test_ctrl_c_at_random_moments)."""
    done = run_bounded([sys.executable, "-c", CHILD_INTERRUPTS], timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    words = done.stdout.strip().split(maxsplit=5)
    assert words[0] == "CUT" and int(words[1]) > 10, done.stdout
    assert words[2:] == ["LEFT", "0", "OTHER", "[]"], done.stdout


CHILD_START_INTERRUPTS = (
    CUT_EACH
    + """
def first_submit(ex):
    ex.result(ex.submit(lambda: 1), 5.0, hung)  # the first submit starts the threads

cut_each(lambda name: Executor(2, name), first_submit, ("call", "return"), "test-start")
"""
)


def test_an_interrupt_while_the_threads_start_is_the_interrupt() -> None:
    """A KeyboardInterrupt at each moment CPython may run a signal handler (a function starts,
    a call returns) during the first submit of an executor, which starts its threads: the
    caller gets the KeyboardInterrupt, never another error; close() stays bounded and no thread
    is left. Was: an interrupt inside ``Thread.start``'s wait, just after its ``Condition`` let
    go of its lock, became ``RuntimeError('release unlocked lock')`` (1 run in the CI sim of
    test_hunt_scatter.py::test_ctrl_c_at_random_moments)."""
    done = run_bounded([sys.executable, "-c", CHILD_START_INTERRUPTS], timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    words = done.stdout.strip().split(maxsplit=5)
    assert words[0] == "CUT" and int(words[1]) > 20, done.stdout
    assert words[2:] == ["LEFT", "0", "OTHER", "[]"], done.stdout


def test_close_abandons_the_wait_of_a_running_job() -> None:
    """A job waiting inside ``cancel_on_close`` (a request in flight) has its wait abandoned by
    close(), which then returns with the thread gone, not after the wait's own end."""
    executor = Executor(2, NAME)
    given_up, waiting = threading.Event(), threading.Event()

    def request() -> bool:
        with cancel_on_close(given_up.set) as scope:
            waiting.set()
            assert given_up.wait(DEADLINE_S)  # the request's answer: never, here
        return scope.cancelled

    job = executor.submit(request)
    assert waiting.wait(DEADLINE_S)
    executor.close()
    assert given_up.is_set() and job.done.is_set() and job.value is True
    assert not _threads()


def test_a_wait_begun_after_close_is_abandoned_at_once_and_one_that_ended_is_not() -> None:
    executor = Executor(1, NAME)
    calls: list[str] = []
    ended, closed = threading.Event(), threading.Event()

    def job() -> tuple[bool, bool]:
        with cancel_on_close(lambda: calls.append("first")) as first:
            pass  # a wait that ended before the close: its hook is no longer registered
        ended.set()
        assert closed.wait(DEADLINE_S)
        with cancel_on_close(lambda: calls.append("second")) as second:
            pass
        return first.cancelled, second.cancelled

    submitted = executor.submit(job)
    assert ended.wait(DEADLINE_S)
    executor._closed.set()  # closing, with the job still running: the first half of close()
    executor._cancels.fire()
    closed.set()
    executor.close()
    assert submitted.done.wait(DEADLINE_S)
    assert submitted.value == (False, True) and calls == ["second"]


def test_cancel_on_close_does_nothing_on_a_caller_running_a_job_itself() -> None:
    executor = Executor(0, NAME)  # no threads: the caller runs every job
    calls: list[str] = []

    def job() -> bool:
        with cancel_on_close(lambda: calls.append("cancel")) as scope:
            pass
        return scope.cancelled

    submitted = executor.submit(job)
    executor.close()
    assert executor.result(submitted, DEADLINE_S, _hung) is False and calls == []
