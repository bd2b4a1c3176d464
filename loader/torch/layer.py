"""TorchLayer: what makes a torch IterableDataset of a core stream (``ShardStream``, ``MixedStream``).

The core decides what each (epoch, rank, world size, worker) reads; this
layer finds those values in a torch job: the rank from ``torch.distributed``
when an epoch starts, the worker from the DataLoader, the epoch from counters
in shared memory (``loader.torch.epochs``); and it gives ``len()``, ``set_epoch``,
``state_after``/``resume`` and the per-worker iterator torchdata checkpoints
(``loader.torch.stream.EpochStream``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

# torch's DataLoader worker loop seeds numpy.random in every worker it starts (every epoch,
# unless persistent_workers): imported here, in the parent, the forked workers inherit it
# instead of each importing it before its first batch (about 13 ms per worker measured).
import numpy.random  # noqa: F401
import torch.utils.data

from loader.errors import IncompatibleStateError, WorldMismatchError
from loader.plan.elastic import Pass, epoch_batches
from loader.plan.state import Position, ResumeState, next_position, parse_history, rank_state
from loader.plan.world import World
from loader.read.telemetry import EpochStats, Timed
from loader.torch.batch import POSITION
from loader.torch.epochs import ResumePoint, SharedProgress
from loader.torch.guards import check_not_rebatched, check_not_resplit
from loader.torch.lifeline import freeze_inherited, tie_unpickled, watch_trainer
from loader.torch.stream import EpochStream

__all__ = ["Stream", "TorchLayer"]

T = TypeVar("T")


class Stream(Protocol):
    """What the torch layer needs of a core stream (``ShardStream``, ``MixedStream``, ...)."""

    @property
    def batch_size(self) -> int | None:
        """Samples per item, or None for single samples."""
        ...

    @property
    def elastic(self) -> bool:
        """Whether a state saved at another world size or ``num_workers`` can be resumed."""
        ...

    def samples_per_rank(self, world_size: int) -> int:
        """Samples every rank receives per epoch."""
        ...

    def batches_per_rank(self, world_size: int) -> int:
        """Batches every rank yields per epoch."""
        ...

    def items_per_slot(
        self, world_size: int, num_workers: int, history: Sequence[Pass] = (), epoch: int = 0
    ) -> list[int]:
        """Items each worker slot yields in a pass."""
        ...

    def items(
        self, epoch: int, world: World, skip: int, history: Sequence[Pass] = ()
    ) -> Iterator[Any]:
        """Slot ``world.worker``'s items of ``epoch`` after its first ``skip``."""
        ...

    def options_fingerprint(self, world_size: int, num_workers: int) -> dict[str, Any]:
        """The options a resume state must share with this run."""
        ...


