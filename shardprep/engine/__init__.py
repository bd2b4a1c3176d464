"""Engines: where the build's parallel stages run (scan tasks, shard writes).

The build (``shardprep.builder``) decides *what* to compute and in which order
results are combined; an engine decides only *where* the work runs. Two
operations are enough for every stage:

* ``ordered_map(fn, items)``: ``fn(item)`` for every item, in parallel, the
  results yielded in item order (the scan: one task per class folder or per
  listing chunk, merged in order, so the inventory never depends on timing);
* ``write_shards(context, todo, progress)``: write the planned shards
  ``todo``, yielding ``(shard, record)`` as each completes (any order: the
  manifest is assembled in shard order).

Output bytes depend only on each task's input (a shard's samples in write
order), never on which engine, process or node ran it, so every engine writes
byte-identical shards.

``open_engine(options)`` returns one as a context manager, opened by the entry of
``ENGINE_OPENERS`` that ``options.name`` names. Another engine (Dask, Spark) is one more
module implementing :class:`Engine` and one more entry; see docs/architecture.md.

Every engine writes a shard by calling ``options.write_task`` with the shard's
:class:`ShardTask` in its worker (:func:`~shardprep.engine.tasks.write_task` unless
replaced). That is the seam tests use to inject faults: an opener registered in place of
``local`` or ``ray`` that wraps the write task (tests/engine/faulty.py).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, TypeVar

from shardprep.config import ENGINES
from shardprep.engine.tasks import Progress, ShardTask, WriteContext, WriteTask, write_task
from shardprep.format.errors import PlanError
from shardprep.format.interface import CLI, Interface
from shardprep.write import ShardRecord

__all__ = [
    "ENGINES",
    "ENGINE_OPENERS",
    "Engine",
    "EngineOpener",
    "EngineOptions",
    "ShardTask",
    "WriteContext",
    "WriteTask",
    "open_engine",
    "write_task",
]

T = TypeVar("T")
R = TypeVar("R")


class Engine(Protocol):
    """Runs the build's parallel stages. Implementations: ``local``, ``ray``."""

    name: str

    @property
    def parallel(self) -> bool:
        """False when every task runs in this process (then a stage may stream instead)."""
        ...

    @property
    def shares_disk(self) -> bool:
        """True when tasks can write files this process reads (the same machine)."""
        ...

    def ordered_map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        """``fn(item)`` for each item, possibly in parallel; results in item order.

        ``fn`` must be a module-level function and items picklable; ``items``
        is iterated once, lazily (a bounded number of items in flight). An
        exception raised by ``fn`` is re-raised here, as raised.
        """
        ...

    def write_shards(
        self,
        context: WriteContext,
        todo: Sequence[int],
        progress: Progress,
        admit: Callable[[int], None] | None = None,
    ) -> Generator[tuple[int, ShardRecord], None, None]:
        """Write shards ``todo``; yields ``(shard, record)`` as each one completes.

        ``progress(n)`` reports ``n`` more samples written; ``admit(writing)``,
        called before each shard starts with the number of shards being written,
        may block until the output can take another (a remote destination's
        bounded staging; the Ray engine passes 0: its window of tasks comes on
        top). On an error or a
        Ctrl-C every running write is stopped before the exception leaves
        this generator, so no partial file is being written afterwards (the Ray
        engine waits for that at most ``CANCEL_WAIT_S`` and then names, in a
        warning, the tasks Ray has not stopped).
        """
        ...


@dataclass(frozen=True)
class EngineOptions:
    """How to run: the engine's name, its parallelism, and a Ray cluster address."""

    name: str = "local"
    workers: int = 1  # local: processes; ray (local instance): CPUs of the instance
    workers_given: bool = False  # False: the default (CPU count), not an explicit --workers
    ray_address: str | None = None  # ray: cluster to join (else RAY_ADDRESS, else a local one)
    stall_timeout: float = 1800.0  # write: seconds without progress before the build stops
    write_task: WriteTask = write_task  # writes one shard in a worker (tests wrap it)
    interface: Interface = CLI  # how messages name options (the build's: --workers, workers=)


EngineOpener = Callable[[EngineOptions], AbstractContextManager[Engine]]


def _open_local(options: EngineOptions) -> AbstractContextManager[Engine]:
    from shardprep.engine.local import LocalEngine

    return LocalEngine.open(options)


def _open_ray(options: EngineOptions) -> AbstractContextManager[Engine]:
    from shardprep.engine.ray_engine import RayEngine  # Ray is imported by a Ray build only

    return RayEngine.open(options)


ENGINE_OPENERS: dict[str, EngineOpener] = {"local": _open_local, "ray": _open_ray}
"""Engine name → the function that opens it; the names are ``ENGINES``."""


def open_engine(options: EngineOptions) -> AbstractContextManager[Engine]:
    """The engine named in ``options``, as a context manager (Ray connects and disconnects).

    Raises:
        PlanError: an unknown engine name, or ``ray`` without Ray installed.
    """
    opener = ENGINE_OPENERS.get(options.name)
    if opener is None:
        engine = options.interface.option("engine")
        raise PlanError(f"{engine} must be one of {', '.join(ENGINES)} (got {options.name!r})")
    return opener(options)
