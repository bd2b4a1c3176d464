"""The README's first hour, as written: ``shardprep example`` images, ``shardprep build``, then
docs/examples/train_ddp.py under torchrun on 2 ranks reaching the accuracy its docstring states,
resuming from its checkpoint at an epoch boundary, and refusing another build's checkpoint.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

import shardprep
from loader import ShardDataset
from shardprep.example import IMAGE_SIZE
from tests.integrations.jobs import ROOT, job_env, run_job
from tests.processes import run_bounded

SCRIPT = ROOT / "docs" / "examples" / "train_ddp.py"
SAMPLES = 1000  # the README's example: 1000 samples, 5 classes
BATCHES = 32  # ceil(500 samples per rank / 16)


def torchrun(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(SCRIPT),
        *args,
    ]


def test_example_images_decode_to_one_uint8_batch(example_out: Path) -> None:
    """decode=True and the default collate: a (B, 3, 32, 32) uint8 tensor, labels 0..4."""
    import torch

    batch = next(iter(ShardDataset(str(example_out), batch_size=16, decode=True)))
    assert batch["png"].dtype == torch.uint8
    assert tuple(batch["png"].shape) == (16, 3, IMAGE_SIZE, IMAGE_SIZE)
    assert set(batch["cls"].tolist()) <= set(range(5))


@pytest.fixture(scope="module")
def first_epoch(example_out: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """One epoch of train_ddp.py: its output and its checkpoint (read-only: tests copy it)."""
    checkpoint = tmp_path_factory.mktemp("first_epoch") / "run.pt"
    output = run_job(
        torchrun(str(example_out), "--epochs", "1", "--checkpoint", str(checkpoint)), 240
    )
    return output, checkpoint


def copy_checkpoint(first_epoch: tuple[str, Path], folder: Path) -> Path:
    checkpoint = folder / "run.pt"
    shutil.copyfile(first_epoch[1], checkpoint)
    return checkpoint


@pytest.mark.distributed
def test_train_ddp_learns_the_example_and_resumes_at_the_epoch_boundary(
    example_out: Path, first_epoch: tuple[str, Path], tmp_path: Path
) -> None:
    # one epoch, then the same command asked for two: it resumes into epoch 1 and trains only it
    first = first_epoch[0]
    checkpoint = copy_checkpoint(first_epoch, tmp_path)
    assert re.findall(r"epoch (\d+): (\d+) batches", first) == [("0", str(BATCHES))]
    second = run_job(
        torchrun(str(example_out), "--epochs", "2", "--checkpoint", str(checkpoint)), 240
    )
    assert "epoch 1 comes next" in second
    assert re.findall(r"epoch (\d+): (\d+) batches", second) == [("1", str(BATCHES))]
    right, total = (
        int(v) for v in re.findall(r"accuracy [\d.]+ \((\d+) of (\d+) samples\)", second)[0]
    )
    assert total == SAMPLES  # every sample scored exactly once
    assert right >= 0.9 * SAMPLES, second[-2000:]
    # finished: the same command again trains nothing
    third = run_job(
        torchrun(str(example_out), "--epochs", "2", "--checkpoint", str(checkpoint)), 240
    )
    assert "epoch 2 comes next" in third
    assert not re.findall(r"epoch \d+: \d+ batches", third)


@pytest.mark.distributed
def test_train_ddp_refuses_a_checkpoint_of_another_build(
    example_out: Path, first_epoch: tuple[str, Path], tmp_path: Path
) -> None:
    checkpoint = copy_checkpoint(first_epoch, tmp_path)
    other = tmp_path / "other"
    shardprep.build(
        str(example_out.parent / "raw"), str(other), shards=4, workers=1, progress=False
    )
    result = run_bounded(
        torchrun(str(other), "--checkpoint", str(checkpoint)), 240, cwd=ROOT, env=job_env()
    )
    assert result.returncode != 0
    expected = (
        f"{checkpoint}: a checkpoint of another build (not {other}); "
        "pass another --checkpoint path, or delete it to start over"
    )
    assert (result.stdout + result.stderr).count(expected) == 1
