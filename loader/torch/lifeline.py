"""Lifeline: a DataLoader worker tied to the process that started it: it exits as soon as that
process dies, and does not copy that process's heap when it collects garbage.

torch's workers watch their parent with ``os.getppid()`` every 5 seconds. That
parent is the training process under ``fork`` and ``spawn``, but under
``forkserver`` (what torchrun users are told to use) it is the fork server, which
outlives the trainer: a SIGKILLed or ``os._exit``-ed trainer then left its
workers, the fork server and their semaphores in ``/dev/shm`` behind for good
(every worker holds the fork server's "alive" pipe and the resource tracker's
pipe open, so neither of those ever sees its end either).

Each worker therefore watches the process that created it
(``multiprocessing.parent_process()``: the process that called
``iter(dataloader)``, whatever the start method) with the mechanism the builder's
pools use too, :mod:`shardprep.format.lifeline` (a pidfd waited on by a daemon
thread, checked against pid reuse). Once the workers are gone, the fork server
and the resource tracker read the end of their pipes and exit, and the tracker
unlinks the queues' semaphores.

The watch starts at two points, whichever comes first (:func:`watch_trainer` is
idempotent per process):

- when the worker starts iterating (``TorchLayer.__iter__``), under every start method;
- when a ``forkserver`` worker *receives* the dataset (it comes pickled with the worker's
  arguments: :func:`tie_unpickled`, from ``TorchLayer.__setstate__``), which is before the
  worker runs any of torch's or the user's code. This is what covers a dataset behind a
  user's wrapper (an ``IterableDataset`` whose generator ``__iter__`` reaches the
  ``ShardDataset`` only at its first ``next``), a slow ``worker_init_fn``, and a trainer
  killed before its workers got their first index: the worker would otherwise wait in
  user code or on its index queue, where torch's ``getppid`` check watches the fork server.

A ``fork`` worker receives nothing pickled, and a ``spawn`` worker's start runs no
multiprocessing hook before its target (``SpawnProcess._after_fork`` does nothing); the
parent of both is the trainer, which torch's own ``getppid`` check watches (every 5 s while
the worker waits for an index; it takes the parent it sees as the worker loop begins, so a
spawn trainer killed while the worker still imports is missed: docs/loader.md).

The heap (``freeze_inherited``): a forked worker keeps from copying its parent's heap when it
collects garbage.
A worker forked from the training process shares that process's memory page by page until
either writes a page. A full (oldest-generation) collection in the worker writes a field in
the header of every object it tracks, inherited ones included, so one full collection
copies most of the parent's Python heap into the worker (about 40 MiB per worker for a
parent that has imported torch; more for a parent that holds a large Python heap). Whether
a worker runs one depends on how many objects it allocates, so the copy shows up only in
long epochs. ``gc.freeze()`` moves every object the worker holds into the permanent
generation, which collections skip; it is O(1) (it splices lists, it touches no object).
Objects the worker makes afterwards are collected as usual.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing.util
import os

from shardprep.format.lifeline import EXIT_CODE, started_before, watch_parent

__all__ = ["freeze_inherited", "EXIT_CODE", "started_before", "tie_unpickled", "watch_trainer"]


def watch_trainer() -> None:
    """Make this DataLoader worker exit when the process that started it exits.

    It does nothing in a process that multiprocessing did not start; the first call per
    process starts the watch, later calls return at once; if the trainer is already gone,
    this process exits now.
    """
    watch_parent(EXIT_CODE)


def tie_unpickled(dataset: object) -> None:
    """Tie the process that is unpickling ``dataset`` to the process that started it.

    Where multiprocessing started this process and it runs already (a ``Pool`` worker
    given the dataset with a task), the watch starts now. Where the dataset comes with the
    arguments of a process being started (a ``forkserver`` DataLoader worker, or a
    ``Pool``'s ``initargs``), multiprocessing knows the parent only once it bootstraps the
    process, just before its target runs: the watch starts there (a
    :func:`multiprocessing.util.register_after_fork` hook, for this process only; a
    ``spawn`` start runs no such hook, see the module doc). So any
    multiprocessing child that receives one of the loader's datasets from its parent lives
    no longer than that parent: such a process serves its parent (its batches, its shared
    epoch counters), and one left behind keeps the fork server, the resource tracker and
    their semaphores alive with it. A process that multiprocessing did not start (the
    trainer itself, a torchrun rank, a Ray worker) is not affected.
    """
    watch_trainer()  # no-op where multiprocessing has not (yet) made this a child
    hook = functools.partial(_watch_in, os.getpid())
    multiprocessing.util.register_after_fork(dataset, hook)  # weak: goes with the dataset


def _watch_in(pid: int, dataset: object) -> None:
    """At multiprocessing's start of a process: watch if it is the one that unpickled
    ``dataset`` (not a process it forks later, which inherits the hook)."""
    if os.getpid() == pid:
        watch_trainer()


_frozen_in: int | None = None  # pid of the process that last froze (a fork has another)


def freeze_inherited() -> None:
    """Freeze the objects this process holds now; once per process (later calls do nothing,
    so the objects of a persistent worker's earlier epochs are still collected)."""
    global _frozen_in
    if _frozen_in != os.getpid():
        gc.freeze()
        _frozen_in = os.getpid()
