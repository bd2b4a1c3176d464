"""Elastic resume through ShardDataset and real DataLoaders: W x K interrupted, W' x K' resumed.

Every rank is simulated in this process (explicit rank/world_size); the DataLoader
and its workers are real. Real gloo ranks: tests/distributed/test_elastic_ddp.py.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch.utils.data

from loader import IncompatibleStateError, ShardDataset
from loader.plan.elastic import pass_share
from tests.processes import dataloader_iterator

OPTIONS: dict[str, Any] = {"batch_size": 4, "shuffle_buffer": 8, "block_size": 8}


def _loader(ds: ShardDataset, workers: int) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)


def _pairs(batch: Any) -> list[tuple[str, bool]]:
    return [(str(k), bool(p)) for k, p in zip(batch["__key__"], batch["__padded__"], strict=True)]


def _interrupted(out: Path, world: int, workers: int, stop: int, uneven: str) -> tuple[list[tuple[str, bool]], dict[str, Any]]:  # fmt: skip
    """Every rank trains ``stop`` batches of epoch 0; the samples seen and the (common) state."""
    seen, states = [], []
    for rank in range(world):
        ds = ShardDataset(str(out), rank=rank, world_size=world, uneven=uneven, **OPTIONS)
        for step, batch in enumerate(_loader(ds, workers)):
            seen += _pairs(batch)
            if step + 1 == stop:
                states.append(ds.state_after(batch))
                break
    assert all(s == states[0] for s in states), "state_after differs between ranks"
    return seen, states[0]


def _resumed(out: Path, world: int, workers: int, state: dict[str, Any], uneven: str) -> tuple[list[list[list[tuple[str, bool]]]], list[ShardDataset]]:  # fmt: skip
    """Every rank's batches of the resumed pass, and the datasets (for the next epoch)."""
    ranks, datasets = [], []
    for rank in range(world):
        ds = ShardDataset(str(out), rank=rank, world_size=world, uneven=uneven, **OPTIONS)
        ds.resume(state)
        ranks.append([_pairs(b) for b in _loader(ds, workers)])
        datasets.append(ds)
    return ranks, datasets


@pytest.mark.parametrize(
    ("old", "new", "uneven", "stop"),
    [((2, 0), (3, 2), "drop", 5), ((4, 2), (3, 0), "pad", 3), ((1, 3), (4, 1), "drop", 11)],
)
def test_the_rest_of_the_epoch_is_split_over_the_new_world(
    built: Path, old: tuple[int, int], new: tuple[int, int], uneven: str, stop: int
) -> None:
    total = 103
    seen, state = _interrupted(built, *old, stop, uneven)
    assert state["world_size"] == old[0] and state["num_workers"] == max(1, old[1])
    assert state["batches"] == stop and state["history"] == []
    ranks, datasets = _resumed(built, *new, state, uneven)
    assert len({len(r) for r in ranks}) == 1, "ranks took different numbers of steps"
    before = [k for k, padded in seen if not padded]
    # The rest: what the old world had assigned and not yet streamed, padding excluded.
    per_rank = pass_share(total, old[0], uneven)
    assigned = min(total, per_rank * old[0])
    rest = assigned - len(before)
    share = pass_share(rest, new[0], uneven)
    assert [sum(map(len, r)) for r in ranks] == [share] * new[0]
    after = [k for r in ranks for b in r for k, padded in b if not padded]
    real = Counter(before + after)
    assert max(real.values()) == 1, "a sample was streamed twice in the epoch"
    left_out = (total - assigned) + (rest - min(rest, share * new[0]))
    assert len(real) == total - left_out
    # The next epoch is the new world's normal epoch 1.
    for rank, ds in enumerate(datasets):
        fresh = ShardDataset(str(built), rank=rank, world_size=new[0], uneven=uneven, **OPTIONS)
        fresh.set_epoch(1)
        following = [_pairs(b) for b in _loader(ds, new[1])]
        assert following == [_pairs(b) for b in _loader(fresh, new[1])]


