"""Lightning 2.6 DDP (CPU processes, gloo) over a ShardDataset: coverage, equal steps, resume.

One job (``lightning_job.py``) runs every fit of ``lightning_recorder.FITS`` in
turn on the same two ranks; the tests read what each rank trained on. Elastic
resume runs one more job per world size (``lightning_recorder.ELASTIC``: 3, then
2 ranks), resuming the checkpoints the jobs before it wrote.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from torch.utils.data import DataLoader

from loader import ShardDataset
from loader.torch.batch import POSITION
from tests.integrations.conftest import ODD_SAMPLES
from tests.integrations.jobs import python_job, read_ranks, run_job
from tests.integrations.lightning_fits import (
    BATCH_SIZE,
    CHAIN_STOP,
    DATASET_OPTIONS,
    ELASTIC,
    ELASTIC_EPOCHS,
    EPOCHS,
    FITS,
    NUM_WORKERS,
    STOP_AT_STEP,
)
from tests.processes import dataloader_iterator

pytestmark = pytest.mark.distributed

WORLD = 2
PER_RANK = ODD_SAMPLES // WORLD  # uneven="drop": 941 % 2 = 1 sample left out per epoch
BATCHES = math.ceil(PER_RANK / BATCH_SIZE)  # 15: the last one holds 22 samples

Steps = list[list[str]]  # the keys of each step of one rank


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the jobs write their records and checkpoints (later jobs resume earlier ones')."""
    return tmp_path_factory.mktemp("lightning")


@pytest.fixture(scope="module")
def fits(odd_build: Path, workdir: Path) -> dict[str, list[Any]]:
    """Run the Lightning job once; each fit's per-rank records."""
    run_job(
        python_job("lightning_job.py", "--data", str(odd_build), "--workdir", str(workdir)), 240
    )
    return {name: read_ranks(workdir / name, WORLD) for name in FITS}


