"""Stream: one worker's pass over one epoch, as a resumable iterator.

``iter(ShardDataset)`` returns an ``EpochStream``. It is what torchdata's
``StatefulDataLoader`` checkpoints: it has ``state_dict()`` and
``load_state_dict()`` and is created before its first item is asked for
(torchdata calls ``iter(dataset)``, restores the state, then iterates). The
state is the worker's position, a few numbers (see ``loader.state``); nothing
is read until the first ``next()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from loader.elastic import Pass
from loader.errors import IncompatibleStateError
from loader.state import check_state, rank_resume
from loader.world import World

if TYPE_CHECKING:
    from loader.torchlayer import TorchLayer

__all__ = ["EpochStream"]

_POSITION = ("epoch", "slot", "yielded")


class EpochStream:
    """Items (batches, or samples without a batch size) of one worker slot in one epoch."""

    def __init__(
        self,
        dataset: TorchLayer,
        epoch: int,
        world: World,
        counter: int | None,
        explicit: bool = False,
    ) -> None:
        self._dataset = dataset
        self._world = world  # .worker is the DataLoader worker id
        self._counter = counter  # whose epoch counter this pass advanced (None: main process)
        self._explicit = explicit  # the epoch was chosen by set_epoch for this pass
        self._epoch = epoch
        self._slot, self._yielded = world.worker, 0
        self._history: tuple[Pass, ...] = ()  # the epoch's earlier passes (elastic resume)
        point = dataset.progress.resume_for(epoch)
        if point is not None:
            saved_world = point.world_size or world.world_size
            if (saved_world, point.num_workers) == (world.world_size, world.num_workers):
                self._history = point.history
                self._slot, self._yielded = rank_resume(
                    point.batches, point.num_workers, world.worker
                )
            else:  # another world: a new pass over what the saved one left
                self._history = (
                    *point.history,
                    Pass(saved_world, point.num_workers, point.batches),
                )
        self._items: Iterator[Any] | None = None
        self._restored_at_end = False  # a torchdata state put this slot at its epoch's end
        self._fingerprint = dataset.fingerprint(world.num_workers)  # state_dict() runs per batch

    @property
    def epoch(self) -> int:
        """The epoch this stream yields."""
        return self._epoch

    def __iter__(self) -> EpochStream:
        return self

    def __next__(self) -> Any:
        if self._restored_at_end:
            self._restored_at_end = False
            self._start_next_epoch_if_complete()
        if self._items is None:
            slot_world = World(
                self._world.rank, self._world.world_size, self._slot, self._world.num_workers
            )
            self._items = self._dataset.items(self._epoch, slot_world, self._yielded, self._history)
        item = next(self._items)
        self._yielded += 1
        return item

    def _start_next_epoch_if_complete(self) -> None:
        """After a restore at this slot's end: if every slot was at its end, stream the next epoch.

        Lightning saves a state on an epoch's last batch and never asks past
        ``len()``, so torchdata restores it as unfinished; without this the
        next epoch would yield nothing. torchdata resumes its worker rotation
        after the worker that delivered the epoch's last batch, so with a
        batch size worker ``d`` plays slot ``(d - last - 1) % num_workers``
        and the batches of the new epoch still arrive as 0, 1, 2, ... (without
        a batch size the DataLoader's batching is unknown here, and worker
        ``d`` plays slot ``d``: the same samples, possibly interleaved differently).
        """
        num_workers = self._world.num_workers
        slots = self._dataset.progress.restored_slots(self._epoch, num_workers)
        if slots is None:
            return  # other slots still have batches of this epoch
        slot = self._world.worker
        if self._dataset.batch_size is not None:
            batches = sum(
                self._dataset.items_per_slot(
                    self._world.world_size, num_workers, self._history, self._epoch
                )
            )
            last_worker = slots.index((batches - 1) % num_workers) if batches else -1
            slot = (self._world.worker - last_worker - 1) % num_workers
        self._epoch, self._slot, self._yielded = self._epoch + 1, slot, 0
        self._history = ()
        self._dataset.progress.continue_after(self._counter, self._epoch)

    def state_dict(self) -> dict[str, Any]:
        """This worker's position: a small JSON-able dict (torchdata calls it on every batch)."""
        return {
            **self._fingerprint,
            "epoch": self._epoch,
            "slot": self._slot,
            "yielded": self._yielded,
            "history": [list(p) for p in self._history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s result; only before the first item.

        If ``set_epoch`` chose another epoch for this pass, it wins and the
        state is dropped (as ``set_epoch`` drops a pending ``resume()`` of
        another epoch): a trainer that names its epochs is never held in a
        stale one. A state at this slot's end is reported to the other
        workers, so that a complete epoch resumes into the next one
        (``_start_next_epoch_if_complete``).

        Raises:
            IncompatibleStateError: the state is from another build, options,
                world size or number of workers.
        """
        if self._items is not None:
            raise RuntimeError("load_state_dict() must come before the stream's first item")
        check_state(state, self._fingerprint, _POSITION)
        if self._explicit and state["epoch"] != self._epoch:
            return
        if state["slot"] >= self._world.num_workers:
            raise IncompatibleStateError.field_differs(
                "slot", state["slot"], f"< {self._world.num_workers}"
            )
        self._epoch, self._slot, self._yielded = (int(state[f]) for f in _POSITION)
        self._history = tuple(Pass(*(int(v) for v in p)) for p in state.get("history", ()))
        self._dataset.progress.continue_after(self._counter, self._epoch)
        per_slot = self._dataset.items_per_slot(
            self._world.world_size, self._world.num_workers, self._history, self._epoch
        )
        self._restored_at_end = self._yielded >= per_slot[self._slot]
        self._dataset.progress.report_restored(
            self._world.worker, self._epoch, self._slot, self._restored_at_end
        )
