"""A KeyboardInterrupt at the n-th moment CPython may run a signal handler: for the hunts that
cut a piece of code at each such moment in turn (tests/unit/test_threads.py, and the child
scripts of tests/unit/test_executor.py)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

__all__ = ["interrupt_at"]


def interrupt_at(
    n: int, events: Sequence[str], where: tuple[str, ...] = (), by_signal: bool = False
) -> Callable[[FrameType, str, Any], Any]:
    """A trace function (``sys.settrace``) raising KeyboardInterrupt at the ``n``-th of
    ``events`` (``"call"``: a Python function starts; ``"return"``: a call returns; ``"line"``:
    a line starts), counting only code in files whose path ends with one of ``where`` (all
    code when empty). ``by_signal``: send SIGINT instead, as a Ctrl-C does: SIGINT's handler
    decides (Python's default raises KeyboardInterrupt there and then)."""
    seen = [0]

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if event in events and (not where or frame.f_code.co_filename.endswith(where)):
            seen[0] += 1
            if seen[0] == n:
                sys.settrace(None)
                if by_signal:
                    signal.raise_signal(signal.SIGINT)  # runs the Python handler before returning
                else:
                    raise KeyboardInterrupt
        return trace

    return trace
