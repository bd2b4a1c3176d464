"""Mixtures in one process: class weights per source, NumPy batches, refusals."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest
import torch.utils.data

from loader import IncompatibleStateError
from loader.compose.groups import GroupedStream
from loader.compose.mix import MixedPlan, MixedStream, PerSourcePlan
from loader.core import ShardStream
from loader.torch.mixdataset import GroupedDataset, MixedDataset


def test_class_weights_of_a_source_still_apply(built: Path, built_zstd: Path) -> None:
    """built (60/30/13 over classes a/b/c) balanced inside a mixture: its classes come out even."""
    balanced = ShardStream(str(built), class_weights="balanced", decode=True)
    mix = MixedStream([balanced, str(built_zstd)], [0.5, 0.5], batch_size=10,
                      samples_per_epoch=618)  # fmt: skip
    assert mix.counts(1) == [309, 309]  # 3 laps of built's 103
    labels: Counter[int] = Counter()
    for batch in mix.iterate(0):
        sources = batch["__source__"].tolist()
        labels.update(c for c, s in zip(batch["cls"], sources, strict=True) if s == 0)
    assert sum(labels.values()) == 309
    # "balanced" resamples each lap to 35/34/34 of 103 (apportion), three laps
    assert sorted(labels.values()) == [102, 102, 105]


def test_numpy_mixture_slots_and_start(built: Path, built_zstd: Path) -> None:
    mix = MixedStream([str(built), str(built_zstd)], [1, 3], batch_size=8, seed=3)
    # N = 103 + 1001 = 1104: 276 and 828, over 2 ranks: 138 and 414 each
    assert mix.counts(2) == [138, 414] and mix.samples_per_rank(2) == 552
    slots = [list(mix.iterate(1, rank=1, world_size=2, worker=w, num_workers=2)) for w in (0, 1)]
    assert [b["__position__"]["batch"] for b in slots[1]] == list(range(1, 69, 2))
    assert sum(len(b["__key__"]) for s in slots for b in s) == 552
    later = list(mix.iterate(1, rank=1, world_size=2, worker=1, num_workers=2, start=4))
    assert [b["__key__"].tolist() for b in later] == [b["__key__"].tolist() for b in slots[1][4:]]


def test_mixtures_resume_in_their_own_world_only(built: Path, built_zstd: Path) -> None:
    ds = MixedDataset([str(built), str(built_zstd)], [1, 1], batch_size=8, rank=0, world_size=2)
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=None)))
    state = ds.state_after(batch)
    other = MixedDataset([str(built), str(built_zstd)], [1, 1], batch_size=8, rank=0, world_size=3)
    with pytest.raises(IncompatibleStateError, match="same world size"):
        other.resume(state)
    with pytest.raises(IncompatibleStateError, match="weights"):
        MixedDataset([str(built), str(built_zstd)], [1, 2], batch_size=8, rank=0,
                     world_size=2).resume(state)  # fmt: skip
    with pytest.raises(ValueError, match="one weight per source"):
        MixedStream([str(built)], [1, 2], batch_size=8)
    with pytest.raises(ValueError, match="batch_size"):
        MixedStream([ShardStream(str(built), batch_size=4)], [1], batch_size=8)


def test_groups_need_every_rank_once(built: Path) -> None:
    from loader.errors import WorldMismatchError

    with pytest.raises(WorldMismatchError, match="once each"):
        GroupedStream([(str(built), [0, 1]), (str(built), [1, 2])], batch_size=4)
    with pytest.raises(WorldMismatchError, match="fewer samples than one batch"):
        GroupedStream([(str(built), [0, 1])], batch_size=64)
    grouped = GroupedStream([(str(built), [0]), (str(built), [1, 2])], batch_size=4,
                            steps_per_epoch=40)  # fmt: skip
    # 40 steps x 4 = 160 samples per rank: the 2-rank group repeats (320 > 103)
    keys = [k for b in grouped.iterate(0, rank=2) for k in b["__key__"].tolist()]
    assert len(keys) == 160 and max(Counter(keys).values()) <= 4


def test_mixture_resumes_through_torchdata(built: Path, built_zstd: Path) -> None:
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> MixedDataset:
        return MixedDataset([str(built), str(built_zstd)], [1, 2], batch_size=16,
                            batching="per_source", rank=1, world_size=2)  # fmt: skip

    def keys(loader: StatefulDataLoader) -> list[list[str]]:
        return [list(b["__key__"]) for b in loader]

    whole = keys(StatefulDataLoader(make(), batch_size=None, num_workers=2))
    assert len(whole) == len(make())
    first = StatefulDataLoader(make(), batch_size=None, num_workers=2)
    iterator, done = iter(first), []
    for _ in range(5):
        done.append(list(next(iterator)["__key__"]))
    state = first.state_dict()
    second = StatefulDataLoader(make(), batch_size=None, num_workers=2)
    second.load_state_dict(state)
    assert done + keys(second) == whole


def _digest(mix: MixedStream, epoch: int, **where: int) -> tuple[str, int]:
    """sha256 (16 hex) of the batches' keys and sources, as [[keys], [sources]] JSON, and count."""
    batches = [[[str(k) for k in b["__key__"]], b["__source__"].tolist()]
               for b in mix.iterate(epoch, **where)]  # fmt: skip
    return hashlib.sha256(json.dumps(batches).encode()).hexdigest()[:16], len(batches)


