"""Ctrl-C where CPython would garble it or lose it.

Python's SIGINT handler raises KeyboardInterrupt in whatever Python code the main thread runs
next. Two kinds of place make that wrong:

- Code that must not be cut once begun. ``shutil.rmtree`` (CPython 3.11) closes a folder's
  descriptor and marks it closed on the next line; an interrupt between the two makes its
  ``finally`` close the same number again: ``OSError: [Errno 9] Bad file descriptor`` replaces
  the interrupt (a traceback and exit 1 where the user pressed Ctrl-C: seen in CI), and that second
  close may close a file another thread opened meanwhile. ``deferred`` (defined in
  ``shardprep.format.sigint``, which the thread starter uses too) records a Ctrl-C during such
  a block and raises it when the block is done.
- Callbacks where an exception cannot propagate (a weakref callback, ``__del__``, an import
  lock's callback). CPython prints ``Exception ignored in ...`` with the KeyboardInterrupt's
  traceback and drops it: the build went on as if no key had been pressed (seen in CI: a Ctrl-C
  in the write phase, a traceback, and the build ran to its end). :func:`redeliver_dropped`
  (the CLI calls it; it owns its process) makes such an interrupt a Ctrl-C again: SIGINT is
  sent once more, and lands in ordinary code (else it is dropped and sent again), where it
  stops the build.

Tested by tests/unit/test_interrupts.py (a SIGINT at each moment of a folder's removal; a
KeyboardInterrupt dropped by a weakref callback) and tests/faults/test_interrupt.py (a loop of
real Ctrl-Cs against the CLI: no traceback, ever). Stdlib only.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from shardprep.format.threads import start_thread

__all__ = ["redeliver_dropped"]


def redeliver_dropped() -> None:
    """From now on, a KeyboardInterrupt that CPython could not raise (``sys.unraisablehook``)
    is not printed but sent again as SIGINT to the main thread; other unraisable errors are
    reported as before. Process-wide: for a program that owns its process (the CLI).

    The signal is sent by a daemon thread, ``shardprep-ctrl-c``: sent from the hook, the handler
    would run before the hook returns and raise in it (dropped again). From another thread it
    lands where the main thread is when that thread runs, as the first Ctrl-C did, and wakes a
    wait in a system call as it does. A process forked from this one has no such thread.
    """
    dropped = threading.Event()
    main = threading.main_thread().ident
    assert main is not None

    def redeliver() -> None:
        while True:
            dropped.wait()
            dropped.clear()
            # does nothing where SIGINT is ignored (the CLI's last message is being printed)
            signal.pthread_kill(main, signal.SIGINT)

    start_thread(threading.Thread(target=redeliver, name="shardprep-ctrl-c", daemon=True))
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        kind = unraisable.exc_type
        if isinstance(kind, type) and issubclass(kind, KeyboardInterrupt):
            dropped.set()
            return
        previous(unraisable)

    sys.unraisablehook = hook
