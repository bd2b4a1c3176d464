"""Keep a forked DataLoader worker from copying its parent's heap when it collects garbage.

A worker forked from the training process shares that process's memory page by page until
either writes a page. A full (oldest-generation) collection in the worker writes a field in
the header of every object it tracks, inherited ones included, so one full collection
copies most of the parent's Python heap into the worker (about 40 MiB per worker for a
parent that has imported torch; more for a parent that holds a large Python heap). Whether
a worker runs one depends on how many objects it allocates, so the copy shows up only in
long epochs. ``gc.freeze()`` moves every object the worker holds into the permanent
generation, which collections skip; it is O(1) (it splices lists, it touches no object).
Objects the worker makes afterwards are collected as usual.
"""

from __future__ import annotations

import gc
import os

__all__ = ["freeze_inherited"]

_frozen_in: int | None = None  # pid of the process that last froze (a fork has another)


def freeze_inherited() -> None:
    """Freeze the objects this process holds now; once per process (later calls do nothing,
    so the objects of a persistent worker's earlier epochs are still collected)."""
    global _frozen_in
    if _frozen_in != os.getpid():
        gc.freeze()
        _frozen_in = os.getpid()
