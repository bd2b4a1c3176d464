"""Properties of plan_shards over many class distributions, sample sizes and shard counts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

from shardprep.format.errors import PlanError
from shardprep.plan import plan_shards
from tests.strategies import (
    PlanCase,
    plan_cases,
    plan_cases_with_copies,
    realistic_plan_cases,
)


def _plan(case: PlanCase) -> list[np.ndarray]:
    return plan_shards(case.labels, case.sizes, case.num_shards, case.seed)


@given(plan_cases())
def test_every_sample_exactly_once(case: PlanCase) -> None:
    plan = _plan(case)
    assert len(plan) == case.num_shards
    joined = np.concatenate(plan)
    assert joined.dtype.kind == "i"
    assert len(joined) == case.n
    assert np.array_equal(np.sort(joined), np.arange(case.n))


@given(plan_cases())
def test_shard_counts_differ_by_at_most_one(case: PlanCase) -> None:
    counts = sorted(len(p) for p in _plan(case))
    low, extra = divmod(case.n, case.num_shards)
    # exactly `extra` shards get one more: nothing else sums to n within ±1
    assert counts == [low] * (case.num_shards - extra) + [low + 1] * extra


@given(plan_cases())
def test_each_class_is_floor_or_ceil_per_shard(case: PlanCase) -> None:
    plan = _plan(case)
    for value in np.unique(case.labels):
        total = int(np.sum(case.labels == value))
        floor, ceil = total // case.num_shards, -(-total // case.num_shards)
        per_shard = [int(np.sum(case.labels[p] == value)) for p in plan]
        assert set(per_shard) <= {floor, ceil}, (value, per_shard)
        assert sum(per_shard) == total


@given(plan_cases())
def test_same_seed_same_arrays(case: PlanCase) -> None:
    first = _plan(case)
    # the same values in other dtypes and containers give the same plan
    second = plan_shards(
        case.labels.astype(np.int32), list(case.sizes.tolist()), case.num_shards, case.seed
    )
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(a, b)


@given(plan_cases())
def test_inputs_are_not_modified(case: PlanCase) -> None:
    labels, sizes = case.labels.copy(), case.sizes.copy()
    _plan(case)
    assert np.array_equal(case.labels, labels)
    assert np.array_equal(case.sizes, sizes)


@given(plan_cases(max_per_class=80).filter(lambda c: c.n >= 40))
def test_different_seed_gives_a_different_plan(case: PlanCase) -> None:
    # Few shards, so some shard holds >= 10 samples: equal orders by chance have
    # probability < 1/10!, i.e. "almost surely" different.
    num_shards = max(1, min(case.num_shards, case.n // 10))
    a = plan_shards(case.labels, case.sizes, num_shards, case.seed)
    b = plan_shards(case.labels, case.sizes, num_shards, case.seed + 1)
    assert any(not np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@given(plan_cases_with_copies())
def test_copies_keep_every_guarantee(data: tuple[PlanCase, np.ndarray]) -> None:
    case, groups = data
    plan = plan_shards(case.labels, case.sizes, case.num_shards, case.seed, groups=groups)
    assert np.array_equal(np.sort(np.concatenate(plan)), np.arange(case.n))
    counts = [len(p) for p in plan]
    assert max(counts) - min(counts) <= 1
    for value in np.unique(case.labels):
        total = int(np.sum(case.labels == value))
        per_shard = {int(np.sum(case.labels[p] == value)) for p in plan}
        assert per_shard <= {total // case.num_shards, -(-total // case.num_shards)}
    again = plan_shards(case.labels, case.sizes, case.num_shards, case.seed, groups=groups)
    assert all(np.array_equal(a, b) for a, b in zip(plan, again, strict=True))


@given(plan_cases_with_copies())
def test_copies_of_a_source_go_to_different_shards(data: tuple[PlanCase, np.ndarray]) -> None:
    """At most N copies of a source: each on its own shard (so never adjacent either)."""
    case, groups = data
    plan = plan_shards(case.labels, case.sizes, case.num_shards, case.seed, groups=groups)
    copies = np.bincount(groups)
    for part in plan:
        held = groups[part]
        spread = held[copies[held] <= case.num_shards]
        assert len(np.unique(spread)) == len(spread), "two copies of one source in a shard"


def test_copies_example() -> None:
    """Two copies straddling a class's last full round and its remainder still split."""
    plan = plan_shards(
        np.zeros(4, int), np.array([9, 8, 7, 7]), 3, 0, groups=np.array([0, 1, 2, 2])
    )
    shard_of = {int(i): s for s, p in enumerate(plan) for i in p}
    assert shard_of[2] != shard_of[3]
    assert sorted(len(p) for p in plan) == [1, 1, 2]


def _class_changes(labels: np.ndarray) -> int:
    return int(np.count_nonzero(labels[1:] != labels[:-1]))


@pytest.mark.parametrize("seed", [0, 1, 2, 12345])
def test_order_inside_a_shard_is_not_grouped_by_class_or_size(seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(4), 2500)  # input sorted by class
    sizes = rng.integers(1000, 100_000, len(labels))
    plan = plan_shards(labels, sizes, 4, seed)
    for part in plan:
        assert len(part) == 2500
        shard_labels = labels[part]
        assert np.bincount(shard_labels).tolist() == [625] * 4
        # A class-grouped shard changes class 3 times; a random order ~1874 times (sd ~22).
        assert _class_changes(shard_labels) > 1700
        # Nor ordered by size (the plan deals largest first): about half the steps go down.
        down = np.mean(np.diff(sizes[part]) < 0)
        assert 0.45 < down < 0.55
        # Not the input order either.
        assert np.mean(np.diff(part) > 0) < 0.55


