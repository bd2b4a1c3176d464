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

The counters, a pending resume point and what each worker restored from a
torchdata state live in named fields of one small torch tensor in shared
memory (``_FIELDS``): forked workers inherit the mapping, and spawned or forkserver
workers receive it through torch's multiprocessing pickler, so a ``set_epoch``
made in the main process reaches persistent workers under every start method.
The memory is released with the last process holding it; nothing is named on
disk, so a crash leaves nothing behind.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from loader.plan.elastic import Pass
from loader.read.telemetry import PASS_END, ROW, EpochStats, epoch_stats

__all__ = ["MAX_PASSES", "MAX_WORKERS", "Restored", "ResumePoint", "SharedProgress"]

MAX_WORKERS = 1024
MAX_PASSES = 64  # elastic resumes within one epoch
_MAIN = MAX_WORKERS  # the main process's slot in the per-slot fields (num_workers=0)

# name -> length. Per-slot fields hold MAX_WORKERS DataLoader workers and the main process.
_FIELDS = {
    "next_epoch": MAX_WORKERS + 1,  # the epoch the slot's next pass streams
    "explicit": MAX_WORKERS + 1,  # 1 while the slot's next epoch was chosen by set_epoch
    "resume": 3,  # a pending rank-level resume: epoch, batches, num_workers (-1: none)
    "resume_world": 1,  # its world size (0: the current one)
    "resume_passes": 1,  # how many earlier passes its history holds
    "resume_history": 3 * MAX_PASSES,  # those passes, [world_size, num_workers, batches] each
    "restored_epoch": MAX_WORKERS,  # per worker: epoch + 1 of the torchdata state it restored
    "restored_end": MAX_WORKERS,  # per worker: 1 if that position was its slot's end
    "restored_slot": MAX_WORKERS,  # per worker: the slot of that position
    "restored_yielded": MAX_WORKERS,  # per worker: the items that slot had yielded
    "restored_world": MAX_WORKERS,  # per worker: the world size that state was saved at
    "telemetry": (MAX_WORKERS + 1) * ROW,  # per slot: a pass's counters (loader.read.telemetry)
}
_AT: dict[str, slice] = {}
_end = 0
for _name, _length in _FIELDS.items():
    _AT[_name] = slice(_end, _end + _length)
    _end += _length
_SIZE = _end


class ResumePoint(NamedTuple):
    """A rank-level position: ``batches`` batches of ``epoch`` were consumed with ``num_workers``.

    ``world_size`` is the world the position was saved in (0: the current
    one); ``history`` the epoch's earlier passes (``loader.plan.elastic``).
    """

    epoch: int
    batches: int
    num_workers: int
    world_size: int = 0
    history: tuple[Pass, ...] = ()


class Restored(NamedTuple):
    """What one DataLoader worker restored from a torchdata state."""

    slot: int
    yielded: int
    at_end: bool
    world_size: int


