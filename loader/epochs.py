"""Epochs: which epoch each iteration streams, seen alike by the main process and every worker.

The trainer may call ``set_epoch(e)``; many never do (Lightning does not for
an IterableDataset). Either way every DataLoader worker of every rank must
stream the same epoch, and a fresh one per pass. So each worker slot (and the
main process, for ``num_workers=0``) keeps its own "next epoch" counter, which
it reads and advances when an iteration starts (``iter(dataset)`` runs once
per worker per pass, for persistent workers too). ``set_epoch`` sets every
counter at once; the latest call wins.

The counters, and a pending resume point, live in a small torch tensor in
shared memory: forked workers inherit the mapping, and spawned or forkserver
workers receive it through torch's multiprocessing pickler, so a ``set_epoch``
made in the main process reaches persistent workers under every start method.
The memory is released with the last process holding it; nothing is named on
disk, so a crash leaves nothing behind.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["MAX_WORKERS", "ResumePoint", "SharedProgress"]

MAX_WORKERS = 1024
_MAIN = MAX_WORKERS  # the main process's counter (num_workers=0)
_RESUME = MAX_WORKERS + 1  # epoch, batches, num_workers of a pending resume (-1: none)


class ResumePoint(NamedTuple):
    """A rank-level position: ``batches`` batches of ``epoch`` were consumed with ``num_workers``."""

    epoch: int
    batches: int
    num_workers: int


class SharedProgress:
    """Per-slot next-epoch counters and a pending resume point, in shared memory."""

    def __init__(self) -> None:
        self._cell = torch.zeros(_RESUME + 3, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        self._cell[_RESUME] = -1

    def claim(self, worker: int | None) -> int:
        """The epoch an iteration starting now in ``worker`` (None: main process) streams; advances it."""
        slot = self._slot(worker)
        epoch = int(self._cell[slot])
        self._cell[slot] = epoch + 1
        return epoch

    def continue_after(self, worker: int | None, epoch: int) -> None:
        """The iteration in ``worker`` turned out to be ``epoch`` (a restored state): next is ``epoch + 1``."""
        self._cell[self._slot(worker)] = epoch + 1

    def set_epoch(self, epoch: int) -> None:
        """Every slot's next iteration streams ``epoch``; a pending resume of another epoch is dropped."""
        self._cell[:_RESUME] = epoch
        if int(self._cell[_RESUME]) != epoch:
            self._cell[_RESUME:] = -1

    def next_epoch(self) -> int:
        """The epoch the next iteration streams (the furthest any slot has got)."""
        return int(self._cell[:_RESUME].max())

    def set_resume(self, point: ResumePoint) -> None:
        """Resume ``point.epoch`` after ``point.batches`` batches, on every slot."""
        self._cell[:_RESUME] = point.epoch
        self._cell[_RESUME:] = torch.tensor(list(point), dtype=torch.int64)

    def resume_for(self, epoch: int) -> ResumePoint | None:
        """The pending resume point if it belongs to ``epoch``."""
        point = ResumePoint(*(int(v) for v in self._cell[_RESUME:].tolist()))
        return point if point.epoch == epoch else None

    @staticmethod
    def _slot(worker: int | None) -> int:
        if worker is None:
            return _MAIN
        if not 0 <= worker < MAX_WORKERS:
            raise ValueError(f"DataLoader worker {worker}: at most {MAX_WORKERS} workers supported")
        return worker
