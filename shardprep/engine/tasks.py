"""The unit of work of the write stage: one shard, self-contained and picklable.

:class:`WriteContext` holds the plan (:class:`~shardprep.plan_store.PlannedShards`,
one file per shard on disk); :meth:`WriteContext.task` reads one shard's
:class:`ShardTask`: its samples' metadata in write order, as numpy columns (an
:class:`~shardprep.inventory.Inventory` and a
:class:`~shardprep.weighting.Selection` of that shard only: cheap to cut
and to pickle, no Python object per sample), and the output options. The
task turns its columns into ``SampleRef``s where it runs. A task's output
depends on nothing else, which is what makes the output byte-identical
whatever engine, process or node runs it.

Engines run every task through a :data:`WriteTask` (by default :func:`write_task`, which
just runs it): the seam where a test wraps the write with fault hooks (tests/engine/faulty.py),
so no production code reads a test-only switch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardprep.inventory import Inventory, SampleRef
from shardprep.out_lock import OutLock
from shardprep.plan_store import PlannedShards
from shardprep.transform import SampleMap
from shardprep.upload import ShardUpload, UploadError
from shardprep.weighting import Selection
from shardprep.write import ResumableWriteError, ShardRecord, write_shard

__all__ = ["Progress", "ShardTask", "WriteContext", "WriteTask", "write_task"]

Progress = Callable[[int], None]


@dataclass(frozen=True)
class ShardTask:
    """Everything needed to write shard ``index``: its samples in order and the output options."""

    index: int
    inventory: Inventory  # this shard's samples only, in write order
    selection: Selection  # their copy numbers and weights
    out: str
    num_classes: int
    compression: str
    zstd_level: int
    storage_options: Mapping[str, Any] | None = None  # RAW's: for inputs read by URL
    transform: SampleMap | None = None  # --map: run on every sample before it is written
    upload: ShardUpload | None = None  # set: write on this node, then upload into OUT

    def samples(self) -> list[SampleRef]:
        """The shard's samples in write order."""
        return self.selection.samples(self.inventory, np.arange(len(self.inventory)))

    def run(self, progress: Any = None) -> ShardRecord:
        """Write the shard (see :func:`shardprep.write.write_shard`) into ``out``, or, with
        ``upload``, into a staging folder here and then into OUT (:mod:`shardprep.upload`).

        Raises:
            WriteError: as ``write_shard``, or the upload failed (a
                :class:`~shardprep.write.ResumableWriteError` naming shard and URL).
        """
        if self.upload is None:
            return self._write(self.out, progress)
        try:
            return self.upload.write(lambda folder: self._write(folder, progress))
        except UploadError as err:
            raise ResumableWriteError(f"shard {self.index}: {err.strerror}", self.index) from err

    def _write(self, folder: str, progress: Any) -> ShardRecord:
        return write_shard(
            self.index,
            self.samples(),
            folder,
            self.num_classes,
            self.compression,
            self.zstd_level,
            progress,
            self.storage_options,
            self.transform,
        )


@dataclass(frozen=True)
class WriteContext:
    """Everything the driver knows to write any shard of the plan (the plan lives on disk)."""

    plan: PlannedShards
    out: str  # the folder shard files are written into (a remote build's staging area)
    compression: str
    zstd_level: int
    storage_options: Mapping[str, Any] | None = None  # RAW's: for inputs read by URL
    transform: SampleMap | None = None  # --map (picklable: by name, else by value)
    upload: ShardUpload | None = None  # set: each task uploads its shard into OUT itself
    out_lock: OutLock | None = None  # a local OUT's lock: every writer process holds it too
    first_shard: int = 0  # the plan's shard 0 is OUT's shard first_shard (an append: after OUT's)

    @property
    def root(self) -> str:
        """The input's root folder (or ``protocol://`` for inputs listed by URL)."""
        return self.plan.root

    def __len__(self) -> int:
        return len(self.plan)

    def samples(self, shard: int) -> list[SampleRef]:
        """Shard ``shard``'s samples in write order."""
        return self.task(shard).samples()

    @property
    def shards(self) -> range:
        """OUT's shard numbers this plan writes."""
        return range(self.first_shard, self.first_shard + len(self.plan))

    def shard_size(self, shard: int) -> int:
        """Number of samples in OUT's shard ``shard``."""
        return self.plan.shard_size(shard - self.first_shard)

    def task(self, shard: int) -> ShardTask:
        """The self-contained task that writes OUT's shard ``shard`` (read from the plan's files)."""
        _, inventory, selection = self.plan.load(shard - self.first_shard)
        return ShardTask(
            shard,
            inventory,
            selection,
            self.out,
            len(self.plan.class_names or ()),
            self.compression,
            self.zstd_level,
            self.storage_options,
            self.transform,
            self.upload,
        )


WriteTask = Callable[[ShardTask, Progress | None], ShardRecord]
"""Writes one task in a worker, reporting samples to ``progress`` (None: no reports).

A module-level function or an instance of a module-level class: the Ray engine pickles it
into its tasks, and the local engine into spawned workers."""


def write_task(task: ShardTask, progress: Progress | None = None) -> ShardRecord:
    """The production :data:`WriteTask`: write the shard."""
    return task.run(progress)
