"""Fault injection for the engine tests: a write task that fails, crashes or waits on request.

:class:`FaultyWrite` wraps the production write task (``shardprep.engine.write_task``) with
hooks driven by files in a folder, so a test sets up a fault by creating a file:

- every write attempt appends ``<shard>`` to ``attempts``;
- ``fail-<shard>``: the next write of that shard fails once with a transient EIO (the file is
  removed when it fires);
- ``deny-<shard>``: every write of it fails with EACCES (not transient);
- ``crash-<shard>``: every write of it ends its own worker process at once (``os._exit``, as if
  the kernel's OOM killer had struck);
- ``hold-<shard>``: the write of that shard waits until the file is removed (at most
  ``HOLD_LIMIT_S`` seconds).

:func:`faults_in` registers engines that write through it (the ``ENGINE_OPENERS`` seam) for
the builds of this process; ``python -m tests.engine.faulty FOLDER build ...`` runs the CLI
so (run it with the repository root as the working directory). The class is module-level, so
Ray workers and spawned local workers unpickle it by importing this module.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from shardprep.engine import ENGINE_OPENERS, Engine, EngineOpener, EngineOptions, write_task
from shardprep.engine.tasks import Progress, ShardTask, WriteTask
from shardprep.format.errors import WriteError
from shardprep.write import ShardRecord

HOLD_LIMIT_S = 120.0


@dataclass(frozen=True)
class FaultyWrite:
    """The production write task, after the fault hooks of ``folder`` (see the module doc)."""

    folder: str

    def __call__(self, task: ShardTask, progress: Progress | None = None) -> ShardRecord:
        try:
            _inject(self.folder, task.index)
        except OSError as err:
            raise WriteError(f"shard {task.index}: {err}", task.index) from err
        return write_task(task, progress)


def _inject(folder: str, shard: int) -> None:
    """Raises:
    OSError: EIO, once per ``fail-<shard>`` file; EACCES while ``deny-<shard>`` exists.
    (While ``crash-<shard>`` exists the process exits instead.)
    TimeoutError: ``hold-<shard>`` was not removed within ``HOLD_LIMIT_S`` s.
    """
    with open(os.path.join(folder, "attempts"), "a", encoding="utf-8") as log:
        log.write(f"{shard}\n")
    if os.path.exists(os.path.join(folder, f"crash-{shard}")):
        os._exit(137)  # the worker dies as if SIGKILLed: no exception reaches Ray
    if os.path.exists(os.path.join(folder, f"deny-{shard}")):
        raise OSError(errno.EACCES, f"injected lasting failure of shard {shard} (test hook)")
    try:
        os.remove(os.path.join(folder, f"fail-{shard}"))  # atomic: fires exactly once
    except FileNotFoundError:
        pass
    else:
        raise OSError(errno.EIO, f"injected transient failure of shard {shard} (test hook)")
    hold = os.path.join(folder, f"hold-{shard}")
    deadline = time.monotonic() + HOLD_LIMIT_S
    while os.path.exists(hold):  # a test hook waiting for the test to remove a file
        if time.monotonic() > deadline:
            raise TimeoutError(f"{hold} still exists after {HOLD_LIMIT_S} s (test hook)")
        time.sleep(0.02)


def _open_with(
    opener: EngineOpener, write: WriteTask, options: EngineOptions
) -> AbstractContextManager[Engine]:
    return opener(replace(options, write_task=write))


@contextmanager
def write_tasks_through(write: WriteTask) -> Iterator[None]:
    """While open, every engine of this process's builds writes its shards through ``write``."""
    registered = dict(ENGINE_OPENERS)
    for name, opener in registered.items():
        ENGINE_OPENERS[name] = partial(_open_with, opener, write)
    try:
        yield
    finally:
        ENGINE_OPENERS.update(registered)


def faults_in(folder: Path) -> AbstractContextManager[None]:
    """While open, every engine of this process's builds writes through FaultyWrite(folder)."""
    return write_tasks_through(FaultyWrite(str(folder)))


def run_cli_through(write: WriteTask, args: list[str]) -> None:
    """The shardprep CLI with ``args``, its shards written through ``write``."""
    from shardprep.cli import main as cli_main

    with write_tasks_through(write):
        cli_main(args)


def main(argv: list[str]) -> None:
    """``FOLDER ARGS...``: the shardprep CLI with ARGS, its writes through FaultyWrite(FOLDER)."""
    run_cli_through(FaultyWrite(argv[0]), argv[1:])


if __name__ == "__main__":  # the hooks' class must be this module's, not __main__'s
    from tests.engine.faulty import main as faulty_main

    faulty_main(sys.argv[1:])
