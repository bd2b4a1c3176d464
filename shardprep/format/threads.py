"""Starting a thread where Ctrl-C may land: the builder's upload, listing and contact threads
and the loader's reader threads (``loader.io.executor``, the obstore loop).

``Thread.start`` waits on a ``threading.Event`` for the new thread to run. An interrupt landing
in that wait just after its ``Condition`` let go of its lock makes the ``with`` around it release
the lock again: CPython raises ``RuntimeError('release unlocked lock')`` with the interrupt as its
context, and the thread has started. An interrupt landing as that ``with`` begins to leave,
before it releases the lock, leaves the lock held: the new thread then waits for it forever in
its own first step (setting that event), a thread that never runs, cannot be joined and is not
alive. A user who pressed Ctrl-C must see the interrupt (the CLI's "interrupted" message and
exit 130, a training loop's ``KeyboardInterrupt``), never that error, and no thread stuck.

So a Ctrl-C (SIGINT with Python's own handler, in the main thread) during the start is deferred
(``shardprep.format.sigint``): raised once the thread runs. An exception that another signal
handler of the program raises there can still cut the start; it is raised as itself.

Stdlib only: the loader imports this module without the builder.
"""

from __future__ import annotations

import threading

from shardprep.format.sigint import deferred

__all__ = ["start_thread"]


def start_thread(thread: threading.Thread) -> None:
    """``thread.start()``, raising the interrupt that cut it as that interrupt.

    Tested by tests/unit/test_threads.py (an interrupt at every call and return inside the
    start) and tests/unit/test_executor.py::test_an_interrupt_while_the_threads_start_is_the_interrupt.
    """
    try:
        with deferred():
            thread.start()
    except RuntimeError as err:
        interrupt = err.__context__
        if interrupt is not None and not isinstance(interrupt, Exception):
            raise interrupt from None
        raise
