"""The README's resume loop, as written: ``for epoch in range(dataset.epoch, EPOCHS)`` after
``dataset.resume(state)`` runs exactly the batches the interrupted run had not trained on, whether
the state was saved mid-epoch or on an epoch's last batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.utils.data

from loader import ShardDataset

EPOCHS = 3
BATCH_SIZE = 8


def make(built: Path) -> tuple[ShardDataset, torch.utils.data.DataLoader[Any]]:
    dataset = ShardDataset(str(built), batch_size=BATCH_SIZE, rank=0, world_size=2)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=2, persistent_workers=True
    )
    return dataset, loader


def train(
    built: Path, state: dict[str, Any] | None, stop_after: int | None
) -> tuple[list[tuple[int, tuple[str, ...]]], dict[str, Any] | None]:
    """The README loop; returns (epoch, keys) per batch trained and the last state saved."""
    dataset, loader = make(built)
    if state is not None:
        dataset.resume(state)
    trained: list[tuple[int, tuple[str, ...]]] = []
    saved = None
    for epoch in range(dataset.epoch, EPOCHS):
        for batch in loader:
            trained.append((epoch, tuple(batch["__key__"].tolist())))
            saved = dataset.state_after(batch)
            if len(trained) == stop_after:
                return trained, saved  # the crash
    return trained, saved


@pytest.mark.parametrize("where", ["mid-epoch", "last batch"])
def test_the_resume_loop_trains_exactly_the_remaining_batches(built: Path, where: str) -> None:
    reference, _ = train(built, None, None)
    per_epoch = len(make(built)[0])
    assert len(reference) == EPOCHS * per_epoch
    stop = 3 if where == "mid-epoch" else per_epoch  # the crash comes right after the save
    before, state = train(built, None, stop)
    assert state is not None
    after, _ = train(built, state, None)
    assert len(after) == EPOCHS * per_epoch - stop
    assert before + after == reference  # the same epochs, batches and keys, none twice
