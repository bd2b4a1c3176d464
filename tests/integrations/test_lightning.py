"""Lightning 2.6 DDP (2 CPU processes, gloo) over a ShardDataset: coverage, equal steps, resume.

One job (``lightning_job.py``) runs every fit of ``lightning_recorder.FITS`` in
turn on the same two ranks; the tests read what each rank trained on.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.conftest import ODD_SAMPLES
from tests.integrations.jobs import python_job, read_ranks, run_job
from tests.integrations.lightning_recorder import BATCH_SIZE, EPOCHS, FITS, STOP_AT_STEP

pytestmark = pytest.mark.distributed

WORLD = 2
PER_RANK = ODD_SAMPLES // WORLD  # uneven="drop": 941 % 2 = 1 sample left out per epoch
BATCHES = math.ceil(PER_RANK / BATCH_SIZE)  # 15: the last one holds 22 samples

Steps = list[list[str]]  # the keys of each step of one rank


@pytest.fixture(scope="module")
def fits(odd_build: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Run the Lightning job once; each fit's per-rank records."""
    workdir = tmp_path_factory.mktemp("lightning")
    run_job(
        python_job("lightning_job.py", "--data", str(odd_build), "--workdir", str(workdir)), 240
    )
    return {name: read_ranks(workdir / name, WORLD) for name in FITS}


def keys(records: list[Any], rank: int) -> Steps:
    return [step["keys"] for step in records[rank]["steps"]]


def test_ddp_two_epochs_cover_the_data_once_per_epoch(
    fits: dict[str, list[Any]], odd_keys: frozenset[str]
) -> None:
    """Dataset built in __init__ (before the process group), plain DataLoader, forkserver workers."""
    records = fits["plain"]
    for rank in range(WORLD):
        assert records[rank]["world_size"] == WORLD
        assert records[rank]["loader_len"] == records[rank]["num_training_batches"] == BATCHES
        steps = records[rank]["steps"]
        assert len(steps) == EPOCHS * BATCHES
        assert [s["position"] for s in steps] == [
            [epoch, batch] for epoch in range(EPOCHS) for batch in range(BATCHES)
        ]
        sizes = [len(s["keys"]) for s in steps[:BATCHES]]
        assert sizes == [BATCH_SIZE] * (BATCHES - 1) + [PER_RANK - BATCH_SIZE * (BATCHES - 1)]
    orders = []
    for epoch in range(EPOCHS):
        epoch_keys = [
            key
            for rank in range(WORLD)
            for step in keys(records, rank)[epoch * BATCHES : (epoch + 1) * BATCHES]
            for key in step
        ]
        assert len(epoch_keys) == len(set(epoch_keys)) == ODD_SAMPLES - 1  # each at most once
        assert set(epoch_keys) < odd_keys  # all but the one dropped sample
        orders.append(epoch_keys)
    # Lightning never calls set_epoch on an IterableDataset: the dataset advanced by itself
    assert orders[0] != orders[1]


def test_stateful_dataloader_resumes_exactly_mid_epoch(fits: dict[str, list[Any]]) -> None:
    """Lightning checkpoints the StatefulDataLoader's state and restores it: no batch lost or repeated."""
    for rank in range(WORLD):
        full = keys(fits["plain"], rank)
        stopped = keys(fits["stop-stateful"], rank)
        resumed = keys(fits["stateful-from-step20"], rank)
        assert len(stopped) == STOP_AT_STEP
        assert len(resumed) == EPOCHS * BATCHES - STOP_AT_STEP
        assert stopped + resumed == full


@pytest.mark.parametrize("checkpoint", ["step20", "step15", "epoch-end"])
def test_state_after_in_checkpoint_resumes_exactly(
    fits: dict[str, list[Any]], checkpoint: str
) -> None:
    """Plain DataLoader; ds.state_after(last batch) kept by on_save_checkpoint, resumed in train_dataloader.

    step20 is mid-epoch 1; step15 (saved on the last batch of epoch 0) and epoch-end
    (saved by on_train_epoch_end) are both at the end of epoch 0.
    """
    done = {"step20": STOP_AT_STEP, "step15": BATCHES, "epoch-end": BATCHES}[checkpoint]
    for rank in range(WORLD):
        full = keys(fits["plain"], rank)
        assert keys(fits["stop-hooks"], rank) == full[:STOP_AT_STEP]
        assert keys(fits[f"hooks-from-{checkpoint}"], rank) == full[done:]


def test_stateful_dataloader_from_last_batch_checkpoint(fits: dict[str, list[Any]]) -> None:
    """Lightning restores a state saved on an epoch's last batch as unfinished (it never asks
    past len()): the restored workers see that the whole epoch was delivered and stream the next."""
    for rank in range(WORLD):
        assert keys(fits["stateful-from-step15"], rank) == keys(fits["plain"], rank)[BATCHES:]


def test_stateful_dataloader_from_epoch_end_checkpoint(fits: dict[str, list[Any]]) -> None:
    """Lightning does not restore a loader state from an epoch-end checkpoint: the recipe's
    set_epoch in train_dataloader() keeps the fresh dataset from replaying epoch 0's order."""
    for rank in range(WORLD):
        assert keys(fits["stateful-from-epoch-end"], rank) == keys(fits["plain"], rank)[BATCHES:]
