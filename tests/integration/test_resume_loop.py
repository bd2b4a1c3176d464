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


def train_stateful(
    built: Path, state: dict[str, Any] | None, stop_after: int | None
) -> tuple[list[tuple[int, tuple[str, ...]]], dict[str, Any] | None]:
    """The same loop over torchdata's StatefulDataLoader, its epoch from ``next_position``."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset = ShardDataset(str(built), batch_size=BATCH_SIZE, rank=0, world_size=2)
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True)
    start = 0
    if state is not None:
        loader.load_state_dict(state)
        start = dataset.next_position(state).epoch
    trained: list[tuple[int, tuple[str, ...]]] = []
    saved = None
    for epoch in range(start, EPOCHS):
        for batch in loader:
            trained.append((epoch, tuple(batch["__key__"].tolist())))
            saved = loader.state_dict()
            if len(trained) == stop_after:
                return trained, saved
    return trained, saved


@pytest.mark.parametrize("where", ["mid-epoch", "last batch"])
def test_next_position_of_both_protocols(built: Path, where: str) -> None:
    pytest.importorskip("torchdata")
    per_epoch = len(make(built)[0])
    stop = 3 if where == "mid-epoch" else per_epoch
    expected = (0, 3) if where == "mid-epoch" else (1, 0)
    _, plain = train(built, None, stop)
    _, torchdata_state = train_stateful(built, None, stop)
    dataset = make(built)[0]
    assert plain is not None and torchdata_state is not None
    assert tuple(dataset.next_position(plain)) == expected
    assert tuple(dataset.next_position(torchdata_state)) == expected
    dataset.resume(plain)
    assert dataset.epoch == expected[0]


@pytest.mark.parametrize("where", ["mid-epoch", "last batch"])
def test_the_stateful_loop_trains_exactly_the_remaining_batches(built: Path, where: str) -> None:
    pytest.importorskip("torchdata")
    reference, _ = train_stateful(built, None, None)
    per_epoch = len(make(built)[0])
    stop = 3 if where == "mid-epoch" else per_epoch
    before, state = train_stateful(built, None, stop)
    after, _ = train_stateful(built, state, None)
    assert before + after == reference


def test_next_position_refuses_other_states(built: Path) -> None:
    from loader import IncompatibleStateError

    with pytest.raises(IncompatibleStateError, match="cannot tell where to continue"):
        make(built)[0].next_position({"model": 1})


def test_set_epoch_wins_over_a_loaded_state_in_the_resumed_rotation(built: Path) -> None:
    """set_epoch(1), then load_state_dict of a state 3 batches into epoch 0 (Lightning's recipe
    at a last-batch checkpoint does this): epoch 1 from its first batch, in order, although
    torchdata resumes its rotation at the worker after the one that made batch 2."""
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    reference, _ = train_stateful(built, None, None)
    _, state = train_stateful(built, None, 3)
    dataset = ShardDataset(str(built), batch_size=BATCH_SIZE, rank=0, world_size=2)
    dataset.set_epoch(1)
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=2)
    loader.load_state_dict(state)
    batches = list(loader)
    assert [b["__position__"]["epoch"] for b in batches] == [1] * len(batches)
    assert [b["__position__"]["batch"] for b in batches] == list(range(len(batches)))
    assert [tuple(b["__key__"].tolist()) for b in batches] == [k for e, k in reference if e == 1]