def test_the_lazy_plans_stream_the_pinned_batches(built: Path, built_zstd: Path) -> None:
    """Pinned digests of whole (rank, slot) streams.

    per_source, and mixed where no batch carries an extra sample, are the
    digests of the eager implementation before issue 23 (same batches, order
    and samples). Mixed with extras (300 by 2:1, batches of 10 over 2 ranks:
    100 and 50 per rank, 6.67/3.33 per batch) changed on purpose: the same
    rows in the affine order instead of a stored permutation (was 609d07d59e6652d8).
    """
    balanced = ShardStream(str(built), class_weights="balanced")
    cases = [
        (MixedStream([str(built), str(built_zstd)], [1, 3], batch_size=8,
                     batching="per_source", seed=3), 0, {}, ("c2dd2b7de96acafb", 139)),
        (MixedStream([balanced, str(built_zstd)], [1, 2], batch_size=7, samples_per_epoch=5000,
                     batching="per_source", drop_last=True, seed=3), 3,
         {"rank": 1, "world_size": 2, "worker": 1, "num_workers": 2, "start": 2},
         ("f128695945a0081f", 176)),
        (MixedStream([balanced, str(built_zstd)], [1, 1], batch_size=30, samples_per_epoch=2300,
                     seed=3), 3, {"rank": 1, "world_size": 2}, ("86213d3cc414f530", 39)),
        (MixedStream([str(built), str(built_zstd)], [2, 1], batch_size=10, samples_per_epoch=300,
                     seed=3), 3, {"rank": 1, "world_size": 2}, ("50b25e551919300d", 15)),
    ]  # fmt: skip
    for mix, epoch, where, expected in cases:
        assert _digest(mix, epoch, **where) == expected


def test_a_state_of_the_earlier_mixed_order_is_refused(built: Path, built_zstd: Path) -> None:
    ds = MixedDataset([str(built), str(built_zstd)], [1, 1], batch_size=8, rank=0, world_size=1)
    state = ds.state_after({"__position__": {"epoch": 0, "batch": 3, "num_workers": 1}})
    assert state["mix_plan"] == 2
    del state["mix_plan"]  # as saved before the plans were lazy
    with pytest.raises(IncompatibleStateError, match="mix_plan=None but this run has mix_plan=2"):
        MixedDataset([str(built), str(built_zstd)], [1, 1], batch_size=8, rank=0,
                     world_size=1).resume(state)  # fmt: skip


def test_bad_weights_are_refused_naming_the_weight(built: Path) -> None:
    with pytest.raises(ValueError, match=r"weight 0 of the mixture is inf: every weight must be"):
        MixedDataset([str(built), str(built)], [float("inf"), 1], batch_size=4)
    with pytest.raises(ValueError, match=r"weight 1 of the mixture is nan"):
        MixedDataset([str(built), str(built)], [1, float("nan")], batch_size=4)
    with pytest.raises(ValueError, match=r"are all zero"):
        MixedDataset([str(built), str(built)], [0, 0], batch_size=4)


def test_the_documented_counts_and_plan_of_a_mixed_dataset(built: Path, built_zstd: Path) -> None:
    """docs/mixing.md's example on the dataset itself: N = 3000, weights 0.2/0.3/0.5, 3 ranks.

    ``ds.counts``, ``ds.epoch_counts``, ``ds.samples_per_rank``, ``ds.batches_per_rank`` and
    ``ds.plan`` (200/300/500 per rank; B = 30: 33 batches of 6/9/15 and one of 2/3/5), and the
    batches a rank streams hold exactly the plan's rows.
    """
    sources = [str(built), str(built_zstd), str(built)]
    ds = MixedDataset(sources, [0.2, 0.3, 0.5], batch_size=30, samples_per_epoch=3000,
                      rank=1, world_size=3)  # fmt: skip
    assert ds.counts(3) == [200, 300, 500]
    assert ds.epoch_counts(3) == [600, 900, 1500]
    assert ds.samples_per_rank(3) == 1000 == ds.num_samples
    assert ds.counts(1) == [600, 900, 1500] and ds.epoch_counts(2) == [600, 900, 1500]
    assert ds.counts(7) == [85, 128, 214] and ds.epoch_counts(7) == [595, 896, 1498]
    plan = ds.plan(0, 3)
    assert isinstance(plan, MixedPlan)
    rows = list(plan)
    assert len(plan) == len(rows) == ds.batches_per_rank(3) == len(ds) == 34
    assert rows[-1] == plan.row(33) == [2, 3, 5]
    assert Counter(map(tuple, rows[:-1])) == {(6, 9, 15): 33}
    streamed = list(torch.utils.data.DataLoader(ds, batch_size=None))
    assert [torch.bincount(b["__source__"], minlength=3).tolist() for b in streamed] == rows

    per_source = MixedDataset(sources, [0.2, 0.3, 0.5], batch_size=30, samples_per_epoch=3000,
                              batching="per_source", drop_last=True, rank=0, world_size=3)  # fmt: skip
    plan = per_source.plan(2, 3)
    assert isinstance(plan, PerSourcePlan)
    # floor(200/30), floor(300/30), floor(500/30) batches of 30, one source each
    assert sorted(Counter(r.index(30) for r in plan).items()) == [(0, 6), (1, 10), (2, 16)]
    assert len(plan) == per_source.batches_per_rank(3) == len(per_source) == 32


def test_the_documented_counts_of_a_grouped_dataset(built: Path, built_zstd: Path) -> None:
    """A = 103 and B = 1001 samples, 2 ranks each, B = 16: S = min(103 // 32, 1001 // 32) = 3."""
    from loader.errors import WorldMismatchError

    ds = GroupedDataset([(str(built), [0, 1]), (str(built_zstd), [2, 3])], batch_size=16,
                        rank=3, world_size=4)  # fmt: skip
    assert ds.samples_per_rank(4) == 48 == ds.num_samples
    assert ds.batches_per_rank(4) == len(ds) == 3
    with pytest.raises(WorldMismatchError, match="make a world of 4, not 3"):
        ds.samples_per_rank(3)
