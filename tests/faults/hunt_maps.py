"""Hostile --map functions for tests/faults/test_hunt_pipelines.py, importable by name (spawned
workers import them back)."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any


class NotAnException(BaseException):
    """A BaseException that is neither Exception, SystemExit nor KeyboardInterrupt."""


def exits_zero(sample: dict[str, Any]) -> dict[str, Any]:
    sys.exit(0)


def raises_base_exception(sample: dict[str, Any]) -> dict[str, Any]:
    raise NotAnException("not an Exception")


def interrupts(sample: dict[str, Any]) -> dict[str, Any]:
    raise KeyboardInterrupt


def newline_member(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "txt\n": b"x"}


def mutates_and_returns(sample: dict[str, Any]) -> dict[str, Any]:
    sample["png"] = sample["png"][:8]
    return sample


def ends_the_process(sample: dict[str, Any]) -> dict[str, Any]:
    """os._exit(0): no exception to catch; only a separate process survives it."""
    os._exit(0)


def hangs(sample: dict[str, Any]) -> dict[str, Any]:
    """Never returns (until the process is killed)."""
    threading.Event().wait()
    return sample


def prints(sample: dict[str, Any]) -> dict[str, Any]:
    """Writes to stdout (file descriptor 1) as a chatty library would, then keeps the sample."""
    os.write(1, b"noise from the map\n")
    return sample
