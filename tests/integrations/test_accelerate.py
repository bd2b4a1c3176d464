"""Hugging Face accelerate 1.15 on 2 ranks (torchrun, CPU): the recipe, and what prepare() does.

One torchrun job (``accelerate_job.py``) runs every part of ``PARTS`` in turn.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch.utils.data
from accelerate.data_loader import IterableDatasetShard

from loader import ShardDataset, WorldMismatchError
from tests.integrations.accelerate_job import BATCH_SIZE, PARTS
from tests.integrations.conftest import ODD_SAMPLES
from tests.integrations.jobs import read_ranks, run_job, torchrun_job

WORLD = 2
PER_RANK = ODD_SAMPLES // WORLD
BATCHES = math.ceil(PER_RANK / BATCH_SIZE)


@pytest.fixture(scope="module")
def parts(odd_build: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Run the accelerate job once; each part's per-rank records."""
    workdir = tmp_path_factory.mktemp("accelerate")
    run_job(torchrun_job("accelerate_job.py", str(odd_build), str(workdir)), 180)
    return {part: read_ranks(workdir / part, WORLD) for part in PARTS}


def rank_keys(records: list[Any], rank: int) -> list[str]:
    return [key for step in records[rank]["steps"] for key in step]


@pytest.mark.distributed
def test_recipe_gives_each_rank_its_own_half(
    parts: dict[str, list[Any]], odd_keys: frozenset[str]
) -> None:
    """DataLoader not prepared; model and optimizer prepared; send_to_device; a DDP backward per step."""
    records = parts["recipe"]
    halves = []
    for rank in range(WORLD):
        assert "error" not in records[rank]
        assert records[rank]["world_size"] == WORLD
        assert records[rank]["len"] == len(records[rank]["steps"]) == BATCHES
        keys = rank_keys(records, rank)
        assert len(keys) == len(set(keys)) == PER_RANK
        halves.append(set(keys))
    assert not halves[0] & halves[1]
    assert halves[0] | halves[1] < odd_keys
    assert len(odd_keys - (halves[0] | halves[1])) == ODD_SAMPLES % WORLD


@pytest.mark.distributed
def test_prepare_with_dispatch_fails_on_the_keys(parts: dict[str, list[Any]]) -> None:
    """Default dispatch_batches (True for an IterableDataset): rank 0 reads and concatenates batches."""
    records = parts["prepared-batches-dispatch"]
    assert [r["wrapper"] for r in records] == ["DataLoaderDispatcher"] * WORLD
    # the keys (a numpy array of str) cannot be concatenated as tensors
    assert records[0]["error"] == (
        "TypeError: Can only concatenate tensors but got <class 'numpy.ndarray'>"
    )
    # rank 1 was waiting for rank 0's broadcast; it fails once rank 0's process is gone
    assert "Connection closed by peer" in records[1]["error"]
    assert records[0]["steps"] == records[1]["steps"] == []


@pytest.mark.distributed
def test_prepare_without_dispatch_fails_in_batch_mode(parts: dict[str, list[Any]]) -> None:
    """dispatch_batches=False wraps the dataset in IterableDatasetShard(batch_size=None)."""
    for record in parts["prepared-batches-nodispatch"]:
        assert record["wrapper"] == "DataLoaderShard"
        assert record["steps"] == []
        assert "unsupported operand type(s) for *: 'NoneType' and 'int'" in record["error"]


@pytest.mark.distributed
def test_prepare_without_dispatch_refuses_to_resplit_samples(parts: dict[str, list[Any]]) -> None:
    """Sample mode + dispatch_batches=False: accelerate's IterableDatasetShard would split each
    rank's share again inside every worker (without the guard: 8 batches of 32 per rank, 428 of
    940 samples never trained on, no error). ShardDataset refuses it with the fix."""
    records = parts["prepared-samples-nodispatch"]
    for rank in range(WORLD):
        assert records[rank]["steps"] == []
        assert "WorldMismatchError" in records[rank]["error"]
        assert "do not pass its DataLoader to accelerator.prepare()" in records[rank]["error"]


def test_guard_refuses_accelerate_resplitting(odd_build: Path) -> None:
    dataset = ShardDataset(str(odd_build), rank=0, world_size=2)
    wrapped = IterableDatasetShard(dataset, batch_size=BATCH_SIZE, num_processes=2, process_index=0)
    loader = torch.utils.data.DataLoader(wrapped, batch_size=BATCH_SIZE, num_workers=1)
    batches = iter(loader)
    try:
        with pytest.raises(WorldMismatchError, match=r"not pass its DataLoader to accelerator"):
            next(batches)
    finally:
        batches._shutdown_workers()  # type: ignore[attr-defined]  # now, not at a later gc


def test_guard_accepts_a_plain_worker(odd_build: Path) -> None:
    dataset = ShardDataset(str(odd_build), rank=0, world_size=2, batch_size=BATCH_SIZE)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1)
    assert sum(len(batch["__key__"]) for batch in loader) == PER_RANK