def test_a_resumed_pass_can_be_interrupted_and_resumed_again(built: Path) -> None:
    """3 x 1 for 4 batches, 2 x 2 for 3 batches, then 4 x 0 to the end: once each."""
    seen, state = _interrupted(built, 3, 1, 4, "drop")
    second = []
    states = []
    for rank in range(2):
        ds = ShardDataset(str(built), rank=rank, world_size=2, **OPTIONS)
        ds.resume(state)
        for step, batch in enumerate(_loader(ds, 2)):
            second += _pairs(batch)
            if step == 2:
                states.append(ds.state_after(batch))
                break
    assert states[0] == states[1]
    assert states[0]["history"] == [[3, 1, 4]] and states[0]["batches"] == 3
    ranks, _ = _resumed(built, 4, 0, states[0], "drop")
    after = [k for r in ranks for b in r for k, _ in b]
    real = Counter([k for k, _ in seen + second] + after)
    assert max(real.values()) == 1
    # 103 - 103 % 3 = 102 assigned; 48 + 24 consumed; 30 left, 4 ranks: 7 each, 2 left out
    assert len(seen) == 48 and len(second) == 24 and len(after) == 28
    assert len(real) == 100
    # Resuming the same state at its own world continues that pass (no new split).
    same, _ = _resumed(built, 2, 2, states[0], "drop")
    rest = Counter(k for r in same for b in r for k, _ in b)
    assert max(rest.values()) == 1 and sum(rest.values()) == 30  # 2 ranks x (27 - 12)
    assert set(rest).isdisjoint(k for k, _ in seen + second)
    assert len(set(rest) | {k for k, _ in seen + second}) == 102  # all 102 once


def _torchdata_interrupted(out: Path, world: int, workers: int, stop: int) -> tuple[list[str], list[dict[str, Any]]]:  # fmt: skip
    """Every rank trains ``stop`` batches of epoch 0 through a StatefulDataLoader; seen keys, states."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    seen, states = [], []
    for rank in range(world):
        ds = ShardDataset(str(out), rank=rank, world_size=world, **OPTIONS)
        loader = StatefulDataLoader(ds, batch_size=None, num_workers=workers)
        with dataloader_iterator(loader) as batches:  # its workers stopped when left mid-epoch
            for step, batch in enumerate(batches):
                seen += [str(k) for k in batch["__key__"]]
                if step + 1 == stop:
                    states.append(loader.state_dict())
                    break
    return seen, states


@pytest.mark.parametrize(("old", "new"), [((2, 2), (3, 2)), ((3, 0), (2, 0)), ((2, 2), (1, 2))])
def test_a_torchdata_state_resumes_at_another_world_size_through_load_state_dict(
    built: Path, old: tuple[int, int], new: tuple[int, int]
) -> None:
    """A StatefulDataLoader state (as Lightning checkpoints it) loaded by a StatefulDataLoader at
    another world size with the same num_workers, and given to ds.resume() too (so that len()
    knows the resumed epoch): the rest of the epoch, once each, in batch order, the same as
    ds.resume(state_after) gives; then the new world's normal epoch 1."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    stop = 5
    seen, states = _torchdata_interrupted(built, *old, stop)
    _, reference_state = _interrupted(built, old[0], old[1], stop, "drop")
    expected, _ = _resumed(built, *new, reference_state, "drop")
    for rank in range(new[0]):
        ds = ShardDataset(str(built), rank=rank, world_size=new[0], **OPTIONS)
        ds.resume(states[0])
        loader = StatefulDataLoader(ds, batch_size=None, num_workers=new[1])
        loader.load_state_dict(states[0])  # every rank loads rank 0's state (Lightning's)
        batches = list(loader)
        assert [_pairs(b) for b in batches] == expected[rank]
        assert [b["__position__"]["batch"] for b in batches] == list(range(len(batches)))
        fresh = ShardDataset(str(built), rank=rank, world_size=new[0], **OPTIONS)
        fresh.set_epoch(1)
        assert [_pairs(b) for b in loader] == [_pairs(b) for b in _loader(fresh, new[1])]
    after = [k for r in expected for b in r for k, _ in b]
    real = Counter(seen + after)
    assert max(real.values()) == 1, "a sample was streamed twice in the epoch"
    assert len(seen) == old[0] * stop * OPTIONS["batch_size"]


