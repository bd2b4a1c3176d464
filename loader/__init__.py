"""loader: stream shardprep shards into (distributed) PyTorch training.

``from loader import ShardDataset`` is the entry point; the stages are the
modules ``order`` → ``partition`` → ``read`` → ``shuffle`` → ``decode``,
composed in ``dataset``. This package imports torch; ``shardprep`` does not.
"""

from __future__ import annotations

from loader.dataset import ShardDataset
from loader.errors import (
    CorruptShardError,
    IncompatibleStateError,
    LoaderError,
    UnreachableError,
    WorldMismatchError,
)
from loader.options import ReadOptions
from loader.source import RemoteOptions
from loader.world import World

__all__ = [
    "CorruptShardError",
    "IncompatibleStateError",
    "LoaderError",
    "ReadOptions",
    "RemoteOptions",
    "ShardDataset",
    "UnreachableError",
    "World",
    "WorldMismatchError",
]
