"""Stream: one worker's pass over one epoch, as a resumable iterator.

``iter(ShardDataset)`` returns an ``EpochStream``. It is what torchdata's
``StatefulDataLoader`` checkpoints: it has ``state_dict()`` and
``load_state_dict()`` and is created before its first item is asked for
(torchdata calls ``iter(dataset)``, restores the state, then iterates). The
state is the worker's position (``loader.plan.state.ResumeState``, worker level);
nothing is read until the first ``next()``.

A restored state may come from another world size (a job restarted on fewer
or more nodes, with the same ``num_workers``): each worker reports what it
restored to the others (``loader.torch.epochs.SharedProgress``), and at the first
``next()`` the workers add up what the rank had consumed and stream the rest
of the epoch re-split over the new world (``loader.plan.elastic``), in the order
torchdata will ask them. Such an epoch usually takes another number of batches
than a normal one, which ``len()`` (read by Lightning before it loads the
state) can only know from ``ShardDataset.resume(state)``: without it, the
restore is refused at the first item.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from time import perf_counter_ns
from typing import Any, Protocol, runtime_checkable

from loader.errors import IncompatibleStateError
from loader.plan.elastic import Pass
from loader.plan.state import ResumeState, rank_resume
from loader.plan.world import World
from loader.read.telemetry import COMPUTE, FIRST, WAIT, Clock, LoopClock
from loader.torch.batch import Batch
from loader.torch.epochs import Restored, ResumePoint, SharedProgress

__all__ = ["EpochStream"]


class Layer(Protocol):
    """What a pass needs of its torch layer (``loader.torch.layer.TorchLayer``)."""

    stream: Any  # the core stream (``loader.core.ShardStream``, ``MixedStream``)
    progress: SharedProgress

    def epoch_length(
        self, epoch: int, history: Sequence[Pass], world_size: int, num_workers: int
    ) -> int:
        """Batches a rank takes in ``epoch`` after its earlier passes ``history``."""


@runtime_checkable
class Clocked(Protocol):
    """A core stream that counts its passes' time (``loader.core.ShardStream.clock``)."""

    clock: Clock


