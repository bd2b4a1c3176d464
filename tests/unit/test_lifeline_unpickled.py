"""loader.torch.lifeline.tie_unpickled: which processes a received dataset ties to their parent.

A child being started with the dataset in its arguments (forkserver) is tied before its
target runs; a running child that receives one (a Pool task) is tied at once; the main
process that unpickles one (a copy, a checkpoint) is not. Observed through the lifeline's
own record of the process it watches for (``shardprep.format.lifeline._watching``).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import shardprep.format.lifeline as lifeline
from loader import ShardDataset

TIMEOUT_S = 120.0  # forkserver children import torch on a busy 2-core machine


def watched(dataset: object) -> bool:
    """In a child: whether this process watches its parent (run as target or as a task)."""
    return lifeline._watching == os.getpid()


def _target(dataset: object, answer: Any) -> None:
    answer.put(watched(dataset))


def test_a_child_started_with_a_dataset_watches_its_parent_before_its_target(built: Path) -> None:
    context = multiprocessing.get_context("forkserver")
    answer = context.SimpleQueue()
    child = context.Process(target=_target, args=(ShardDataset(str(built)), answer))
    child.start()
    try:
        assert answer.get() is True  # bounded by pytest-timeout
    finally:
        child.join(TIMEOUT_S)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def test_a_running_pool_worker_given_a_dataset_watches_at_once(built: Path) -> None:
    context = multiprocessing.get_context("forkserver")
    with context.Pool(1) as pool:
        assert pool.apply_async(watched, (None,)).get(TIMEOUT_S) is False  # nothing received
        assert pool.apply_async(watched, (ShardDataset(str(built)),)).get(TIMEOUT_S) is True


def test_the_main_process_unpickling_a_dataset_starts_no_watch(built: Path) -> None:
    before = threading.active_count()
    copy = pickle.loads(pickle.dumps(ShardDataset(str(built))))
    assert isinstance(copy, ShardDataset)
    assert threading.active_count() == before
    assert lifeline._watching != os.getpid()
