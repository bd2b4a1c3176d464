"""Epochs: which epoch each iteration streams, seen alike by the main process and every worker.

The trainer may call ``set_epoch(e)``; many never do (Lightning does not for
an IterableDataset). Either way every DataLoader worker of every rank must
stream the same epoch, and a fresh one per pass. So each worker slot (and the
main process, for ``num_workers=0``) keeps its own "next epoch" counter, which
it reads and advances when an iteration starts (``iter(dataset)`` runs once
per worker per pass, for persistent workers too). ``set_epoch`` sets every
counter at once, and marks each slot's next pass as explicitly chosen; the
latest call wins. An explicitly chosen epoch also wins over a restored
torchdata state of another epoch (``EpochStream.load_state_dict``).

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

from loader.elastic import Pass

__all__ = ["MAX_PASSES", "MAX_WORKERS", "ResumePoint", "SharedProgress"]

MAX_WORKERS = 1024
MAX_PASSES = 64  # elastic resumes within one epoch
_MAIN = MAX_WORKERS  # the main process's counter (num_workers=0)
_RESUME = MAX_WORKERS + 1  # epoch, batches, num_workers of a pending resume (-1: none)
_EXPLICIT = _RESUME + 3  # per slot: 1 while its next epoch was set by set_epoch
_RESTORED = _EXPLICIT + _RESUME  # per worker: epoch + 1 of the last torchdata state it restored
_EXHAUSTED = _RESTORED + MAX_WORKERS  # per worker: 1 if that restored position was its slot's end
_SLOT = _EXHAUSTED + MAX_WORKERS  # per worker: the slot of that restored position
_WORLD = _SLOT + MAX_WORKERS  # world size of the pending resume, then its number of passes
_HISTORY = _WORLD + 2  # the pending resume's earlier passes, 3 numbers each


class ResumePoint(NamedTuple):
    """A rank-level position: ``batches`` batches of ``epoch`` were consumed with ``num_workers``.

    ``world_size`` is the world the position was saved in (0: the current
    one); ``history`` the epoch's earlier passes (``loader.elastic``).
    """

    epoch: int
    batches: int
    num_workers: int
    world_size: int = 0
    history: tuple[Pass, ...] = ()


class SharedProgress:
    """Per-slot next-epoch counters and a pending resume point, in shared memory."""

    def __init__(self) -> None:
        size = _HISTORY + 3 * MAX_PASSES
        self._cell = torch.zeros(size, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        self._cell[_RESUME : _RESUME + 3] = -1

    def claim(self, worker: int | None) -> tuple[int, bool]:
        """(epoch, chosen by set_epoch) of a pass starting now in ``worker`` (None: main); advances it."""
        slot = self._slot(worker)
        epoch, explicit = int(self._cell[slot]), bool(self._cell[_EXPLICIT + slot])
        self._cell[slot] = epoch + 1
        self._cell[_EXPLICIT + slot] = 0
        return epoch, explicit

    def continue_after(self, worker: int | None, epoch: int) -> None:
        """The iteration in ``worker`` turned out to be ``epoch`` (a restored state): next is ``epoch + 1``."""
        self._cell[self._slot(worker)] = epoch + 1

    def set_epoch(self, epoch: int) -> None:
        """Every slot's next iteration streams ``epoch``; a pending resume of another epoch is dropped."""
        self._cell[:_RESUME] = epoch
        self._cell[_EXPLICIT : _EXPLICIT + _RESUME] = 1  # every slot, the main one too
        if int(self._cell[_RESUME]) != epoch:
            self._cell[_RESUME : _RESUME + 3] = -1

    def next_epoch(self) -> int:
        """The epoch the next iteration streams (the furthest any slot has got)."""
        return int(self._cell[:_RESUME].max())

    def set_resume(self, point: ResumePoint) -> None:
        """Resume ``point.epoch`` after ``point.batches`` batches, on every slot."""
        if len(point.history) > MAX_PASSES:
            raise ValueError(f"at most {MAX_PASSES} elastic resumes within one epoch")
        self._cell[:_RESUME] = point.epoch
        self._cell[_RESUME : _RESUME + 3] = torch.tensor(list(point[:3]), dtype=torch.int64)
        self._cell[_WORLD] = point.world_size
        self._cell[_WORLD + 1] = len(point.history)
        if point.history:
            flat = [v for p in point.history for v in p]
            self._cell[_HISTORY : _HISTORY + len(flat)] = torch.tensor(flat, dtype=torch.int64)

    def resume_for(self, epoch: int) -> ResumePoint | None:
        """The pending resume point if it belongs to ``epoch``."""
        head = [int(v) for v in self._cell[_RESUME : _RESUME + 3].tolist()]
        if head[0] != epoch:
            return None
        world_size, passes = (int(v) for v in self._cell[_WORLD : _WORLD + 2].tolist())
        flat = self._cell[_HISTORY : _HISTORY + 3 * passes].tolist()
        history = tuple(Pass(*flat[i : i + 3]) for i in range(0, len(flat), 3))
        return ResumePoint(head[0], head[1], head[2], world_size, history)

    def report_restored(self, worker: int, epoch: int, slot: int, exhausted: bool) -> None:
        """DataLoader worker ``worker`` restored slot ``slot`` of ``epoch``, at the slot's end or not."""
        self._cell[_RESTORED + worker] = epoch + 1
        self._cell[_EXHAUSTED + worker] = int(exhausted)
        self._cell[_SLOT + worker] = slot

    def restored_slots(self, epoch: int, num_workers: int) -> list[int] | None:
        """Each worker's restored slot if every one restored the end of ``epoch`` (it was complete).

        torchdata restores every worker before it asks any for data, so all
        workers have reported by the time one asks.

        Raises:
            RuntimeError: a worker has not reported (the restore order changed).
        """
        restored = self._cell[_RESTORED : _RESTORED + num_workers]
        if bool((restored != epoch + 1).any()):
            raise RuntimeError(
                f"cannot tell whether restored epoch {epoch} was complete: not every DataLoader "
                "worker restored its state before the first batch was asked for"
            )
        if not bool(self._cell[_EXHAUSTED : _EXHAUSTED + num_workers].all()):
            return None
        slots: list[int] = self._cell[_SLOT : _SLOT + num_workers].tolist()
        return slots

    @staticmethod
    def _slot(worker: int | None) -> int:
        if worker is None:
            return _MAIN
        if not 0 <= worker < MAX_WORKERS:
            raise ValueError(f"DataLoader worker {worker}: at most {MAX_WORKERS} workers supported")
        return worker
