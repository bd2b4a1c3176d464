"""MixedDataset and GroupedDataset: the torch layer over ``loader.mix`` and ``loader.groups``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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

    Args:
        sources, weights: as ``loader.mix.MixedStream``.
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


class GroupedDataset(TorchLayer):
    """Each group of ranks reads its own output, with equal steps on every rank (``loader.groups``).

    Args:
        groups: as ``loader.groups.GroupedStream``.
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
        super().__init__(GroupedStream(groups, output=TorchOutput(), **options), rank, world_size)
