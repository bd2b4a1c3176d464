"""The local engine: this machine's process pool (``--engine local``, the default).

Scan tasks and shard writes run in forked worker processes
(:func:`shardprep.workers.worker_pool`), or in this process with one worker.
Workers inherit the :class:`WriteContext` once, at fork, and count written
samples in a shared counter, so the progress bar moves within a shard; the
first failure or Ctrl-C tells every worker to stop at its next progress
report and returns only once all of them have stopped.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from shardprep.engine.tasks import WriteContext, WriteTask, write_task
from shardprep.format.errors import StalledError, WorkersDiedError, stalled
from shardprep.storage import is_url
from shardprep.workers import mp_context, worker_pool
from shardprep.write import ShardRecord

if TYPE_CHECKING:
    from shardprep.engine import EngineOptions

__all__ = ["LocalEngine"]

T = TypeVar("T")
R = TypeVar("R")


class LocalEngine:
    """Process-pool engine with ``workers`` processes (1: everything in this process)."""

    name = "local"

    def __init__(
        self, workers: int, stall_timeout: float = 1800.0, write: WriteTask = write_task
    ) -> None:
        self.workers = max(1, workers)
        self.stall_timeout = stall_timeout
        self.write = write  # writes one shard (see shardprep.engine.tasks.WriteTask)

    @property
    def parallel(self) -> bool:
        """With one worker every task runs in this process."""
        return self.workers > 1

    shares_disk = True  # worker processes of this machine

    @classmethod
    @contextmanager
    def open(cls, options: EngineOptions) -> Iterator[LocalEngine]:
        """The engine for ``options`` (an :class:`~shardprep.engine.EngineOptions`)."""
        yield cls(options.workers, options.stall_timeout, options.write_task)

    def ordered_map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        """``fn`` over ``items`` in worker processes; results in item order.

        At most ``2 x workers`` items are in flight (``items`` may be a
        generator that reads its input lazily); each result is dropped once
        yielded. One worker, or a single item: everything runs here.
        """
        queue = iter(items)
        head = list(itertools.islice(queue, 2))
        if self.workers == 1 or len(head) < 2:
            for item in itertools.chain(head, queue):
                yield fn(item)
            return
        with worker_pool(self.workers) as pool:
            pending: deque[Future[R]] = deque()
            for item in itertools.chain(head, queue):
                pending.append(pool.executor.submit(fn, item))
                while len(pending) >= 2 * self.workers:
                    yield _next_result(pool, pending)
            while pending:
                yield _next_result(pool, pending)

    def write_shards(
        self,
        context: WriteContext,
        todo: Sequence[int],
        progress: Callable[[int], None],
        admit: Callable[[int], None] | None = None,
    ) -> Generator[tuple[int, ShardRecord], None, None]:
        """Write ``todo`` over up to ``workers`` processes (in this process with one).

        A build with a ``--map`` always writes in worker processes, one at
        least: the user's function then cannot end the build's own process
        (``os._exit``) or hang it past ``--stall-timeout``.
        """
        workers = min(self.workers, max(1, len(todo)))
        if workers == 1 and context.transform is None:
            for shard in todo:
                if admit is not None:
                    admit(0)
                yield shard, self.write(context.task(shard), progress)
            return
        yield from _write_parallel(
            context, todo, workers, progress, admit, self.stall_timeout, self.write
        )


def _writer_died(shard: int, context: WriteContext) -> WorkersDiedError:
    """The build's error when the process writing ``shard`` ended without an answer: what
    happened only (the builder adds what OUT keeps, counted, and how to resume:
    :func:`shardprep.builder.resume_advice`)."""
    culprit = (
        f"the map function {context.transform.name} may have ended it (os._exit, a crash in "
        "native code), or "
        if context.transform is not None
        else ""
    )
    return WorkersDiedError(
        f"shard {shard}: the worker process writing it died without an answer ({culprit}the "
        "kernel's out-of-memory killer stopped it: see dmesg)",
        f"shard {shard}",
    )


def _next_result(pool: Any, pending: deque[Future[R]]) -> R:
    """The oldest pending task's result (waiting for it in short, Ctrl-C-aware steps)."""
    while not pool.wait([pending[0]]):
        pass
    return pending.popleft().result()


class _Stopped(Exception):
    """Raised in a worker at its next progress report once the build is stopping."""


@dataclass(frozen=True)
class _Channel:
    """Shared between the build and its workers: samples written, and "stop now"."""

    written: Any  # multiprocessing.Value("q")
    stop: Any  # multiprocessing.Event

    def count(self, n: int) -> None:
        if self.stop.is_set():
            raise _Stopped
        with self.written.get_lock():
            self.written.value += n


_worker_state: tuple[WriteContext, _Channel, WriteTask] | None = None  # once per worker


def _init_worker(context: WriteContext, channel: _Channel, write: WriteTask) -> None:
    global _worker_state
    _worker_state = (context, channel, write)


def _write_in_worker(shard: int) -> ShardRecord:
    if _worker_state is None:
        raise RuntimeError("worker used before _init_worker")
    context, channel, write = _worker_state
    return write(context.task(shard), channel.count)


def _write_parallel(
    context: WriteContext,
    todo: Sequence[int],
    workers: int,
    progress: Callable[[int], None],
    admit: Callable[[int], None] | None = None,
    stall_timeout: float = 1800.0,
    write: WriteTask = write_task,
) -> Generator[tuple[int, ShardRecord], None, None]:
    """Write shards ``todo`` over ``workers`` processes, ``workers`` shards at a time.

    The first failure or Ctrl-C stops the rest within one zstd frame's worth of
    writing per worker (they give up at their next progress report), and this
    returns or raises only once every worker has stopped. When no sample is
    written and no shard finishes for ``stall_timeout`` seconds, the workers are
    killed (one may be stuck in a read) and :class:`StalledError` names the
    shards in flight. Writers that read
    inputs listed by URL are spawned, not forked: a fork can inherit a lock a
    network thread holds.
    """
    mp = mp_context(network=is_url(context.root))
    channel = _Channel(mp.Value("q", 0), mp.Event())
    reported = 0
    waiting = deque(todo)
    with worker_pool(
        workers,
        _init_worker,
        (context, channel, write),
        stop=channel.stop.set,
        context=mp,
        kill_on=(StalledError,),
    ) as pool:
        pending: dict[Future[ShardRecord], int] = {}
        moved = time.monotonic()
        while waiting or pending:
            while waiting and len(pending) < workers:
                if admit is not None:
                    admit(len(pending))
                shard = waiting.popleft()
                pending[pool.executor.submit(_write_in_worker, shard)] = shard
            done = pool.wait(pending)  # raises KeyboardInterrupt on Ctrl-C
            written = channel.written.value
            progress(written - reported)
            if done or written != reported:
                moved = time.monotonic()
            elif time.monotonic() - moved > stall_timeout:
                raise stalled(sorted(pending.values()), stall_timeout)
            reported = written
            for future in done:
                shard = pending.pop(future)
                try:
                    record = future.result()  # re-raises the worker's WriteError
                except BrokenProcessPool as err:
                    raise _writer_died(shard, context) from err
                yield shard, record
        progress(channel.written.value - reported)
