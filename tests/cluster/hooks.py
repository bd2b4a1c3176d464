"""Test hooks for builds on a Ray cluster: where each write task ran, and a hold between a
shard's local write and its upload.

:class:`NodeWrite` is a write task (the ``EngineOptions.write_task`` seam) that, in the Ray
worker, appends ``<shard> <node id> <pid> <staging folder>`` to ``FOLDER/ran`` once the shard is
written on the node, then waits while ``FOLDER/hold-<shard>`` exists (at most
``HOLD_LIMIT_S``) before the upload; before the write, it appends the path of each part its
samples are read from to ``FOLDER/read-<shard>`` (the only hook of a build into a local
OUT, whose tasks do not upload). ``python -m tests.cluster.hooks FOLDER build ...`` runs
the CLI with every engine writing through it (run it from the repository root).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from shardprep.engine import write_task
from shardprep.engine.tasks import Progress, ShardTask
from shardprep.upload import ShardUpload
from shardprep.write import ShardRecord
from tests.engine.faulty import run_cli_through, write_tasks_through

HOLD_LIMIT_S = 120.0


def _node_id() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


def _held(
    folder: str, shard: int, write: Callable[[str], ShardRecord], staging: str
) -> ShardRecord:
    record = write(staging)
    with open(os.path.join(folder, "ran"), "a", encoding="utf-8") as log:
        log.write(f"{shard} {_node_id()} {os.getpid()} {staging}\n")
    hold = os.path.join(folder, f"hold-{shard}")
    deadline = time.monotonic() + HOLD_LIMIT_S
    while os.path.exists(hold):  # a test hook waiting for the test to remove a file
        if time.monotonic() > deadline:
            raise TimeoutError(f"{hold} still exists after {HOLD_LIMIT_S} s (test hook)")
        time.sleep(0.02)
    return record


@dataclass(frozen=True)
class _HeldUpload(ShardUpload):
    folder: str = ""
    shard: int = -1

    def write(self, write: Callable[[str], ShardRecord]) -> ShardRecord:
        return super().write(partial(_held, self.folder, self.shard, write))


@dataclass(frozen=True)
class NodeWrite:
    """The production write task, its upload preceded by the hooks of ``folder``."""

    folder: str

    def __call__(self, task: ShardTask, progress: Progress | None = None) -> ShardRecord:
        with open(os.path.join(self.folder, f"read-{task.index}"), "a", encoding="utf-8") as log:
            log.writelines(f"{p.path}\n" for s in task.samples() for p in s.parts)
        if task.upload is None:  # a local OUT every node shares: only the reads are logged
            return write_task(task, progress)
        held = _HeldUpload(
            task.upload.url,
            task.upload.storage_options,
            task.upload.interface,
            folder=self.folder,
            shard=task.index,
        )
        return write_task(replace(task, upload=held), progress)


def hooks_in(folder: Path) -> AbstractContextManager[None]:
    """While open, every engine of this process's builds writes through NodeWrite(folder)."""
    return write_tasks_through(NodeWrite(str(folder)))


def main(argv: list[str]) -> None:
    """``FOLDER ARGS...``: the shardprep CLI with ARGS, its writes through NodeWrite(FOLDER)."""
    run_cli_through(NodeWrite(argv[0]), argv[1:])


if __name__ == "__main__":  # the hooks' classes must be this module's, not __main__'s
    from tests.cluster.hooks import main as hooks_main

    hooks_main(sys.argv[1:])
