"""Lifeline: a DataLoader worker exits as soon as the process that started it dies.

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
"""

from __future__ import annotations

from shardprep.format.lifeline import EXIT_CODE, started_before, watch_parent

__all__ = ["EXIT_CODE", "started_before", "watch_trainer"]


def watch_trainer() -> None:
    """Make this DataLoader worker exit when the process that started it exits.

    It does nothing in a process that multiprocessing did not start; the first call per
    process starts the watch, later calls return at once; if the trainer is already gone,
    this process exits now.
    """
    watch_parent(EXIT_CODE)
