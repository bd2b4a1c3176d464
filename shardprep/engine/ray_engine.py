"""The Ray engine (``--engine ray``): scan tasks and shard writes as Ray tasks.

Install with ``pip install "shardprep[ray]"``. The build's process is the
Ray driver: it joins the cluster at ``--ray-address`` (else ``RAY_ADDRESS``),
or starts a local Ray instance when neither is given, and leaves it again at
the end (a local instance it started is shut down).

* Writes: one task per shard. The driver cuts each shard's task out of the
  plan only when it submits it, and keeps at most ``2 x cluster CPUs`` tasks
  in flight, so its memory holds that many shards' metadata, not the
  dataset's. Progress is counted on the driver, per completed task.
* Retries are Ray's own: ``max_retries`` for a lost worker or node, and
  ``retry_exceptions=[TransientWriteError]`` for I/O errors that may pass
  (see :mod:`shardprep.engine.faults`). Any other error fails the build with
  the task's own :class:`~shardprep.format.errors.ShardprepError`. A task whose worker
  process died on every attempt (killed for memory, crashed) fails it with a
  :class:`~shardprep.format.errors.WorkersDiedError` naming the shard or scan task.
* Ctrl-C or a failure cancels every pending task (``ray.cancel(force=True)``)
  and waits for them (at most ``CANCEL_WAIT_S``) before the exception propagates.
  Tasks that end within ``CANCEL_GRACE_S`` are not cancelled: Ray 2.60 can abort the
  driver when a cancel races the reply of a task that has just ended ("Check failed:
  ... Tried to complete task that was not pending", the class of ray-project/ray#54846),
  and the event that stops a build (a task's error, a Ctrl-C right after a shard
  appears) often comes just as another task ends. A wait past ``CANCEL_NOTICE_S``
  says which tasks it waits for (a second Ctrl-C ends it), and tasks still running at
  the end are named in a warning (logger ``shardprep``).

With a URL OUT each write task writes its shard on its own node (its ``TMPDIR``, one
shard at a time) and uploads it into OUT itself (:mod:`shardprep.upload`); only the
shard's record comes back. A task killed with its driver leaves its staging folder on its
node (``shardprep-staging-*``, ``.partial`` files in it), so before the first write such a
build runs one small task on every live node that removes the folders of dead builds from
that node's ``TMPDIR`` (:func:`shardprep.scratch.sweep_stale`: only folders a shardprep
build made, whose lock no live process holds; a folder of a running build, or one that is
not shardprep's, is never touched). RAW must be readable from every node: a URL, or a path every
node sees (a shared filesystem), as must a folder OUT. The storage options (credentials
included) are pickled into the tasks. shardprep itself must be importable on every node.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from shardprep.engine.faults import TransientWriteError, classify
from shardprep.engine.tasks import ShardTask, WriteContext, WriteTask, write_task
from shardprep.format.errors import PlanError, ShardprepError, WorkersDiedError, WriteError, stalled
from shardprep.format.interface import CLI, Interface
from shardprep.scratch import sweep_stale
from shardprep.write import ShardRecord

if TYPE_CHECKING:
    from shardprep.engine import EngineOptions

__all__ = ["RayEngine", "import_ray"]

T = TypeVar("T")
R = TypeVar("R")

MAX_RETRIES = 3  # Ray's per-task retry budget, for lost workers and transient errors alike
CANCEL_WAIT_S = 60.0  # how long a failed or interrupted build waits for cancelled tasks
CANCEL_NOTICE_S = 5.0  # a wait for cancelled tasks longer than this is announced
CANCEL_GRACE_S = 0.25  # tasks ending within this are left to end, not cancelled (see above)
POLL_S = 0.5
CONNECT_TIMEOUT_S = 10.0
SWEEP_WAIT_S = 30.0  # how long the build waits for the nodes' sweeps (then writes anyway)

LOG = logging.getLogger("shardprep")


def import_ray(interface: Interface = CLI) -> Any:
    """The ``ray`` module (``interface``: how the refusal names the engine option).

    Raises:
        PlanError: Ray is not installed; the message names the extra to install.
    """
    try:
        import ray
    except ImportError as err:
        raise PlanError(
            f'{interface.setting("engine", "ray")} needs Ray: pip install "shardprep[ray]" '
            f"(it could not be imported: {err})"
        ) from err
    return ray


def check_reachable(
    address: str, timeout: float = CONNECT_TIMEOUT_S, interface: Interface = CLI
) -> None:
    """Refuse a ``host:port`` cluster address that does not answer within ``timeout`` s
    (``interface``: how the refusal names the address option).

    (``ray.init`` itself retries an unreachable GCS for minutes.) Other forms
    (``auto``, ``local``, ``ray://...``) are left to Ray.

    Raises:
        PlanError: nothing accepts TCP connections at ``address``.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as err:
        raise PlanError(
            f"{interface.setting('ray_address', address)}: no Ray cluster answers there ({err.strerror or err}); "
            "start one (ray start --head) or give the address `ray status` prints"
        ) from err


def _call(fn: Callable[[T], R], item: T) -> R:
    """Runs in a Ray worker: one scan task."""
    return fn(item)


def _sweep_node() -> list[str]:
    """Runs on one node: the folders of dead builds it removed from the node's ``TMPDIR``."""
    return sweep_stale()


def _write(task: ShardTask, write: WriteTask) -> ShardRecord:
    """Runs in a Ray worker: write one shard; a transient I/O error becomes retryable."""
    try:
        return write(task, None)
    except WriteError as err:
        raise classify(err, task.samples()) from err.__cause__


class RayEngine:
    """Runs tasks on the Ray cluster this process is connected to."""

    name = "ray"
    parallel = True  # tasks run in Ray's worker processes
    shares_disk = False  # a cluster's nodes may not see this machine's scratch folder

    def __init__(
        self,
        ray: Any,
        stall_timeout: float = 1800.0,
        write: WriteTask = write_task,
        interface: Interface = CLI,
    ) -> None:
        self._ray = ray
        self.stall_timeout = stall_timeout
        self.interface = interface  # how messages name options (the build's)
        self.write = write  # writes one shard in a Ray worker (pickled into each task)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.window = max(2, 2 * cpus)  # tasks in flight
        self._call = ray.remote(max_retries=MAX_RETRIES)(_call)
        self._sweep = ray.remote(num_cpus=0, max_retries=0)(_sweep_node)
        self._write = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=[TransientWriteError])(
            _write
        )

    @classmethod
    @contextmanager
    def open(cls, options: EngineOptions) -> Iterator[RayEngine]:
        """Join the cluster (``options.ray_address``, else RAY_ADDRESS) or start a local instance.

        A Ray connection that already exists in this process is used as is
        and left open; one made here is closed (a local instance shut down).
        """
        ray = import_ray(options.interface)
        if ray.is_initialized():
            yield cls(ray, options.stall_timeout, options.write_task, options.interface)
            return
        address = options.ray_address or os.environ.get("RAY_ADDRESS") or None
        if address is not None:
            check_reachable(address, interface=options.interface)
        kwargs: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
        if address is None:
            kwargs["include_dashboard"] = False
            if options.workers_given:
                kwargs["num_cpus"] = options.workers
        # "local": a new instance here, not one a `ray start` left in /tmp/ray (ray.init's
        # default with no address joins the latest cluster started on this machine)
        ray.init(address=address or "local", **kwargs)
        try:
            yield cls(ray, options.stall_timeout, options.write_task, options.interface)
        finally:
            ray.shutdown()

    def ordered_map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        """One Ray task per item, ``window`` in flight; results in item order."""
        pending: deque[tuple[Any, int]] = deque()
        try:
            for number, item in enumerate(items):
                pending.append((self._call.remote(fn, item), number))
                if len(pending) >= self.window:
                    yield self._get(*pending.popleft())
            while pending:
                yield self._get(*pending.popleft())
        except BaseException:
            self._cancel({ref: f"scan task {number}" for ref, number in pending})
            raise

    def write_shards(
        self,
        context: WriteContext,
        todo: Sequence[int],
        progress: Callable[[int], None],
        admit: Callable[[int], None] | None = None,
    ) -> Generator[tuple[int, ShardRecord], None, None]:
        """One Ray task per shard, ``window`` in flight; yields as tasks complete."""
        ray = self._ray
        if context.upload is not None:  # shards are staged on the nodes: sweep dead builds'
            self.sweep_nodes()
        queue = iter(todo)
        pending: dict[Any, int] = {}
        try:
            for shard in queue:
                if admit is not None:
                    admit(0)
                pending[self._write.remote(context.task(shard), self.write)] = shard
                if len(pending) >= self.window:
                    break
            moved = time.monotonic()
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
                if done:
                    moved = time.monotonic()
                elif time.monotonic() - moved > self.stall_timeout:  # cancelled below
                    raise stalled(sorted(pending.values()), self.stall_timeout)
                for ref in done:
                    shard = pending.pop(ref)
                    record = self._get(ref, shard=shard)
                    progress(context.shard_size(shard))
                    next_shard = next(queue, None)
                    if next_shard is not None:
                        if admit is not None:
                            admit(0)
                        pending[self._write.remote(context.task(next_shard), self.write)] = (
                            next_shard
                        )
                    yield shard, record
        except BaseException:
            self._cancel({ref: f"shard {shard}" for ref, shard in pending.items()})
            raise

    def sweep_nodes(self) -> dict[str, list[str]]:
        """Remove dead builds' scratch and staging folders on every live node (one task each,
        waited for at most ``SWEEP_WAIT_S``); returns node id -> the folders removed there.
        A node that fails or does not answer in time is named in a warning; the build goes on."""
        ray = self._ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        sweeps = {
            self._sweep.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            ).remote(): str(node["NodeID"])
            for node in ray.nodes()
            if node.get("Alive")
        }
        done, late = ray.wait(list(sweeps), num_returns=len(sweeps), timeout=SWEEP_WAIT_S)
        removed: dict[str, list[str]] = {}
        for ref in done:
            try:
                removed[sweeps[ref]] = list(ray.get(ref))
            except Exception as err:  # the node left, or its TMPDIR is unreadable
                LOG.warning(
                    "node %s: the folders of killed builds there were not looked for (%s)",
                    sweeps[ref],
                    err,
                )
        for node, folders in removed.items():
            if folders:
                LOG.info("node %s: removed %d folder(s) of killed builds", node, len(folders))
        if late:
            LOG.warning(
                "%d node(s) did not look for the folders of killed builds within %.0f s: %s",
                len(late),
                SWEEP_WAIT_S,
                _named(sweeps[ref] for ref in late),
            )
        return removed

    def _get(self, ref: Any, scan_task: int = -1, shard: int = -1) -> Any:
        """The task's result; its ShardprepError is re-raised as itself (not wrapped by Ray).

        Raises:
            WorkersDiedError: the task's worker died on every attempt (``shard`` or
                ``scan_task`` names it).
        """
        ray = self._ray
        while True:
            done, _ = ray.wait([ref], timeout=POLL_S)  # short waits: Ctrl-C is seen promptly
            if done:
                break
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, ShardprepError):
                raise cause from err
            raise
        except _worker_deaths(ray) as err:
            raise _workers_died(err, scan_task, shard, self.interface) from err

    def _cancel(self, tasks: dict[Any, str]) -> None:
        """Cancel ``tasks`` (their refs, each with what it is: "shard 5") that do not end
        within ``CANCEL_GRACE_S``, killing running ones, and wait until Ray has stopped them
        all, at most ``CANCEL_WAIT_S``."""
        ray = self._ray
        running = dict(tasks)
        if not running:
            return
        start = time.monotonic()
        ended, _ = ray.wait(list(running), num_returns=len(running), timeout=CANCEL_GRACE_S)
        for ref in ended:
            del running[ref]
        for ref in running:
            ray.cancel(ref, force=True)
        announced = False
        while running:
            waited = time.monotonic() - start
            if waited >= CANCEL_WAIT_S:
                LOG.warning(
                    "%d cancelled Ray task(s) still running after %.0f s: %s; they may still "
                    "write into OUT: let them end (or stop them in Ray) before running this "
                    "build again",
                    len(running),
                    waited,
                    _named(running.values()),
                )
                return
            if not announced and waited >= CANCEL_NOTICE_S:
                announced = True
                LOG.warning(
                    "waiting up to %.0f s more for %d cancelled Ray task(s) to stop: %s "
                    "(Ctrl-C again to stop waiting)",
                    CANCEL_WAIT_S - waited,
                    len(running),
                    _named(running.values()),
                )
            step = min(POLL_S, CANCEL_WAIT_S - waited)
            done, _ = ray.wait(list(running), num_returns=len(running), timeout=step)
            for ref in done:
                del running[ref]


