"""The Lightning side of ``lightning_job.py``: fits whose model records the keys it trains on.

One job runs several ``Trainer.fit`` calls in turn (``FITS``), on the same
DDP processes (``--devices``, 2 by default): starting Lightning's ranks costs
far more than a fit of 30 small steps. Every fit builds a new model, dataset
and DataLoader, so each starts where a fresh process would (ShardDataset's
epoch count at 0). A fit may resume from a checkpoint another job wrote at
another world size (elastic resume).

Each rank writes ``<workdir>/<fit>/rank<r>.json``: the keys of every batch it
trained on, with the batch's epoch and position, plus the loader's length
(or, for a fit expected to be refused, the error).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.data import sized_len
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from loader import ShardDataset
from loader.torch.batch import POSITION
from tests.integrations.lightning_fits import (
    ALL_FITS,
    DATASET_OPTIONS,
    FITS,
    NUM_WORKERS,
    SAVE_EVERY,
    Fit,
)


class KeyRecorder(L.LightningModule):
    """A one-parameter model whose training step records the keys of its batch."""

    def __init__(self, data: str, fit: Fit, record: Path) -> None:
        super().__init__()
        self.data, self.fit, self.record = data, fit, record
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.steps: list[dict[str, Any]] = []
        self.loader_len: int | None = None
        self.last_position: dict[str, int] | None = None
        self.shard_state: dict[str, Any] | None = None  # from the checkpoint (hooks)
        # built before the process group exists: the rank is resolved when iteration starts
        self.dataset = self._dataset() if fit.build_in_init else None

    def _dataset(self) -> ShardDataset:
        return ShardDataset(self.data, **DATASET_OPTIONS)

    def train_dataloader(self) -> DataLoader[Any]:
        if self.dataset is None:
            self.dataset = self._dataset()
        dataset = self.dataset
        if self.fit.epoch_hook:
            dataset.set_epoch(self.trainer.fit_loop.epoch_progress.current.processed)
        if self.shard_state is not None:
            dataset.resume(self.shard_state)  # before Lightning asks len()
        # forkserver, never fork: gloo's threads can deadlock a forked worker on Python 3.11
        options: dict[str, Any] = {
            "batch_size": None,
            "num_workers": NUM_WORKERS,
            "multiprocessing_context": "forkserver",
            "persistent_workers": self.fit.persistent,
        }
        loader_type = StatefulDataLoader if self.fit.stateful else DataLoader
        loader: DataLoader[Any] = loader_type(dataset, **options)
        self.loader_len = sized_len(loader)  # None in an epoch resumed at another world
        return loader

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        position = batch[POSITION]
        self.last_position = dict(position)
        self.steps.append(
            {
                "epoch": self.current_epoch,
                "global_step": self.global_step,
                "batch_idx": batch_idx,
                # Lightning's own verdict: the epoch's last batch (end-of-epoch validation runs)
                "last": self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch,
                "position": [position["epoch"], position["batch"]],
                "keys": list(batch["__key__"]),
            }
        )
        real: torch.Tensor = (~batch["__padded__"]).float().sum()
        loss: torch.Tensor = ((self.weight - 1) * real).pow(2).sum()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.fit.hooks and self.last_position is not None:
            # the same on every rank: rank 0's copy, the one Lightning writes, fits all
            assert self.dataset is not None
            checkpoint["shard_state"] = self.dataset.state_after({POSITION: self.last_position})

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.fit.hooks:
            self.shard_state = checkpoint["shard_state"]

    def on_train_end(self) -> None:
        result = {
            "steps": self.steps,
            "loader_len": self.loader_len,
            "num_training_batches": self.trainer.num_training_batches,
            "world_size": self.trainer.world_size,
        }
        (self.record / f"rank{self.global_rank}.json").write_text(json.dumps(result))


def run_fit(name: str, data: str, workdir: Path, devices: int) -> None:
    fit = ALL_FITS[name]
    record = workdir / name
    record.mkdir(parents=True, exist_ok=True)
    ckpt_dir = record / "checkpoints"
    callbacks: list[L.Callback] = []
    if fit.stop:
        callbacks = [
            ModelCheckpoint(ckpt_dir, "{step}", every_n_train_steps=SAVE_EVERY, save_top_k=-1),
            # saved by on_train_epoch_end: after epoch 0, and again when max_steps ends epoch 1
            ModelCheckpoint(ckpt_dir, "{epoch}-end", save_top_k=-1, save_on_train_epoch_end=True),
        ]
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=devices,
        max_epochs=fit.epochs,
        max_steps=fit.stop_at if fit.stop else -1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        num_sanity_val_steps=0,
    )
    model = KeyRecorder(data, fit, record)
    ckpt_path = (
        None if fit.resume is None else workdir / fit.resume[0] / "checkpoints" / fit.resume[1]
    )
    if not fit.refused:
        trainer.fit(model, ckpt_path=ckpt_path)
        return
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    except Exception as error:  # the finding is the error itself
        result = {"error": type(error).__name__, "message": str(error), "steps": model.steps}
        (record / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
        # the traceback's frames hold the DataLoader iterator: free its workers now
        traceback.clear_frames(error.__traceback__)
        return
    raise AssertionError(f"fit {name} was expected to be refused and ran to its end")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--devices", type=int, default=2, help="DDP ranks (the world size)")
    parser.add_argument("--fits", default=",".join(FITS), help="comma-separated names")
    args = parser.parse_args()
    # Workers unpickle a ShardDataset: import torch and the loader once, in the fork server.
    multiprocessing.set_forkserver_preload(["loader.torch.dataset"])
    for name in args.fits.split(","):
        run_fit(name, args.data, args.workdir, args.devices)