def test_a_torchdata_state_at_another_num_workers_goes_through_resume(built: Path) -> None:
    """torchdata restores its own num_workers only: the state is refused by name there, and
    ds.resume(loader_state) with a fresh StatefulDataLoader does the re-split instead."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    seen, states = _torchdata_interrupted(built, 2, 2, 3)
    _, reference_state = _interrupted(built, 2, 2, 3, "drop")
    expected, _ = _resumed(built, 3, 1, reference_state, "drop")
    for rank in range(3):
        ds = ShardDataset(str(built), rank=rank, world_size=3, **OPTIONS)
        ds.resume(states[0])
        batches = [_pairs(b) for b in StatefulDataLoader(ds, batch_size=None, num_workers=1)]
        assert batches == expected[rank]
    stream = iter(ShardDataset(str(built), rank=0, world_size=2, **OPTIONS))
    worker_state = states[0]["_snapshot"]["_worker_snapshots"]["worker_0"]["fetcher_state"]
    with pytest.raises(IncompatibleStateError, match=r"num_workers.*ShardDataset.resume"):
        stream.load_state_dict(worker_state["dataset_iter_state"])  # saved with 2, here 1


def test_len_is_unknown_in_an_epoch_resumed_at_another_world(built: Path) -> None:
    """2 x 2 stopped after 5 batches, resumed at 3 x 2: epoch 0 then takes 5 + 5 batches per
    rank, a normal epoch 9, so no len() (TypeError, an unsized loader to Lightning) until the
    next epoch's pass starts; at the saved world, or after set_epoch of another epoch, len()."""
    _, state = _interrupted(built, 2, 2, 5, "drop")
    ds = ShardDataset(str(built), rank=0, world_size=3, **OPTIONS)
    normal = len(ds)
    ds.resume(state)
    with pytest.raises(TypeError, match=r"epoch 0 resumed at 3 ranks takes 10 batches"):
        len(_loader(ds, 2))
    assert sum(1 for _ in _loader(ds, 2)) == 10 - 5  # the rest, re-split
    with pytest.raises(TypeError):
        len(ds)  # the resumed epoch is over, but the next one has not started yet
    loader = iter(_loader(ds, 2))
    next(loader)  # epoch 1's pass has started
    assert len(ds) == normal
    ds.resume(state)
    ds.set_epoch(1)
    assert len(ds) == normal
    same = ShardDataset(str(built), rank=0, world_size=2, **OPTIONS)
    same.resume(state)
    assert len(same) == len(ShardDataset(str(built), rank=0, world_size=2, **OPTIONS))


@pytest.mark.parametrize("new", [3, 1])
def test_a_torchdata_state_of_another_epoch_length_needs_resume_too(built: Path, new: int) -> None:
    """At the new world the restored epoch takes more (3 ranks) or fewer (1 rank) batches than
    a normal one, which len() cannot know when only the loader loads the state (Lightning reads
    len() first): refused by name at the first batch. Given to ds.resume(state) too, the same
    state loads and streams the rest."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    _, states = _torchdata_interrupted(built, 2, 2, 5)
    _, reference_state = _interrupted(built, 2, 2, 5, "drop")
    expected, _ = _resumed(built, new, 2, reference_state, "drop")
    ds = ShardDataset(str(built), rank=0, world_size=new, **OPTIONS)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    normal = len(loader)
    loader.load_state_dict(states[0])
    refusal = rf"saved at 2 ranks after 5 batches.*where a normal epoch takes {normal}"
    with (
        pytest.raises(IncompatibleStateError, match=refusal),
        dataloader_iterator(loader) as batches,
    ):
        next(batches)  # the failed iterator's workers are stopped on leaving, not at a later gc
    ds = ShardDataset(str(built), rank=0, world_size=new, **OPTIONS)
    ds.resume(states[0])  # the recipe: before len() is asked
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    with pytest.raises(TypeError):
        len(loader)
    loader.load_state_dict(states[0])
    assert [_pairs(b) for b in loader] == expected[0]