class EpochStream:
    """Items (batches, or samples without a batch size) of one worker slot in one epoch."""

    def __init__(
        self,
        layer: Layer,
        epoch: int,
        world: World,
        counter: int | None,
        explicit: bool = False,
    ) -> None:
        self._layer = layer
        self._stream = layer.stream
        self._world = world  # .worker is the DataLoader worker id
        self._counter = counter  # whose epoch counter this pass advanced (None: main process)
        self._explicit = explicit  # the epoch was chosen by set_epoch for this pass
        self._epoch = epoch
        self._slot, self._yielded = world.worker, 0
        self._history: tuple[Pass, ...] = ()  # the epoch's earlier passes (elastic resume)
        point = layer.progress.resume_for(epoch)
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
        # a torchdata state (its epoch, what this worker restored) to settle at the first item
        self._restored: tuple[int, Restored] | None = None
        # state_dict() runs on every batch: the options part is computed once
        self._options = self._stream.options_fingerprint(world.world_size, world.num_workers)
        self._clock: Clock | None = None  # this pass's counters (loader.read.telemetry)
        self._counts = False  # the stream does not count its passes (mixtures): this does
        # in the main process (num_workers=0), the loop's wait is the time in __next__
        self._loop = LoopClock(layer.progress.main_row()) if counter is None else None

    @property
    def epoch(self) -> int:
        """The epoch this stream yields."""
        return self._epoch

    def __iter__(self) -> EpochStream:
        return self

    def __next__(self) -> Any:
        loop = self._loop
        if loop is None:
            return self._next()
        # LoopClock.asked and .arrived, inline (once per batch: loader.read.telemetry)
        asked = perf_counter_ns()
        cells = loop.cells
        if loop.last:
            cells[COMPUTE] += asked - loop.last
        try:
            return self._next()
        finally:
            now = perf_counter_ns()
            cells[WAIT] += now - asked
            if not loop.last:
                cells[FIRST] = now - loop.started
            loop.last = now

    def _next(self) -> Any:
        if self._restored is not None:
            self._settle_restore(*self._restored)
            self._restored = None
        if self._items is None:
            slot_world = World(
                self._world.rank, self._world.world_size, self._slot, self._world.num_workers
            )
            self._clock = self._start_clock()
            self._items = self._stream.items(self._epoch, slot_world, self._yielded, self._history)
        item = next(self._items)
        self._yielded += 1
        if self._counts:  # a mixture's batch: its samples and itself (no stages)
            self._clock.count(len(item["__key__"]), 1)  # type: ignore[union-attr]
        if self._counter is not None and type(item) is Batch:
            item.clock = self._clock  # its pickling to the main process is counted (handoff)
        return item

    def _start_clock(self) -> Clock:
        """This pass's counter row in the dataset's shared memory, given to the stream."""
        row = self._layer.progress.telemetry_row(self._counter, self._world.num_workers)
        clock = Clock(row)
        if isinstance(self._stream, Clocked):
            self._stream.clock = clock
        else:
            clock.start(self._epoch)
            self._counts = True
        return clock

    def state_dict(self) -> dict[str, Any]:
        """This worker's position: a small JSON-able dict (torchdata calls it on every batch)."""
        return ResumeState(
            self._options, self._epoch, self._history, slot=self._slot, yielded=self._yielded
        ).as_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s result; only before the first item.

        If ``set_epoch`` chose another epoch for this pass, it wins and the
        state is dropped (as ``set_epoch`` drops a pending ``resume()`` of
        another epoch): a trainer that names its epochs is never held in a
        stale one. The state may come from another world size (elastic
        resume, with a batch size); what it restored is reported to the other
        workers, and settled at the first item (``_settle_restore``).

        Raises:
            IncompatibleStateError: the state is from another build, options
                or number of workers, or from another world size where this
                dataset cannot resume elastically.
        """
        if self._items is not None:
            raise RuntimeError("load_state_dict() must come before the stream's first item")
        elastic = self._stream.elastic and self._stream.batch_size is not None
        saved = ResumeState.parse(state, self._options, elastic=elastic)
        if saved.rank_level:
            raise IncompatibleStateError(
                "a state_after() state is resumed with ShardDataset.resume(state), not through "
                "the DataLoader's load_state_dict",
                field="batches",
            )
        if saved.num_workers != self._world.num_workers:
            raise IncompatibleStateError.field_differs(
                "num_workers",
                saved.num_workers,
                self._world.num_workers,
                "pass the StatefulDataLoader state to ShardDataset.resume(state) instead, and "
                "iterate a new StatefulDataLoader without load_state_dict",
            )
        slot, yielded = int(saved.slot or 0), int(saved.yielded or 0)
        if slot >= self._world.num_workers:
            raise IncompatibleStateError.field_differs("slot", slot, f"< {self._world.num_workers}")
        per_slot = self._stream.items_per_slot(
            saved.world_size, self._world.num_workers, saved.history, saved.epoch
        )
        if yielded > per_slot[slot]:
            raise IncompatibleStateError.field_differs("yielded", yielded, f"<= {per_slot[slot]}")
        restored = Restored(slot, yielded, yielded >= per_slot[slot], saved.world_size)
        self._layer.progress.report_restored(self._world.worker, saved.epoch, restored)
        if self._explicit and saved.epoch != self._epoch:
            # set_epoch's epoch wins, from its first item, in the rotation torchdata resumes
            self._restored = (saved.epoch, restored)
            return
        point = self._layer.progress.resume_for(self._epoch)
        if point is not None:
            # ds.resume(state) was given a position of this epoch: it wins over torchdata's
            # (a trainer that fetched ahead saved one more batch than it trained)
            if saved.epoch != point.epoch:
                raise IncompatibleStateError(
                    f"the StatefulDataLoader state is of epoch {saved.epoch} and the state given "
                    f"to ds.resume() of epoch {point.epoch}: resume both from the same "
                    "checkpoint (the position ds.resume() got decides where the epoch goes on)",
                    field="epoch",
                    saved=saved.epoch,
                    current=point.epoch,
                )
            self._restored = (saved.epoch, restored)
            return
        self._epoch, self._history = saved.epoch, saved.history
        self._layer.progress.continue_after(self._counter, self._epoch)
        self._slot, self._yielded = slot, yielded
        if restored.at_end or saved.world_size != self._world.world_size or self._history:
            self._restored = (saved.epoch, restored)

    def _settle_restore(self, saved_epoch: int, mine: Restored) -> None:
        """At the first item after a restore: what the rank had consumed decides where to go on.

        Every worker's report is read (torchdata restores them all before it
        asks any for data). ``T``, the items the rank had consumed in the
        pass, is the sum of what the slots had yielded. torchdata asks next
        the worker after the one that delivered item ``T - 1``; so worker
        ``d`` plays slot ``(d - last - 1) % K`` of what comes next and the
        items still arrive in order 0, 1, 2, ...:

        * if ``set_epoch`` chose another epoch than the state's, that epoch
          from its first item;
        * at the same world size, if every slot was at its end (Lightning
          saves on an epoch's last batch and never asks past ``len()``), the
          next epoch; otherwise nothing changes;
        * at another world size, the rest of the pass re-split over this
          world (one more pass in ``history``), or the next epoch if the
          pass was complete.

        A restored epoch that takes another number of batches than ``len()``
        had said before the state was loaded is refused (``_check_length``).

        Without a batch size the DataLoader's batching is unknown here and
        worker ``d`` plays slot ``d``: the same samples, possibly
        interleaved differently.
        """
        num_workers = self._world.num_workers
        reports = self._layer.progress.restored(saved_epoch, num_workers)
        consumed = sum(r.yielded for r in reports)
        history: tuple[Pass, ...] = ()
        point = self._layer.progress.resume_for(self._epoch)
        if saved_epoch != self._epoch:  # set_epoch's epoch, from its start
            epoch = self._epoch
        elif point is not None:
            self._settle_resumed(point, self._first_asked(reports))
            return
        elif mine.world_size == self._world.world_size:
            if not all(r.at_end for r in reports):
                self._check_length(self._history, mine.world_size, consumed)  # the pass goes on
                return  # other slots still have items of this epoch
            epoch = self._epoch + 1
        else:
            history = (*self._history, Pass(mine.world_size, num_workers, consumed))
            if not consumed and not self._history:
                history = ()  # nothing consumed: the new world's normal epoch
            length = sum(
                self._stream.items_per_slot(
                    mine.world_size, num_workers, self._history, self._epoch
                )
            )
            epoch = self._epoch
            if consumed >= length:  # the pass, hence the epoch, was complete
                history, epoch = (), self._epoch + 1
            else:
                self._check_length(history, mine.world_size, consumed)
        slot = (self._world.worker - self._first_asked(reports)) % num_workers
        self._epoch, self._slot, self._yielded, self._history = epoch, slot, 0, history
        self._layer.progress.continue_after(self._counter, self._epoch)

    def _first_asked(self, reports: list[Restored]) -> int:
        """The worker torchdata asks first after restoring ``reports``: the one after the last
        item's (0 when nothing was consumed, or without a batch size: worker ``d`` plays slot ``d``)."""
        num_workers = self._world.num_workers
        consumed = sum(r.yielded for r in reports)
        if self._stream.batch_size is None or not consumed:
            return 0
        slots = [r.slot for r in reports]
        return (slots.index((consumed - 1) % num_workers) + 1) % num_workers

    def _settle_resumed(self, point: ResumePoint, first: int) -> None:
        """Go on from ``point`` (what ``ds.resume(state)`` was given), torchdata asking ``first`` first.

        The position given to ``resume`` is authoritative; the torchdata state
        only tells the worker rotation. A trainer that fetches a batch ahead
        (Lightning, in an epoch without ``len()``) saves a StatefulDataLoader
        state one batch per rank past what it trained; ``state_after`` of the
        last trained batch, given to ``resume``, puts the epoch back there.
        """
        world, num_workers = self._world, self._world.num_workers
        turn = (world.worker - first) % num_workers  # this worker's place in torchdata's rotation
        saved_world = point.world_size or world.world_size
        if (saved_world, point.num_workers) == (world.world_size, num_workers):  # the pass goes on
            self._history = point.history
            self._slot, self._yielded = rank_resume(point.batches, num_workers, turn)
        else:  # a new pass over what the saved one left
            self._history = (*point.history, Pass(saved_world, point.num_workers, point.batches))
            self._slot, self._yielded = turn, 0
        self._layer.progress.continue_after(self._counter, self._epoch)

    def _check_length(self, history: tuple[Pass, ...], saved_world: int, consumed: int) -> None:
        """Refuse a restored epoch of another length than ``len()`` can know of.

        ``history`` are the passes before the one this world streams now
        (none: a normal epoch). torchdata restores the state in the workers,
        after a trainer has read ``len()`` (Lightning reads it once per fit,
        before it loads the state, and ends every epoch at it): an epoch that
        takes another number of batches than a normal one would then be cut
        (the rest of it skipped) or end before the trainer's count (its
        end-of-epoch validation skipped), without a word. ``resume(state)``
        with the same state tells ``len()`` (a pending resume of this epoch).

        Raises:
            IncompatibleStateError: the restored epoch takes another number of
                batches than a normal one, and ``resume`` was not given it.
        """
        if not history or self._layer.progress.resume_for(self._epoch) is not None:
            return
        world = self._world
        needed = self._layer.epoch_length(self._epoch, history, world.world_size, world.num_workers)
        normal = self._stream.batches_per_rank(world.world_size)
        if needed == normal:
            return
        done = sum(p.batches for p in self._history) + consumed
        raise IncompatibleStateError(
            f"cannot resume epoch {self._epoch} at {world.world_size} ranks from this "
            f"StatefulDataLoader state through load_state_dict alone: it was saved at "
            f"{saved_world} ranks after {done} batches of the epoch, and the rest takes "
            f"{needed - done} more batches per rank here, {needed} in the epoch where a normal "
            f"epoch takes {normal}, which len() cannot know (the workers restore the state, "
            "after a trainer has read len(): Lightning would end the epoch after "
            f"{normal} batches, not where its data ends). Pass the same state to "
            "ds.resume(state) too, before len() is asked and the loader iterated (with "
            "Lightning: in train_dataloader(), ds.state_after(last trained batch) kept in the "
            "checkpoint by on_save_checkpoint, whose position wins over the loader state; see "
            "docs/integrations.md)",
            field="world_size",
            saved=saved_world,
            current=world.world_size,
        )