class SharedProgress:
    """Per-slot next-epoch counters, a pending resume point and restored positions, shared."""

    def __init__(self) -> None:
        self._cell = torch.zeros(_SIZE, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        self._field("resume")[:] = -1

    def _field(self, name: str) -> torch.Tensor:
        """A view of the named field of the shared tensor."""
        view: torch.Tensor = self._cell[_AT[name]]
        return view

    def claim(self, worker: int | None) -> tuple[int, bool]:
        """(epoch, chosen by set_epoch) of a pass starting now in ``worker`` (None: main); advances it."""
        slot = self._slot(worker)
        next_epoch, explicit = self._field("next_epoch"), self._field("explicit")
        epoch, chosen = int(next_epoch[slot]), bool(explicit[slot])
        next_epoch[slot] = epoch + 1
        explicit[slot] = 0
        return epoch, chosen

    def continue_after(self, worker: int | None, epoch: int) -> None:
        """The iteration in ``worker`` turned out to be ``epoch`` (a restored state): next is ``epoch + 1``."""
        self._field("next_epoch")[self._slot(worker)] = epoch + 1

    def set_epoch(self, epoch: int) -> None:
        """Every slot's next iteration streams ``epoch``; a pending resume of another epoch is dropped."""
        self._field("next_epoch")[:] = epoch
        self._field("explicit")[:] = 1  # every slot, the main one too
        resume = self._field("resume")
        if int(resume[0]) != epoch:
            resume[:] = -1

    def next_epoch(self) -> int:
        """The epoch the next iteration streams (the furthest any slot has got)."""
        return int(self._field("next_epoch").max())

    def set_resume(self, point: ResumePoint) -> None:
        """Resume ``point.epoch`` after ``point.batches`` batches, on every slot."""
        if len(point.history) > MAX_PASSES:
            raise ValueError(f"at most {MAX_PASSES} elastic resumes within one epoch")
        self._field("next_epoch")[:] = point.epoch
        self._field("resume")[:] = torch.tensor(list(point[:3]), dtype=torch.int64)
        self._field("resume_world")[0] = point.world_size
        self._field("resume_passes")[0] = len(point.history)
        if point.history:
            flat = [v for p in point.history for v in p]
            self._field("resume_history")[: len(flat)] = torch.tensor(flat, dtype=torch.int64)

    def resume_for(self, epoch: int) -> ResumePoint | None:
        """The pending resume point if it belongs to ``epoch``."""
        head = [int(v) for v in self._field("resume").tolist()]
        if head[0] != epoch:
            return None
        passes = int(self._field("resume_passes")[0])
        flat = self._field("resume_history")[: 3 * passes].tolist()
        history = tuple(Pass(*flat[i : i + 3]) for i in range(0, len(flat), 3))
        world_size = int(self._field("resume_world")[0])
        return ResumePoint(head[0], head[1], head[2], world_size, history)

    def pending_resume(self) -> ResumePoint | None:
        """The pending resume point if its epoch is next or streaming (the next epoch its successor).

        Kept until another epoch's pass starts or ``set_epoch`` names another
        epoch: ``len()`` describes the resumed epoch that long.
        """
        upcoming = self.next_epoch()
        for epoch in (upcoming, upcoming - 1):
            point = self.resume_for(epoch) if epoch >= 0 else None
            if point is not None:
                return point
        return None

    def report_restored(self, worker: int, epoch: int, restored: Restored) -> None:
        """DataLoader worker ``worker`` restored a position of ``epoch`` from a torchdata state."""
        self._field("restored_epoch")[worker] = epoch + 1
        self._field("restored_end")[worker] = int(restored.at_end)
        self._field("restored_slot")[worker] = restored.slot
        self._field("restored_yielded")[worker] = restored.yielded
        self._field("restored_world")[worker] = restored.world_size

    def restored(self, epoch: int, num_workers: int) -> list[Restored]:
        """What each of the ``num_workers`` workers restored of ``epoch``.

        torchdata restores every worker before it asks any for data, so all
        workers have reported by the time one asks.

        Raises:
            RuntimeError: a worker has not reported (the restore order changed).
        """
        epochs = self._field("restored_epoch")[:num_workers]
        if bool((epochs != epoch + 1).any()):
            raise RuntimeError(
                f"cannot tell where restored epoch {epoch} stood: not every DataLoader worker "
                "restored its state before the first batch was asked for"
            )
        columns = [
            self._field(name)[:num_workers].tolist()
            for name in ("restored_slot", "restored_yielded", "restored_end", "restored_world")
        ]
        return [
            Restored(int(slot), int(yielded), bool(end), int(world))
            for slot, yielded, end, world in zip(*columns, strict=True)
        ]

    # --- telemetry (loader.read.telemetry) ---------------------------------------------

    def _telemetry(self) -> npt.NDArray[np.int64]:
        """The per-slot counter rows, as NumPy over the shared memory (made per call: a view
        kept here would be pickled by value to the workers)."""
        rows: npt.NDArray[np.int64] = self._cell.numpy()[_AT["telemetry"]]
        return rows.reshape(MAX_WORKERS + 1, ROW)

    def telemetry_row(self, worker: int | None, num_workers: int) -> npt.NDArray[np.int64]:
        """The counter row of a pass starting now in ``worker`` (None: main), of ``num_workers``.

        The rows no slot of this pass writes are cleared first, so the pass's counts are
        the only ones of its epoch: by the main process (an in-process pass) all the
        workers' rows; by worker 0 those of workers it does not have and the main row's
        pass part (the main process's wait is its own).
        """
        rows = self._telemetry()
        if worker is None:
            rows[:MAX_WORKERS] = 0
        elif worker == 0:
            rows[num_workers:MAX_WORKERS] = 0
            rows[_MAIN, :PASS_END] = 0
        row: npt.NDArray[np.int64] = rows[self._slot(worker)]
        return row

    def main_row(self) -> npt.NDArray[np.int64]:
        """The main process's row (its wait and compute: ``loader.read.telemetry.LoopClock``)."""
        row: npt.NDArray[np.int64] = self._telemetry()[_MAIN]
        return row

    def epoch_stats(self) -> EpochStats:
        """The latest pass's counters, added over its slots, with the main process's wait."""
        rows = self._telemetry()
        return epoch_stats(rows, rows[_MAIN])

    @staticmethod
    def _slot(worker: int | None) -> int:
        if worker is None:
            return _MAIN
        if not 0 <= worker < MAX_WORKERS:
            raise ValueError(f"DataLoader worker {worker}: at most {MAX_WORKERS} workers supported")
        return worker
