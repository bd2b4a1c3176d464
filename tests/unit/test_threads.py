"""Ctrl-C while a thread starts (shardprep/format/threads.py): the caller gets the interrupt,
never CPython's ``RuntimeError('release unlocked lock')``, and no thread is left behind, not
even one stuck before it ever ran (it has an ident, is listed, is not alive, cannot be joined).

A SIGINT is sent (Python's own handler raises the KeyboardInterrupt, as for a Ctrl-C), or a
KeyboardInterrupt raised, at each moment CPython may run a signal handler (a Python function
starts, a call returns) inside the start, one run per moment, until a run is not cut.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable

from shardprep.destination import _Uploads
from shardprep.format.threads import start_thread
from tests.interrupts import interrupt_at

LEFT_WITHIN_S = 5.0


# The code a start runs: CPython's threading and ours (not, e.g., a weakref callback that a
# collection runs meanwhile, where CPython prints an interrupt and drops it; nor the return of
# the constructor that started the threads, after which its caller owns them)
WHERE = ("/threading.py", "/shardprep/format/threads.py")


def _cut_each(
    start: Callable[[], object], after: Callable[[object | None], None], by_signal: bool = True
) -> tuple[int, list[tuple[int, str]]]:
    """Run ``start`` cut at its 1st, 2nd, ... moment (by a SIGINT, else a raise); (runs cut,
    errors other than the cut)."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    n, cut, other = 1, 0, []
    while True:
        made: object | None = None
        sys.settrace(interrupt_at(n, ("call", "return"), WHERE, by_signal=by_signal))
        try:
            made = start()
            done = True
        except KeyboardInterrupt:
            done, cut = False, cut + 1
        except BaseException as err:  # recorded: the test fails naming it
            done = False
            other.append((n, repr(err)))
        finally:
            sys.settrace(None)
        try:
            after(made)
        except AssertionError as failed:
            raise AssertionError(
                f"after the run cut at moment {n} (cut: {not done}): {failed}"
            ) from None
        if done:
            return cut, other
        n += 1


def _left(prefix: str) -> list[str]:
    """The threads named ``prefix...`` still there after ``LEFT_WITHIN_S``: running, or stuck
    before they ran (listed with an ident, not alive; a finished thread is no longer listed,
    and one whose start was cut before the system thread was made has no ident)."""
    deadline = time.monotonic() + LEFT_WITHIN_S
    while True:
        alive = [
            t.name
            for t in threading.enumerate()
            if t.name.startswith(prefix) and (t.is_alive() or t.ident is not None)
        ]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)  # polling the threads' exits, bounded by LEFT_WITHIN_S


def test_a_ctrl_c_while_a_thread_starts_is_the_interrupt_and_leaves_no_thread() -> None:
    release = threading.Event()

    def start() -> None:
        start_thread(threading.Thread(target=release.wait, name="test-start-one", daemon=True))

    cut, other = _cut_each(start, lambda _: None)
    release.set()
    assert other == [] and cut > 5, (cut, other)
    assert _left("test-start-one") == []


def test_an_interrupt_another_handler_raises_while_a_thread_starts_is_itself() -> None:
    """Not a Ctrl-C (a program's own signal handler raising): not deferred, so it may leave a
    thread stuck before it ran (CPython's start cut inside its event's ``with``), but the
    caller gets that interrupt itself, never another error."""
    release = threading.Event()

    def start() -> None:
        start_thread(threading.Thread(target=release.wait, name="test-start-raise", daemon=True))

    cut, other = _cut_each(start, lambda _: None, by_signal=False)
    release.set()
    assert other == [] and cut > 5, (cut, other)


def test_an_interrupt_while_the_upload_threads_start_leaves_none() -> None:
    """The builder's upload threads (a remote OUT): the interrupt, and the threads started
    before it are stopped, not left waiting for uploads that never come."""

    def after(uploads: object | None) -> None:
        if isinstance(uploads, _Uploads):
            uploads.stop()
        assert _left("shardprep-upload-") == []

    cut, other = _cut_each(lambda: _Uploads(3, lambda record: None), after)
    assert other == [] and cut > 10, (cut, other)
