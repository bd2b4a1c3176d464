"""The unit of work of the write stage: one shard, self-contained and picklable.

:class:`WriteContext` holds what the driver knows (inventory, selection,
plan); :meth:`WriteContext.task` cuts out one shard's :class:`ShardTask`:
its samples in write order (one shard's metadata, no more) and the output
options. A task's output depends on nothing else, which is what makes the
output byte-identical whatever engine, process or node runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shardprep.inventory import Inventory, SampleRef
from shardprep.weighting import Selection
from shardprep.write import ShardRecord, write_shard

__all__ = ["ShardTask", "WriteContext"]


@dataclass(frozen=True)
class ShardTask:
    """Everything needed to write shard ``index``: its samples in order and the output options."""

    index: int
    samples: list[SampleRef]
    out: str
    num_classes: int
    compression: str
    zstd_level: int

    def run(self, progress: Any = None) -> ShardRecord:
        """Write the shard (see :func:`shardprep.write.write_shard`)."""
        return write_shard(
            self.index,
            self.samples,
            self.out,
            self.num_classes,
            self.compression,
            self.zstd_level,
            progress,
        )


@dataclass(frozen=True)
class WriteContext:
    """Everything the driver knows to write any shard of the plan."""

    inventory: Inventory
    selection: Selection
    plan: list[np.ndarray]
    out: str
    compression: str
    zstd_level: int

    def samples(self, shard: int) -> list[SampleRef]:
        """Shard ``shard``'s samples in write order."""
        return self.selection.samples(self.inventory, self.plan[shard])

    def shard_size(self, shard: int) -> int:
        """Number of samples in shard ``shard``."""
        return len(self.plan[shard])

    def task(self, shard: int) -> ShardTask:
        """The self-contained task that writes shard ``shard``."""
        num_classes = len(self.inventory.class_names or ())
        return ShardTask(
            shard, self.samples(shard), self.out, num_classes, self.compression, self.zstd_level
        )

    def write(self, shard: int, progress: Any = None) -> ShardRecord:
        """Write shard ``shard`` here, in this process."""
        return self.task(shard).run(progress)