class TorchLayer(torch.utils.data.IterableDataset[Any]):
    """The torch side of a dataset: it holds a core ``Stream`` and finds the world it runs in."""

    def __init__(self, stream: Stream, rank: int | None, world_size: int | None) -> None:
        super().__init__()
        if rank is not None or world_size is not None:
            resolve_rank(rank, world_size)  # validates an explicit pair now
        self.stream = stream
        self._rank_override = (rank, world_size)
        self._inherited_rank: tuple[int, int] | None = None
        self.progress = SharedProgress()
        self._lengths: dict[tuple[ResumePoint, int], int] = {}  # resumed epochs' len()

    @property
    def batch_size(self) -> int | None:
        """Samples per batch the dataset yields (None: single samples)."""
        return self.stream.batch_size

    # --- world, epoch and length ----------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank, resolved now (see ``resolve_rank`` below)."""
        return self._world()[0]

    @property
    def world_size(self) -> int:
        """The number of ranks, resolved now."""
        return self._world()[1]

    def _world(self) -> tuple[int, int]:
        return resolve_rank(*self._rank_override, self._inherited_rank)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration streams."""
        return self.progress.next_epoch()

    def set_epoch(self, epoch: int) -> None:
        """Stream ``epoch`` next (as ``DistributedSampler.set_epoch``), in every worker.

        Without calls, each iteration streams the epoch after the previous one.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, not {epoch}")
        self.progress.set_epoch(epoch)

    @property
    def num_samples(self) -> int:
        """Samples every rank receives per epoch (before a ``drop_last`` of its last batch)."""
        return self.stream.samples_per_rank(self.world_size)

    def __len__(self) -> int:
        """Batches every rank yields per epoch (needs ``batch_size``).

        An epoch resumed at another world (``resume`` of a state saved at
        another world size, or during a pass that began at one) usually takes
        another number of batches than a normal epoch: those its earlier
        passes took plus those of the pass at this world (``epoch_length``).
        No single number then holds for every epoch, and a trainer that reads
        ``len()`` once and counts every epoch to it (Lightning) would skip
        batches of one epoch or end another before its count. So there is no
        ``len()`` (``TypeError``, which Lightning takes for an unsized loader:
        it then ends each epoch where its data ends) from ``resume`` until a
        later epoch's pass starts or ``set_epoch`` names another epoch. A
        torchdata state loaded into the DataLoader alone cannot reach
        ``len()`` (its workers restore it); one whose epoch would take another
        number of batches than a normal epoch is refused unless ``resume`` was
        given it too (``EpochStream``).

        Raises:
            TypeError: no ``batch_size`` (the number of batches is the
                DataLoader's, which cannot count it exactly with several
                workers), or an epoch resumed at another world whose batches
                differ from a normal epoch's.
        """
        if self.batch_size is None:
            raise TypeError(
                "ShardDataset has no len() without batch_size: a DataLoader that batches single "
                "samples from several workers makes more batches than len() would say. Use "
                "ShardDataset(..., batch_size=B) with DataLoader(ds, batch_size=None), or "
                "ds.num_samples for the per-rank sample count"
            )
        world_size = self.world_size
        length = self.stream.batches_per_rank(world_size)
        point = self.progress.pending_resume()
        resumed = length if point is None else self._resumed_length(point, world_size)
        if point is not None and resumed != length:
            done = sum(p.batches for p in point.history) + point.batches
            raise TypeError(
                f"ShardDataset has no len() in the epoch it resumes at another world: epoch "
                f"{point.epoch} resumed at {world_size} ranks takes {resumed} batches per rank "
                f"(those before the restart included), a normal epoch {length}, and a trainer "
                "that counts every epoch to one len() (Lightning reads it once per fit) would "
                "cut one of them short or end it before its count. Without len(), Lightning ends "
                f"each epoch where its data ends. A loop of your own: this pass yields "
                f"{resumed - done} more batches per rank ({done} were trained before the "
                "restart); iterate the loader to its end, or count that many for a schedule. "
                "len() is back once the next epoch's pass has started (the next iter() of the "
                "loader) or after set_epoch of another epoch"
            )
        return length

    def epoch_length(
        self, epoch: int, history: Sequence[Pass], world_size: int, num_workers: int
    ) -> int:
        """Batches a rank takes in ``epoch`` after its earlier passes ``history``, ending at this world.

        The earlier passes' batches plus those of the pass ``world_size`` x
        ``num_workers`` streams over what they left: where a trainer that
        counts the epoch's batches across restarts (Lightning) ends it.
        """
        pass_batches = sum(self.stream.items_per_slot(world_size, num_workers, history, epoch))
        return epoch_batches(history, pass_batches)

    def _resumed_length(self, point: ResumePoint, world_size: int) -> int:
        """``epoch_length`` of the epoch ``point`` resumes, at ``world_size`` (memoized)."""
        saved_world = point.world_size or world_size
        if saved_world == world_size and not point.history:
            return self.stream.batches_per_rank(world_size)  # a normal epoch
        key = (point, world_size)
        if key not in self._lengths:
            if saved_world == world_size:  # the same pass goes on
                history, workers = point.history, point.num_workers
            else:  # a new pass; its batches per rank do not depend on num_workers
                saved = Pass(saved_world, point.num_workers, point.batches)
                history, workers = (*point.history, saved), 1
            self._lengths[key] = self.epoch_length(point.epoch, history, world_size, workers)
        return self._lengths[key]

    # --- iteration ----------------------------------------------------------------

    def __iter__(self) -> EpochStream:
        info = worker_info()  # None in the main process (num_workers=0)
        if info is not None:
            # first, before anything here can raise: a worker whose iteration is refused (the
            # guards below) stays alive, waiting for work, and must still die with its trainer
            watch_trainer()  # this worker exits when its training process dies (loader.torch.lifeline)
        check_not_resplit()
        check_not_rebatched(self.batch_size)
        if info is not None:
            freeze_inherited()  # a full collection here must not copy the parent's heap
        worker, num_workers = info or (0, 1)
        rank, world_size = self._world()
        counter = None if info is None else worker
        epoch, explicit = self.progress.claim(counter)
        world = World(rank, world_size, worker, num_workers)
        return EpochStream(self, epoch, world, counter, explicit)

    # --- telemetry ----------------------------------------------------------------

    def epoch_stats(self) -> EpochStats:
        """Where this rank's latest pass spent its time (``loader.read.telemetry``).

        Samples and batches handed out, seconds by stage added over the rank's DataLoader
        workers (their counters are in shared memory), and the training loop's wait and
        compute: measured in ``__next__`` with ``num_workers=0``, through ``timed(loader)``
        with workers (None otherwise). Ask after the epoch's last batch and before the
        next ``iter()`` of the loader (its workers then start the next pass);
        ``.as_dict()`` is a flat dict to log.
        """
        return self.progress.epoch_stats()

    def timed(self, loader: Iterable[T]) -> Timed[T]:
        """``loader`` (a DataLoader over this dataset) iterated with the training loop's wait
        for each batch and the time between batches counted, for ``epoch_stats``.

        With DataLoader workers the main process never calls into the dataset: only
        around ``next()`` on the loader's iterator is the loop's wait seen. With
        ``num_workers=0`` the dataset sees it itself and ``loader`` is passed through.
        """
        workers = loader.num_workers if isinstance(loader, torch.utils.data.DataLoader) else 1
        return Timed(loader, self.progress.main_row() if workers > 0 else None)

    # --- resume -------------------------------------------------------------------

    def fingerprint(self, num_workers: int) -> dict[str, Any]:
        """The options a resume state must share with this run (they fix the order)."""
        return self.stream.options_fingerprint(self.world_size, num_workers)

    def state_after(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The resume state once ``batch`` (one this dataset yielded) has been trained on.

        For a plain ``torch.utils.data.DataLoader``: the position is read off
        the batch itself, so it is right whatever the caller counted. Save
        the small JSON-able dict with the checkpoint (it is the same on every
        rank) and pass it to :meth:`resume`, at the same or another world size
        and ``num_workers`` (elastic resume). With torchdata's
        ``StatefulDataLoader`` use its ``state_dict()`` instead: restored by
        ``load_state_dict`` at the same ``num_workers`` only (torchdata asserts
        it), at any world size (given to :meth:`resume` too where the resumed
        epoch's length differs, see ``__len__``), or by :meth:`resume` with a
        fresh loader at any ``num_workers``.

        The state holds the options that fix the order (including the world
        size and ``num_workers`` it was saved at), ``epoch``, ``batches`` (the
        batches every rank had consumed in the current pass) and ``history``
        (the earlier passes of this epoch, ``[world_size, num_workers,
        batches]`` each, after elastic resumes; usually empty).

        Raises:
            TypeError: ``batch`` did not come from a ShardDataset with a batch size.
        """
        position = batch.get(POSITION) if isinstance(batch, Mapping) else None
        if not isinstance(position, Mapping):
            raise TypeError(
                "state_after() needs a batch yielded by ShardDataset(batch_size=...) (it carries "
                f"{POSITION!r}); without a batch size, resume through torchdata's "
                "StatefulDataLoader"
            )
        return ResumeState(
            self.fingerprint(int(position["num_workers"])),
            int(position["epoch"]),
            parse_history(position.get("history", [])),
            batches=int(position["batch"]) + 1,
        ).as_dict()

    def next_position(self, state: Mapping[str, Any]) -> Position:
        """Where a loop resumed from ``state`` continues: ``(epoch, batch)``.

        ``state`` is :meth:`state_after`'s dict or a torchdata
        ``StatefulDataLoader.state_dict()``. ``batch`` counts the items of
        that epoch's pass already consumed; a state saved on an epoch's last
        batch gives the next epoch and 0, as resuming it does. So a loop runs
        ``for epoch in range(ds.next_position(state).epoch, EPOCHS)``.

        Raises:
            IncompatibleStateError: not a state of this kind of dataset.
        """

        def pass_items(epoch: int, world_size: int, num_workers: int) -> int:
            history = parse_history(state.get("history", [])) if "batches" in state else ()
            return sum(self.stream.items_per_slot(world_size, num_workers, history, epoch))

        return next_position(state, pass_items)

    def resume(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved state: the next pass streams the rest of that epoch.

        ``state`` is :meth:`state_after`'s result or a torchdata
        ``StatefulDataLoader.state_dict()`` (its workers' positions add up to
        the rank's, ``loader.plan.state.rank_state``). Call it before iterating the
        DataLoader (it reaches persistent workers too); with a
        StatefulDataLoader state, iterate a new StatefulDataLoader without
        calling its ``load_state_dict``. The epochs after it follow as usual.
        A state saved on an epoch's last batch makes the next pass the
        following epoch.

        The world may differ from the one the state was saved at (another
        world size, another ``num_workers``): the samples of the epoch not yet
        consumed are then re-split over the new world (``loader.plan.elastic``), and
        the next epochs are the new world's normal ones; ``len()`` may be
        absent in the resumed epoch (see ``__len__``). Every rank must call
        ``resume`` with the same state (``state_after`` gives the same on all;
        a StatefulDataLoader's state holds the same positions on all ranks of
        a DDP job, so rank 0's serves all).

        Raises:
            IncompatibleStateError: the state is from another build, seed,
                option set or batch size; or it is past the pass's end.
        """
        current = self.stream.options_fingerprint(self.world_size, 1)
        if isinstance(state, Mapping) and "batches" in state:
            saved = ResumeState.parse(state, current, elastic=True)
        else:
            saved = rank_state(state, current)
        if not self.stream.elastic and saved.world_size != self.world_size:
            raise IncompatibleStateError.field_differs(
                "world_size",
                saved.world_size,
                self.world_size,
                f"a {type(self).__name__} resumes at the same world size only",
            )
        if self.batch_size is None:
            raise IncompatibleStateError.field_differs(
                "batch_size", None, saved.options["batch_size"]
            )
        epoch, batches = saved.epoch, int(saved.batches or 0)
        length = sum(
            self.stream.items_per_slot(saved.world_size, saved.num_workers, saved.history, epoch)
        )
        if batches > length:
            raise IncompatibleStateError.field_differs("batches", batches, f"at most {length}")
        if batches == length:  # the pass, hence the epoch, was complete
            self.set_epoch(epoch + 1)
            return
        if batches == 0 and not saved.history:  # nothing consumed: the new world's normal epoch
            self.set_epoch(epoch)
            return
        self.progress.set_resume(
            ResumePoint(epoch, batches, saved.num_workers, saved.world_size, saved.history)
        )

    # --- pickling (DataLoader workers) -------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        # A spawned or forkserver worker has no process group: hand it the rank resolved here.
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            state["_inherited_rank"] = (dist.get_rank(), dist.get_world_size())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # A forkserver worker gets this dataset with its arguments, before any index or user
        # code (a wrapper's __iter__, a worker_init_fn): it is tied to its trainer from then
        # on, not only once it iterates (loader.torch.lifeline)
        tie_unpickled(self)


def worker_info() -> tuple[int, int] | None:
    """(worker id, number of workers) of this DataLoader worker; None in the main process."""
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    return None if info is None else (info.id, info.num_workers)


def resolve_rank(
    rank: int | None, world_size: int | None, inherited: tuple[int, int] | None = None
) -> tuple[int, int]:
    """(rank, world_size) now: explicit values, else torch.distributed, else the parent's, else (0, 1).

    Read when it is needed (when an epoch starts, or ``len()`` is asked), never when the
    dataset is built: a dataset made before ``init_process_group`` (in a LightningModule's
    ``__init__``, say) still splits by the rank it ends up running on.

    ``inherited`` is what the main process had resolved when it handed the
    dataset to a spawned DataLoader worker (which has no process group).

    Raises:
        WorldMismatchError: only one of rank/world_size given, or the process
            was launched as one of several ranks (``WORLD_SIZE`` > 1) but
            ``torch.distributed`` is not initialized yet: guessing rank 0
            would give every rank the same data.
    """
    if (rank is None) != (world_size is None):
        raise WorldMismatchError("pass both rank and world_size, or neither")
    if rank is not None and world_size is not None:
        World(rank, world_size)  # validates
        return rank, world_size
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if inherited is not None:
        return inherited
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1:
        raise WorldMismatchError(
            f"this process was launched as one of WORLD_SIZE={launched} ranks, but "
            "torch.distributed is not initialized yet, so its rank is unknown: iterate (or ask "
            "len()) after init_process_group, or pass rank= and world_size= explicitly"
        )
    return 0, 1
