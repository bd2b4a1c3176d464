"""torchrun + plain DataLoader on 2 ranks: a dataset built before init_process_group, decode=True
batches of tensors, and a restart from ``state_after``/``resume``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data

from loader import ShardDataset
from tests.integrations.conftest import DECODE_SAMPLES, IMAGE_SIZE, expected_sample
from tests.integrations.jobs import read_ranks, run_job, torchrun_job
from tests.integrations.torchrun_job import BATCH_SIZE, EPOCHS, NUM_WORKERS, RESUME_AFTER

WORLD = 2
PER_RANK = DECODE_SAMPLES // WORLD  # 50: one sample left out per epoch
BATCHES = math.ceil(PER_RANK / BATCH_SIZE)  # 7, the last of 2 samples
ALL_KEYS = frozenset(f"{index:05d}" for index in range(DECODE_SAMPLES))


@pytest.fixture(scope="module")
def ranks(decoded_build: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    workdir = tmp_path_factory.mktemp("torchrun")
    run_job(torchrun_job("torchrun_job.py", str(decoded_build), str(workdir)), 120)
    return read_ranks(workdir, WORLD)


def epoch_keys(record: dict[str, Any], epoch: int) -> list[str]:
    return [key for step in record["epochs"][epoch] for key in step["keys"]]


@pytest.mark.distributed
def test_dataset_built_before_init_process_group_splits_by_rank(ranks: list[Any]) -> None:
    for rank, record in enumerate(ranks):
        assert (record["rank"], record["world_size"]) == (rank, WORLD)
        assert record["len"] == BATCHES
        assert [len(steps) for steps in record["epochs"]] == [BATCHES] * EPOCHS
    for epoch in range(EPOCHS):
        halves = [epoch_keys(record, epoch) for record in ranks]
        assert [len(h) for h in halves] == [len(set(h)) for h in halves] == [PER_RANK] * WORLD
        assert not set(halves[0]) & set(halves[1])
        assert len(ALL_KEYS - set(halves[0]) - set(halves[1])) == DECODE_SAMPLES % WORLD
    assert epoch_keys(ranks[0], 0) != epoch_keys(ranks[0], 1)  # the next pass is the next epoch


@pytest.mark.distributed
def test_decoded_batches_are_stacked_tensors(ranks: list[Any]) -> None:
    width, height = IMAGE_SIZE
    for record in ranks:
        for steps in record["epochs"]:
            for step in steps:
                n = len(step["keys"])
                assert step["fields"] == {
                    "cls": {"type": "Tensor", "dtype": "torch.int64", "shape": [n]},
                    "npy": {"type": "Tensor", "dtype": "torch.float32", "shape": [n, 3]},
                    "png": {
                        "type": "Tensor",
                        "dtype": "torch.uint8",
                        "shape": [n, 3, height, width],
                    },
                }
                expected = [expected_sample(int(key)) for key in step["keys"]]
                assert step["cls"] == [e["cls"] for e in expected]
                assert step["npy"] == [e["npy"] for e in expected]
                assert step["pixels"] == [e["pixel"] for e in expected]


@pytest.mark.distributed
def test_state_after_and_resume_continue_the_epoch(ranks: list[Any]) -> None:
    for record in ranks:
        assert (record["state"]["epoch"], record["state"]["batches"]) == (1, RESUME_AFTER + 1)
        assert record["state"]["num_workers"] == NUM_WORKERS
        resumed = [step["keys"] for step in record["resumed"]]
        assert resumed == [step["keys"] for step in record["epochs"][1][RESUME_AFTER + 1 :]]
    assert ranks[0]["state"] == ranks[1]["state"]  # rank 0 can save it for everyone


def test_decoded_samples_pass_default_collate(decoded_build: Path) -> None:
    """Without batch_size, a DataLoader with a batch_size collates decoded samples into tensors."""
    dataset = ShardDataset(str(decoded_build), decode=True, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH_SIZE)
    batches = list(loader)
    assert sum(len(b["__key__"]) for b in batches) == DECODE_SAMPLES
    width, height = IMAGE_SIZE
    for batch in batches:
        n = len(batch["__key__"])
        assert batch["png"].dtype == torch.uint8 and batch["png"].shape == (n, 3, height, width)
        assert batch["npy"].dtype == torch.float32 and batch["npy"].shape == (n, 3)
        assert batch["cls"].dtype == torch.int64 and batch["cls"].shape == (n,)
        expected = [expected_sample(int(key)) for key in batch["__key__"]]
        assert batch["cls"].tolist() == [e["cls"] for e in expected]
        assert batch["png"][:, :, 0, 0].tolist() == [e["pixel"] for e in expected]