def test_unlabelled_order_is_shuffled() -> None:
    labels = np.full(1000, -1)
    sizes = np.arange(1000) * 10
    plan = plan_shards(labels, sizes, 2, 0)
    for part in plan:
        assert len(part) == 500
        assert 0.4 < np.mean(np.diff(part) > 0) < 0.6


def test_documented_example() -> None:
    """The module docstring's example: one class of sizes 9..3 over 3 shards."""
    sizes = np.array([9, 8, 7, 6, 5, 4, 3])
    plan = plan_shards(np.zeros(7, dtype=np.int64), sizes, 3, 0)
    # rounds over the shards lightest first: 9 8 7 then 6 5 4 -> 15, 13, 11 bytes;
    # the remainder 3 -> fewest samples (all 2), then fewest bytes -> s2.
    assert [sorted(p.tolist()) for p in plan] == [[0, 3], [1, 4], [2, 5, 6]]
    assert [int(sizes[p].sum()) for p in plan] == [15, 13, 14]


def test_one_shard_holds_everything_and_n_shards_hold_one_each() -> None:
    labels = np.array([0, 1, 1, 2, 2, 2])
    sizes = np.array([5, 4, 3, 2, 1, 0])
    (only,) = plan_shards(labels, sizes, 1, 7)
    assert sorted(only.tolist()) == list(range(6))
    singles = plan_shards(labels, sizes, 6, 7)
    assert sorted(int(p[0]) for p in singles) == list(range(6))
    assert all(len(p) == 1 for p in singles)


def _bytes_ratio(plan: list[np.ndarray], sizes: np.ndarray) -> float:
    totals = [int(sizes[p].sum()) for p in plan]
    return max(totals) / min(totals)


@pytest.mark.parametrize(
    ("num_classes", "skew", "bound"),
    [
        (1, None, 1.002),
        (10, None, 1.002),
        (100, 1.0, 1.002),
        (20, 2.0, 1.002),
        (1000, None, 1.002),
        (1000, 1.0, 1.005),  # Zipf: hundreds of classes with fewer samples than shards
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_byte_balance_20k_images_over_16_shards(
    num_classes: int, skew: float | None, bound: float, seed: int
) -> None:
    """20k samples of 30–100 KiB, balanced or Zipf-skewed classes, 16 shards."""
    rng = np.random.default_rng(seed)
    n = 20_000
    if skew is None:
        labels = rng.integers(0, num_classes, n)
    else:
        shares = 1.0 / np.arange(1, num_classes + 1) ** skew
        labels = rng.choice(num_classes, n, p=shares / shares.sum())
    sizes = rng.integers(30 << 10, (100 << 10) + 1, n)
    plan = plan_shards(labels, sizes, 16, seed)
    assert _bytes_ratio(plan, sizes) <= bound


def test_byte_balance_unlabelled() -> None:
    rng = np.random.default_rng(3)
    sizes = rng.integers(30 << 10, (100 << 10) + 1, 20_000)
    plan = plan_shards(np.full(20_000, -1), sizes, 16, 3)
    assert _bytes_ratio(plan, sizes) <= 1.002


@given(plan_cases())
def test_byte_spread_is_within_one_sample_per_class(case: PlanCase) -> None:
    """max - min shard bytes <= the sum over classes of the class's largest sample."""
    totals = [int(case.sizes[p].sum()) for p in _plan(case)]
    bound = sum(int(case.sizes[case.labels == c].max()) for c in np.unique(case.labels))
    assert max(totals) - min(totals) <= bound


@given(realistic_plan_cases())
def test_byte_balance_realistic_sizes(case: PlanCase) -> None:
    """≥ 500 image-sized samples per shard, ≤ 50 classes of any skew: ratio ≤ 1.01."""
    assert _bytes_ratio(_plan(case), case.sizes) <= 1.01


def test_byte_balance_beats_a_random_split() -> None:
    """The size-aware deal is far better than dealing the same counts at random."""
    rng = np.random.default_rng(11)
    labels = rng.integers(0, 5, 4000)
    sizes = rng.integers(1, 1_000_000, 4000)
    ratio = _bytes_ratio(plan_shards(labels, sizes, 8, 0), sizes)
    random_parts = np.array_split(rng.permutation(4000), 8)
    assert ratio - 1 < (_bytes_ratio(random_parts, sizes) - 1) / 10


@pytest.mark.parametrize(("n", "num_shards"), [(5, 0), (5, -1), (5, 6), (1, 2), (0, 1)])
def test_impossible_shard_counts_raise_plan_error(n: int, num_shards: int) -> None:
    with pytest.raises(PlanError) as info:
        plan_shards(np.zeros(n, dtype=np.int64), np.ones(n, dtype=np.int64), num_shards, 0)
    message = str(info.value)
    assert f"{num_shards} shard(s)" in message
    assert f"{n} sample(s)" in message