@pytest.fixture(scope="module")
def elastic(odd_build: Path, workdir: Path, fits: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """The elastic jobs, at 3 and 2 ranks (after ``fits``, whose checkpoints they resume)."""
    records = dict(fits)
    for world, world_fits in ELASTIC.items():
        args = ["--data", str(odd_build), "--workdir", str(workdir), "--devices", str(world)]
        run_job(python_job("lightning_job.py", *args, "--fits", ",".join(world_fits)), 300)
        records.update({name: read_ranks(workdir / name, world) for name in world_fits})
    return records


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


class Elastic(NamedTuple):
    """A job interrupted at ``old`` ranks, resumed at ``new`` ranks from its checkpoint."""

    old: int
    new: int
    stop: str  # the interrupted fit of the StatefulDataLoader recipe (per recipe below)
    resumed: str  # the resumed fit's name, "{recipe}" filled in


# each checkpoint is 5 batches into epoch 1 (step 20 at 2 ranks, step 15 at 3)
DONE = STOP_AT_STEP - BATCHES
ELASTIC_CASES = {
    "2to3": Elastic(2, 3, "stop-{recipe}", "{recipe}-at3"),
    "3to2": Elastic(3, 2, "stop-{recipe}-at3", "{recipe}-from3"),
}


def batches(samples: int) -> int:
    return math.ceil(samples / BATCH_SIZE)


def reference_epoch(data: Path, rank: int, world: int, epoch: int) -> Steps:
    """Rank ``rank``'s batches of a normal ``epoch`` at ``world`` ranks, in this process."""
    ds = ShardDataset(str(data), rank=rank, world_size=world, **DATASET_OPTIONS)
    ds.set_epoch(epoch)
    return [list(b["__key__"]) for b in DataLoader(ds, batch_size=None, num_workers=NUM_WORKERS)]


@pytest.mark.parametrize("recipe", ["stateful", "hooks"])
@pytest.mark.parametrize("case", list(ELASTIC_CASES))
def test_lightning_resumed_at_another_world_size_sees_the_rest_of_the_epoch_once(
    elastic: dict[str, list[Any]], odd_build: Path, case: str, recipe: str
) -> None:
    """Killed mid-epoch 1 at W ranks, resumed at W' from its checkpoint (both recipes). Epoch 1
    takes the 5 batches before the kill plus the rest at W', more or fewer than a normal epoch at
    W', and Lightning keeps one len() for the whole fit: so the dataset has none in that epoch and
    Lightning follows the data. Its own count (batch_idx, is_last_batch) ends each epoch exactly
    where the data does: every sample of epoch 1 once, except the documented drops, then the
    normal epoch 2 at W', key for key."""
    old, new, stop, resumed = ELASTIC_CASES[case]
    stop_records = elastic[stop.format(recipe=recipe)]
    records = elastic[resumed.format(recipe=recipe)]
    # the epoch-1 batches trained before the checkpoint, on the old ranks
    before = [
        step["keys"]
        for rank in range(old)
        for step in stop_records[rank]["steps"]
        if step["position"][0] == 1 and step["position"][1] < DONE
    ]
    assert len(before) == old * DONE
    assigned = ODD_SAMPLES - ODD_SAMPLES % old  # uneven="drop"
    rest = assigned - old * DONE * BATCH_SIZE
    share = rest // new  # per rank at the new world; rest % new left out
    normal = batches(ODD_SAMPLES // new)
    lightning_count = DONE + batches(share)  # where Lightning's count must end epoch 1
    assert lightning_count != normal  # (12 vs 10, 13 vs 15): one len() cannot hold
    after: list[str] = []
    for rank in range(new):
        record = records[rank]
        assert record["world_size"] == new
        assert record["loader_len"] is None and record["num_training_batches"] == math.inf
        epoch1 = [s for s in record["steps"] if s["epoch"] == 1]
        assert [s["position"] for s in epoch1] == [[1, b] for b in range(batches(share))]
        assert [s["batch_idx"] for s in epoch1] == list(range(DONE, lightning_count))
        assert [s["last"] for s in epoch1] == [False] * (len(epoch1) - 1) + [True]
        assert sum(len(s["keys"]) for s in epoch1) == share
        after += [key for s in epoch1 for key in s["keys"]]
        later = [s for s in record["steps"] if s["epoch"] > 1]  # the new world's normal epochs
        epochs = range(2, ELASTIC_EPOCHS)
        assert [s["position"] for s in later] == [[e, b] for e in epochs for b in range(normal)]
        assert [s["batch_idx"] for s in later] == [b for _ in epochs for b in range(normal)]
        assert [s["last"] for s in later] == [
            b == normal - 1 for _ in epochs for b in range(normal)
        ]
        assert [s["keys"] for s in later] == [
            keys for epoch in range(2, ELASTIC_EPOCHS)
            for keys in reference_epoch(odd_build, rank, new, epoch)
        ]  # fmt: skip
        assert len(record["steps"]) == len(epoch1) + len(later)  # nothing else ran
    seen = [key for step in before for key in step] + after
    assert len(seen) == len(set(seen)), "a sample was trained on twice in epoch 1"
    assert len(seen) == assigned - rest % new  # all but the documented drops


def test_both_recipes_resume_the_same_batches(elastic: dict[str, list[Any]]) -> None:
    """The StatefulDataLoader state (loaded by Lightning) and state_after give the same rest."""
    for old, new, _, resumed in ELASTIC_CASES.values():
        for rank in range(new):
            assert keys(elastic[resumed.format(recipe="stateful")], rank) == keys(
                elastic[resumed.format(recipe="hooks")], rank
            ), (old, new, rank)


def test_stateful_restore_without_the_recipe_hook_is_refused_before_training(
    elastic: dict[str, list[Any]],
) -> None:
    """Without the recipe's ds.resume(state_after) from the checkpoint, len() says a normal
    epoch at 3 ranks (10) before Lightning loads the state; the resumed epoch takes 12: refused by
    name at the first batch, before any training step, on every rank."""
    for record in elastic["refused-at3"]:
        assert record["error"] == "IncompatibleStateError", record
        assert record["steps"] == []
        message = record["message"]
        assert "at 3 ranks from this StatefulDataLoader state" in message
        assert "saved at 2 ranks after 5 batches" in message
        assert "12 in the epoch where a normal epoch takes 10" in message
        assert "ds.resume(state) too" in message


def test_stateful_recipe_restarted_again_inside_the_resumed_epoch(
    elastic: dict[str, list[Any]],
) -> None:
    """2 -> 3 -> 2: the 3-rank fit resumed at step 20 stops at step 25, 5 of the 7 batches into
    the resumed epoch, which has no len(): Lightning fetched a batch ahead, so the loader state
    in the checkpoint is one batch per rank past what was trained. The recipe's state_after
    given to ds.resume() wins over it: the 2-rank fit trains the rest of epoch 1, every sample of
    the epoch once but the documented drops (without that rule 3 batches, 96 samples, were lost)."""
    old, mid, new = 2, 3, 2
    passes = [  # (fit, world): each one's epoch-1 steps, all trained
        ("stop-stateful", old, DONE),
        ("stop-stateful-chain3", mid, CHAIN_STOP - STOP_AT_STEP),
        ("stateful-chain2", new, None),
    ]
    share = [(ODD_SAMPLES - ODD_SAMPLES % old) // old]  # each pass's samples per rank
    seen: list[str] = []
    for number, (fit, world, steps) in enumerate(passes):
        for rank in range(world):
            epoch1 = [s for s in elastic[fit][rank]["steps"] if s["epoch"] == 1]
            assert len(epoch1) == (steps if steps is not None else batches(share[-1]))
            assert [s["position"] for s in epoch1] == [[1, b] for b in range(len(epoch1))]
            seen += [key for s in epoch1 for key in s["keys"]]
        if steps is not None:  # the next pass's share of what this one left
            rest = (share[-1] - steps * BATCH_SIZE) * world
            share.append(rest // passes[number + 1][1])
    last = elastic["stateful-chain2"]
    for rank in range(new):
        epoch1 = last[rank]["steps"]
        assert last[rank]["loader_len"] is None
        start = DONE + CHAIN_STOP - STOP_AT_STEP  # Lightning's count: 5 + 5 batches before
        assert [s["batch_idx"] for s in epoch1] == list(range(start, start + len(epoch1)))
        assert [s["last"] for s in epoch1] == [False] * (len(epoch1) - 1) + [True]
    assert len(seen) == len(set(seen)), "a sample was trained on twice in epoch 1"
    # uneven="drop" leaves out 941 % 2 at 2 ranks, then 620 % 3 of the rest at 3, 138 % 2 at 2
    assert share == [470, 206, 69]
    assert len(seen) == ODD_SAMPLES - 1 - 2 - 0


def test_len_error_tells_a_plain_loop_the_batches_left(odd_build: Path) -> None:
    """In process: after 5 batches at 2 ranks, resumed at 3, len() raises and says how many
    batches the pass yields (7, as iterating it gives) and when len() is back."""
    old = ShardDataset(str(odd_build), rank=0, world_size=2, **DATASET_OPTIONS)
    old.set_epoch(1)
    loader = iter(DataLoader(old, batch_size=None))
    for _ in range(DONE):
        batch = next(loader)
    ds = ShardDataset(str(odd_build), rank=0, world_size=3, **DATASET_OPTIONS)
    ds.resume(old.state_after(batch))
    with pytest.raises(TypeError) as refused:
        len(ds)
    message = str(refused.value)
    left = batches((ODD_SAMPLES - 1 - 2 * DONE * BATCH_SIZE) // 3)
    assert f"this pass yields {left} more batches per rank ({DONE} were trained" in message
    assert "the next iter() of the loader" in message
    assert sum(1 for _ in DataLoader(ds, batch_size=None)) == left == 7


def _rank0_keys(ds: ShardDataset, loader_state: dict[str, Any] | None) -> Steps:
    """Rank 0's batches of the rest of the epoch: a StatefulDataLoader given ``loader_state``."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(ds, batch_size=None, num_workers=NUM_WORKERS)
    if loader_state is not None:
        loader.load_state_dict(loader_state)
    with dataloader_iterator(loader) as batches:  # its workers stopped even on a refusal
        return [list(b["__key__"]) for b in batches]


@pytest.mark.parametrize("new", [2, 3])
def test_the_position_given_to_resume_wins_over_a_loaded_loader_state(
    odd_build: Path, new: int
) -> None:
    """In process, rank 0 of 2 with a StatefulDataLoader: its state taken one batch after the
    last trained one (as Lightning's fetch-ahead saves it). ds.resume(state_after(last trained))
    plus load_state_dict(that later state) goes on right after the trained batch, at 2 ranks (the
    pass goes on) and at 3 (a new pass), as ds.resume alone does; a loader state of another
    epoch than the one ds.resume got is refused by name."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    old = ShardDataset(str(odd_build), rank=0, world_size=2, **DATASET_OPTIONS)
    old.set_epoch(1)
    loader = StatefulDataLoader(old, batch_size=None, num_workers=NUM_WORKERS)
    with dataloader_iterator(loader) as stream:  # its workers stopped when left mid-epoch
        trained = [next(stream) for _ in range(DONE)]
        next(stream)  # fetched ahead, never trained
        ahead = loader.state_dict()
    state = old.state_after(trained[-1])

    def fresh() -> ShardDataset:
        ds = ShardDataset(str(odd_build), rank=0, world_size=new, **DATASET_OPTIONS)
        ds.resume(state)
        return ds

    expected = _rank0_keys(fresh(), None)
    assert _rank0_keys(fresh(), ahead) == expected
    assert len(expected) == (BATCHES - DONE if new == 2 else 7)
    later = fresh()
    later.resume(old.state_after({**trained[-1], POSITION: {**trained[-1][POSITION], "epoch": 2}}))
    with pytest.raises(Exception, match="StatefulDataLoader state is of epoch 1 and the state"):
        _rank0_keys(later, ahead)
