"""MixedDataset and GroupedDataset: the torch layer over ``loader.compose.mix`` and ``loader.compose.groups``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loader.compose.groups import GroupedStream
from loader.compose.mix import MixedPlan, MixedStream, PerSourcePlan
from loader.core import ShardStream
from loader.torch.layer import TorchLayer
from loader.torch.output import TorchOutput

__all__ = ["GroupedDataset", "MixedDataset"]


class MixedDataset(TorchLayer):
    """Several shardprep outputs as one torch IterableDataset of batches (see ``loader.compose.mix``).

    Use it as ``ShardDataset(batch_size=...)``: ``DataLoader(ds, batch_size=None)``,
    ``len(ds)`` batches per rank, ``set_epoch``, ``state_after``/``resume`` (same
    world size and ``num_workers``) or torchdata's ``StatefulDataLoader``. Every
    sample carries ``__source__``, the index of its source.

    Args:
        sources, weights: as ``loader.compose.mix.MixedStream``.
        rank, world_size: override ``torch.distributed`` (pass both or neither).
        options: the other arguments of ``MixedStream`` (``batch_size``,
            ``samples_per_epoch``, ``batching``, ``drop_last``, ``seed``).
    """

    def __init__(
        self,
        sources: Sequence[str | ShardStream],
        weights: Sequence[float],
        *,
        rank: int | None = None,
        world_size: int | None = None,
        **options: Any,
    ) -> None:
        stream = MixedStream(sources, weights, output=TorchOutput(), **options)
        super().__init__(stream, rank, world_size)
        self.stream: MixedStream = stream

    # The counts and plans of docs/mixing.md, from the stream (the one implementation).

    def counts(self, world_size: int) -> list[int]:
        """Samples of each source every rank streams per epoch (``m_i``)."""
        return self.stream.counts(world_size)

    def epoch_counts(self, world_size: int) -> list[int]:
        """Samples of each source the whole epoch holds (``W * m_i``), ``drop_last`` aside."""
        return self.stream.epoch_counts(world_size)

    def samples_per_rank(self, world_size: int) -> int:
        """Samples every rank receives per epoch (``sum(counts(W))``, before ``drop_last``)."""
        return self.stream.samples_per_rank(world_size)

    def batches_per_rank(self, world_size: int) -> int:
        """Batches every rank yields per epoch (``len(ds)`` at that world size)."""
        return self.stream.batches_per_rank(world_size)

    def plan(self, epoch: int, world_size: int) -> MixedPlan | PerSourcePlan:
        """A rank's batch plan of ``epoch`` (the same on every rank), computed batch by batch.

        ``len(plan)`` batches; ``plan.row(j)`` (``"mixed"``) the samples of each source in
        batch ``j``; ``list(plan)`` one row per batch (small epochs only).
        """
        return self.stream.plan(epoch, world_size)


class GroupedDataset(TorchLayer):
    """Each group of ranks reads its own output, with equal steps on every rank (``loader.compose.groups``).

    Args:
        groups: as ``loader.compose.groups.GroupedStream``.
        rank, world_size: override ``torch.distributed`` (pass both or neither).
        options: the other arguments of ``GroupedStream`` (``batch_size``,
            ``steps_per_epoch``, ``seed``).
    """

    def __init__(
        self,
        groups: Sequence[tuple[str | ShardStream, Sequence[int]]],
        *,
        rank: int | None = None,
        world_size: int | None = None,
        **options: Any,
    ) -> None:
        stream = GroupedStream(groups, output=TorchOutput(), **options)
        super().__init__(stream, rank, world_size)
        self.stream: GroupedStream = stream

    def samples_per_rank(self, world_size: int) -> int:
        """Samples every rank streams per epoch: ``steps * batch_size`` (any group)."""
        return self.stream.samples_per_rank(world_size)

    def batches_per_rank(self, world_size: int) -> int:
        """Batches every rank yields per epoch: ``steps`` (``len(ds)``)."""
        return self.stream.batches_per_rank(world_size)
