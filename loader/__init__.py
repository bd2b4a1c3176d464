"""loader: stream shardprep shards into (distributed) training.

``from loader import ShardDataset`` is the torch entry point. The stages are the
sub-packages, lowest first: ``plan`` (what each rank and worker reads, pure), ``io``
(where the bytes come from, and the one read engine: ``io.executor``, ``io.readahead``),
``read`` (bytes to checked samples, decoded), composed in ``core.ShardStream`` (and
``compose`` for mixtures), which ``torch.dataset.ShardDataset`` wraps as a torch
``IterableDataset``. docs/architecture.md draws the map. Importing the package (and ``loader.core``) does
not import torch: ``ShardDataset`` is imported on first access, and
``loader.core.ShardStream`` serves JAX, TensorFlow and NumPy users without
torch installed. ``shardprep`` does not import the loader.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loader.errors import (
    CorruptShardError,
    IncompatibleStateError,
    LoaderError,
    UnreachableError,
    WorldMismatchError,
)
from loader.io.options import RemoteOptions
from loader.options import ReadOptions
from loader.plan.world import World

if TYPE_CHECKING:
    from loader.torch.dataset import ShardDataset
    from loader.torch.mixdataset import GroupedDataset, MixedDataset

__all__ = [
    "CorruptShardError",
    "GroupedDataset",
    "IncompatibleStateError",
    "LoaderError",
    "MixedDataset",
    "ReadOptions",
    "RemoteOptions",
    "ShardDataset",
    "UnreachableError",
    "World",
    "WorldMismatchError",
]


def __getattr__(name: str) -> Any:
    """The torch datasets import torch when first asked for (``loader.ShardDataset``, ...)."""
    if name == "ShardDataset":
        from loader.torch.dataset import ShardDataset

        return ShardDataset
    if name in ("MixedDataset", "GroupedDataset"):
        from loader.torch import mixdataset

        return getattr(mixdataset, name)
    raise AttributeError(f"module 'loader' has no attribute {name!r}")
