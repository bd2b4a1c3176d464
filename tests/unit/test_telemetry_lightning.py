"""docs/loader.md's Lightning recipe for epoch telemetry, run by a real Lightning Trainer (one
CPU process, 2 DataLoader workers): each epoch's ``epoch_stats()`` is logged with exact counts
and the loop's wait seen through ``ds.timed(loader)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.utils.data

from loader import ShardDataset
from loader.read.telemetry import Timed

# Lightning's own use of torch's pytree (not ours; its other tests run in subprocesses)
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning")


class Model(L.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.logged: list[dict[str, float]] = []

    def training_step(self, batch: dict[str, Any], index: int) -> torch.Tensor:
        return (self.weight * len(batch["__key__"])).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    # the recipe (docs/loader.md, "Where the time goes")
    def train_dataloader(self) -> Timed[Any]:
        self.ds = ShardDataset(self.out, batch_size=8)
        return self.ds.timed(torch.utils.data.DataLoader(self.ds, batch_size=None, num_workers=2))

    def on_train_epoch_end(self) -> None:
        self.log_dict(self.ds.epoch_stats().as_dict())
        self.logged.append(self.ds.epoch_stats().as_dict())


def test_the_lightning_recipe_logs_each_epoch(built: Path, tmp_path: Path) -> None:
    model = Model(str(built))
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model)
    assert [(d["epoch"], d["samples"], d["batches"]) for d in model.logged] == [
        (0, 103, 13),
        (1, 103, 13),
    ]
    assert all(d["wait_s"] > 0 and d["compute_s"] > 0 for d in model.logged)
    assert trainer.logged_metrics["samples"] == 103
    assert trainer.num_training_batches == 13  # len() reached Lightning through timed()
