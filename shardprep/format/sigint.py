"""A Ctrl-C deferred over a block that must not be cut: recorded, and raised when it ends.

Used where an interrupt would garble CPython's own bookkeeping: ``shutil.rmtree`` closing a
folder's descriptor (``shardprep.scratch``), a thread's start (``shardprep.format.threads``),
numpy's file I/O (``shardprep.plan_store``); see ``shardprep.format.interrupts`` for the why.
Stdlib only: the loader imports it (through the thread starter) without the builder.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["deferred"]


@contextmanager
def deferred() -> Iterator[threading.Event | None]:
    """Within the block a Ctrl-C is recorded, not raised; it is raised as KeyboardInterrupt when
    the block ends (unless the block raised: its exception goes on).

    Yields the record (a ``threading.Event`` the block may poll and clear: a Ctrl-C the block
    handled itself), or None where nothing is deferred: outside the main thread (which never
    gets KeyboardInterrupt from a signal), or where SIGINT has a handler other than Python's
    default (the program's own, a deferral around this one, or SIG_IGN), which is kept.
    """
    in_main = threading.current_thread() is threading.main_thread()
    if not in_main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield None
        return
    pressed = threading.Event()

    def record(_signum: int, _frame: object) -> None:
        pressed.set()

    previous = signal.signal(signal.SIGINT, record)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed.is_set():
        raise KeyboardInterrupt
