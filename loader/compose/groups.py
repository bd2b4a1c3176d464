"""Groups: datasets pinned to groups of ranks, every rank taking the same steps per epoch. No torch.

``GroupedStream([("A", [0, 1]), ("B", [2, 3])], batch_size=32)``: ranks 0
and 1 split output A between them, ranks 2 and 3 split B. DDP needs every
rank to take the same number of steps, so the epoch length is one number of
steps ``S`` for all:

* ``steps_per_epoch=None`` (default): the smallest group's epoch in full
  batches, ``S = min over groups of T_g // (size_g * B)`` (``T_g`` the
  group's samples after class weights). Groups with more data stream a
  different part of it each epoch (they are read in laps, as mixture sources:
  ``loader.compose.mix.lap_ranges``), so over epochs they still see all of it.
* ``steps_per_epoch=S``: exactly ``S`` steps; a group with too few samples
  repeats them (up-sampling by laps, each lap a new order).

Every rank of group ``g`` streams ``S * B`` samples per epoch, in ``S``
full batches; within an epoch the ranks of a group stream disjoint samples
as long as ``S * B * size_g <= T_g`` (always so with the default).
Each group is a one-source ``MixedStream`` over the group's ranks, so it reads
as a mixture source does: read-ahead and cache for a URL, the source's ``on_error``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from loader.compose.mix import MixedStream, _refuse_elastic
from loader.core import ShardStream
from loader.errors import WorldMismatchError
from loader.plan.elastic import Pass
from loader.plan.state import STATE_VERSION
from loader.plan.world import World
from loader.read.output import Output

__all__ = ["GroupedStream", "group_of"]


def group_of(rank: int, groups: Sequence[Sequence[int]]) -> tuple[int, int, int]:
    """(group, rank within the group, group size) of global ``rank``.

    Raises:
        WorldMismatchError: ``rank`` is in no group.
    """
    for g, ranks in enumerate(groups):
        if rank in ranks:
            return g, list(ranks).index(rank), len(ranks)
    raise WorldMismatchError(f"rank {rank} is in none of the rank groups {list(groups)}")


class GroupedStream:
    """Each group of ranks reads its own dataset; all ranks take ``steps`` batches per epoch."""

    elastic = False  # resumes at the world size and num_workers it was saved at only

    def __init__(
        self,
        groups: Sequence[tuple[str | ShardStream, Sequence[int]]],
        *,
        batch_size: int,
        steps_per_epoch: int | None = None,
        seed: int = 0,
        output: Output | None = None,
    ) -> None:
        ranks = [r for _, members in groups for r in members]
        if not groups or sorted(ranks) != list(range(len(ranks))):
            raise WorldMismatchError(
                f"rank groups must hold the ranks 0..W-1 once each, not {[list(m) for _, m in groups]}"
            )
        self.ranks = [list(members) for _, members in groups]
        self.group_world = len(ranks)
        self.batch_size, self.seed = batch_size, seed
        sources = [s if isinstance(s, ShardStream) else ShardStream(s) for s, _ in groups]
        if steps_per_epoch is None:
            steps_per_epoch = min(
                s.total // (len(m) * batch_size) for s, m in zip(sources, self.ranks, strict=True)
            )
            if steps_per_epoch == 0:
                raise WorldMismatchError(
                    "a rank group has fewer samples than one batch per rank: give "
                    "steps_per_epoch to repeat its samples, or a smaller batch_size"
                )
        if steps_per_epoch < 0:
            raise ValueError(f"steps_per_epoch must be non-negative, not {steps_per_epoch}")
        self.steps = steps_per_epoch
        self.streams = [
            MixedStream(
                [source],
                [1.0],
                batch_size=batch_size,
                samples_per_epoch=self.steps * batch_size * len(members),
                seed=seed,
                output=output,
            )
            for source, members in zip(sources, self.ranks, strict=True)
        ]
        self.batch_size = batch_size

    def _check(self, world_size: int) -> None:
        if world_size != self.group_world:
            raise WorldMismatchError(
                f"the rank groups {self.ranks} make a world of {self.group_world}, not {world_size}"
            )

    def samples_per_rank(self, world_size: int) -> int:
        """Samples every rank streams per epoch: ``steps * batch_size``."""
        self._check(world_size)
        return self.steps * self.batch_size

    def batches_per_rank(self, world_size: int) -> int:
        """Batches every rank yields per epoch: ``steps``."""
        self._check(world_size)
        return self.steps

    def items_per_slot(
        self, world_size: int, num_workers: int, history: Sequence[Pass] = (), epoch: int = 0
    ) -> list[int]:
        _refuse_elastic(history)
        return [
            len(range(w, self.batches_per_rank(world_size), num_workers))
            for w in range(num_workers)
        ]

    def iterate(
        self, epoch: int, *, rank: int, worker: int = 0, num_workers: int = 1, start: int = 0
    ) -> Iterator[Any]:
        """Batches of worker ``worker`` of global rank ``rank`` in ``epoch``."""
        return self.items(epoch, World(rank, self.group_world, worker, num_workers), start)

    def items(
        self, epoch: int, world: World, skip: int, history: Sequence[Pass] = ()
    ) -> Iterator[Any]:
        """Slot ``world.worker``'s batches of global rank ``world.rank``: its group's stream."""
        _refuse_elastic(history)
        self._check(world.world_size)
        g, rank, size = group_of(world.rank, self.ranks)
        return self.streams[g].items(
            epoch, World(rank, size, world.worker, world.num_workers), skip
        )

    def options_fingerprint(self, world_size: int, num_workers: int) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "groups": [
                s.options_fingerprint(len(m), 0)["sources"]
                for s, m in zip(self.streams, self.ranks, strict=True)
            ],
            "ranks": self.ranks,
            "steps": self.steps,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "world_size": world_size,
            "num_workers": num_workers,
        }
