"""MixedDataset and GroupedDataset: the torch layer over ``loader.mix`` and ``loader.groups``."""

from __future__ import annotations

from collections.abc import Sequence

from loader.core import ShardStream
from loader.groups import GroupedStream
from loader.mix import MixedStream
from loader.torchlayer import TorchLayer
from loader.torchoutput import TorchOutput

__all__ = ["GroupedDataset", "MixedDataset"]


class MixedDataset(TorchLayer):
    """Several shardprep outputs as one torch IterableDataset of batches (see ``loader.mix``).

    Use it as ``ShardDataset(batch_size=...)``: ``DataLoader(ds, batch_size=None)``,
    ``len(ds)`` batches per rank, ``set_epoch``, ``state_after``/``resume`` (same
    world size and ``num_workers``) or torchdata's ``StatefulDataLoader``. Every
    sample carries ``__source__``, the index of its source.
    """

    def __init__(
        self,
        sources: Sequence[str | ShardStream],
        weights: Sequence[float],
        *,
        batch_size: int,
        samples_per_epoch: int | None = None,
        batching: str = "mixed",
        drop_last: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        stream = MixedStream(
            sources,
            weights,
            batch_size=batch_size,
            samples_per_epoch=samples_per_epoch,
            batching=batching,
            drop_last=drop_last,
            seed=seed,
            output=TorchOutput(),
        )
        super().__init__(stream, rank, world_size)


class GroupedDataset(TorchLayer):
    """Each group of ranks reads its own output, with equal steps on every rank (``loader.groups``)."""

    def __init__(
        self,
        groups: Sequence[tuple[str | ShardStream, Sequence[int]]],
        *,
        batch_size: int,
        steps_per_epoch: int | None = None,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        stream = GroupedStream(
            groups,
            batch_size=batch_size,
            steps_per_epoch=steps_per_epoch,
            seed=seed,
            output=TorchOutput(),
        )
        super().__init__(stream, rank, world_size)