def _named(tasks: Iterable[str]) -> str:
    """A few task names, then how many more."""
    names = list(tasks)
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def _worker_deaths(ray: Any) -> tuple[type[BaseException], ...]:
    """Ray's errors for a task whose worker process (or node) died under it."""
    names = (
        "WorkerCrashedError",
        "OutOfMemoryError",
        "NodeDiedError",
        "LocalRayletDiedError",
        "ObjectLostError",
    )
    return tuple(getattr(ray.exceptions, name) for name in names if hasattr(ray.exceptions, name))


def _workers_died(
    err: BaseException, scan_task: int, shard: int, interface: Interface = CLI
) -> WorkersDiedError:
    """The build's error for a task Ray gave up on after its workers died ``MAX_RETRIES + 1``
    times; ``err`` is Ray's (its class name says how). A shard's says what happened only:
    the builder adds what OUT keeps, counted, and how to resume
    (:func:`shardprep.builder.resume_advice`); a scan task's is whole (nothing was written)."""
    fewer = f"free memory or give Ray fewer CPUs with {interface.option('workers')}"
    why = (
        f"the Ray worker process running it died on each of its {MAX_RETRIES + 1} attempts "
        f"({type(err).__name__}): Ray kills a worker whose node runs out of memory ({fewer}), "
        "and a crash in native code ends one too (see the worker logs under "
        "/tmp/ray/session_latest/logs)"
    )
    if type(err).__name__ in ("NodeDiedError", "LocalRayletDiedError"):
        why = (
            f"the Ray node running it was lost on each of its {MAX_RETRIES + 1} attempts "
            f"({type(err).__name__}: a node stopped, was removed or lost contact; no object of "
            "an unfinished upload is visible in OUT)"
        )
    if shard >= 0:
        return WorkersDiedError(f"shard {shard}: {why}", f"shard {shard}")
    return WorkersDiedError(
        f"scan task {scan_task}: {why}; nothing was written: fix the cause, then "
        f"{interface.again()}",
        f"scan task {scan_task}",
    )
