"""The LightningModule of test_telemetry_lightning.py: docs/loader.md's Lightning recipe for epoch
telemetry. Apart from the test so that collecting the tests does not import Lightning (about 5 s
of CPU per pytest process)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.utils.data

from loader import ShardDataset
from loader.read.telemetry import Timed


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
