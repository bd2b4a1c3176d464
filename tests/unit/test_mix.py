"""Mixing arithmetic (loader.compose.mix): source counts, laps, and both batch plans. Pure.

The plans are computed batch by batch; the eager list-building versions they
replaced are kept below as references (``_reference_*``) for small sizes.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loader.compose.groups import group_of
from loader.compose.mix import (
    MixedStream,
    floor_sum,
    lap_ranges,
    mixed_batches,
    per_source_batches,
    source_counts,
)
from shardprep.format.classweights import apportion
from shardprep.format.rng import derive_rng

counts_st = st.lists(st.integers(0, 300), min_size=1, max_size=4)


# --- the eager references (the implementation before the plans were lazy) --------------


def _reference_mixed_rows(counts: list[int], batch_size: int, drop_last: bool) -> list[list[int]]:
    """The mixed plan's rows in the cyclic layout, before any permutation."""
    import numpy as np

    total = sum(counts)
    full, rest = divmod(total, batch_size)
    shares = np.asarray(counts, dtype=np.float64) / max(1, total)
    last = [int(v) for v in apportion(rest, shares)] if rest else [0] * len(counts)
    plan: list[list[int]] = []
    if full:
        left = [c - v for c, v in zip(counts, last, strict=True)]
        plan = [[v // full for v in left] for _ in range(full)]
        row = 0
        for i, v in enumerate(left):
            for _ in range(v % full):
                plan[row % full][i] += 1
                row += 1
    if rest and not drop_last:
        plan.append(last)
    return plan


def _reference_per_source(
    counts: list[int], batch_size: int, drop_last: bool, seed: int, epoch: int
) -> list[list[int]]:
    sizes: list[list[int]] = []
    for count in counts:
        full, rest = divmod(count, batch_size)
        sizes.append([batch_size] * full + ([rest] if rest and not drop_last else []))
    made = [len(batches) for batches in sizes]
    total = sum(made)
    priority = derive_rng(seed, "mix-sources", epoch).permutation(len(counts)).tolist()
    seen = [0] * len(counts)
    plan: list[list[int]] = []
    for t in range(1, total + 1):
        i = max(
            (i for i in range(len(counts)) if seen[i] < made[i]),
            key=lambda i: (t * made[i] - seen[i] * total, -priority[i]),
        )
        row = [0] * len(counts)
        row[i] = sizes[i][seen[i]]
        seen[i] += 1
        plan.append(row)
    return plan


def _reference_laps(size: int, count: int, epoch: int) -> list[tuple[int, int, int]]:
    if count == 0:
        return []
    if count <= size:
        per_lap = size // count
        start = (epoch % per_lap) * count
        return [(epoch // per_lap, start, start + count)]
    whole, part = divmod(count, size)
    first = epoch * (whole + 1)
    laps = [(first + k, 0, size) for k in range(whole)]
    return laps + ([(first + whole, 0, part)] if part else [])


def _prefix_sums(rows: list[list[int]], width: int) -> list[list[int]]:
    sums = [[0] * width]
    for row in rows:
        sums.append([a + b for a, b in zip(sums[-1], row, strict=True)])
    return sums


# --- mixed ---------------------------------------------------------------------------


@given(counts=counts_st, batch_size=st.integers(1, 40), drop_last=st.booleans(),
       seed=st.integers(0, 5), epoch=st.integers(0, 5))  # fmt: skip
def test_mixed_batches_are_proportional_within_one(
    counts: list[int], batch_size: int, drop_last: bool, seed: int, epoch: int
) -> None:
    plan = list(mixed_batches(counts, batch_size, drop_last, seed, epoch))
    total = sum(counts)
    full, rest = divmod(total, batch_size)
    assert len(plan) == len(mixed_batches(counts, batch_size, drop_last, seed, epoch))
    assert len(plan) == full + (1 if rest and not drop_last else 0)
    assert all(sum(row) == batch_size for row in plan[:full])
    sums = [sum(row[i] for row in plan) for i in range(len(counts))]
    if drop_last or not rest:
        assert sum(sums) == full * batch_size and all(
            s <= c for s, c in zip(sums, counts, strict=True)
        )
        assert all(c - s <= rest for s, c in zip(sums, counts, strict=True))
    else:
        assert sums == counts
    if full:
        for i in range(len(counts)):
            values = {row[i] for row in plan[:full]}
            assert max(values) - min(values) <= 1, "a source's share varies by more than 1"
            share = batch_size * counts[i] / total
            assert all(abs(v - share) < 1 + 1 / full + 1e-9 for v in values)
    assert plan == list(mixed_batches(counts, batch_size, drop_last, seed, epoch))


@given(counts=st.lists(st.integers(0, 2000), min_size=1, max_size=4),
       batch_size=st.integers(1, 40), drop_last=st.booleans(), seed=st.integers(0, 5),
       epoch=st.integers(0, 5))  # fmt: skip
def test_mixed_plan_permutes_the_reference_rows_with_exact_starts(
    counts: list[int], batch_size: int, drop_last: bool, seed: int, epoch: int
) -> None:
    """The same rows as the eager cyclic layout, in another order; starts(j) = rows before j."""
    plan = mixed_batches(counts, batch_size, drop_last, seed, epoch)
    rows = list(plan)
    reference = _reference_mixed_rows(counts, batch_size, drop_last)
    full = sum(counts) // batch_size
    assert sorted(rows[:full]) == sorted(reference[:full]) and rows[full:] == reference[full:]
    sums = _prefix_sums(rows, len(counts))
    assert [plan.starts(j) for j in range(len(rows) + 1)] == sums
    for first, step in ((0, 1), (1, 3), (len(rows) // 2, 2)):
        got = list(plan.batches(first, step))
        expected = list(range(first, len(rows), step))
        assert [(j, r, s) for j, r, s in got] == [(j, rows[j], sums[j]) for j in expected]
    if full:  # the extras spread evenly: each source's running count near its exact share
        left = sums[full]
        for j in range(full + 1):
            for i in range(len(counts)):
                assert abs(sums[j][i] - j * left[i] / full) < 5


def test_mixed_plan_is_identical_where_no_batch_carries_an_extra() -> None:
    """200/300/500 by 30: 33 batches of 6/9/15 and 2/3/5 last, as before (the DDP test's plan)."""
    plan = mixed_batches([200, 300, 500], 30, False, 0, 0)
    assert list(plan) == [[6, 9, 15]] * 33 + [[2, 3, 5]]
    # a plan of 10**15 samples: batch j from O(sources) numbers, starts in O(log J)
    huge = mixed_batches([3 * 10**14, 3 * 10**14 + 7, 4 * 10**14 - 3], 64, False, 1, 2)
    j = len(huge) // 3
    assert len(huge) == 10**15 // 64 + 1 and sum(huge.row(j)) == 64
    assert [a + b for a, b in zip(huge.starts(j), huge.row(j), strict=True)] == huge.starts(j + 1)


@given(n=st.integers(0, 60), m=st.integers(1, 50), a=st.integers(-100, 100),
       b=st.integers(-100, 100))  # fmt: skip
def test_floor_sum_is_the_sum(n: int, m: int, a: int, b: int) -> None:
    assert floor_sum(n, m, a, b) == sum((a * i + b) // m for i in range(n))


# --- per source ----------------------------------------------------------------------


@given(counts=counts_st, batch_size=st.integers(1, 40), drop_last=st.booleans(),
       seed=st.integers(0, 5), epoch=st.integers(0, 3))  # fmt: skip
def test_per_source_plan_is_the_reference_exactly(
    counts: list[int], batch_size: int, drop_last: bool, seed: int, epoch: int
) -> None:
    plan = per_source_batches(counts, batch_size, drop_last, seed, epoch)
    reference = _reference_per_source(counts, batch_size, drop_last, seed, epoch)
    assert list(plan) == reference and len(plan) == len(reference)
    sums = _prefix_sums(reference, len(counts))
    for first, step in ((0, 1), (2, 3), (len(reference) - 1, 2)):
        got = [(j, r, [s[i] for i in range(len(r)) if r[i]]) for j, r, s in
               plan.batches(first, step)]  # fmt: skip
        assert got == [
            (j, reference[j], [sums[j][i] for i, v in enumerate(reference[j]) if v])
            for j in range(max(0, first), len(reference), step)
        ]


@given(counts=counts_st, batch_size=st.integers(1, 40), drop_last=st.booleans(),
       seed=st.integers(0, 5))  # fmt: skip
def test_per_source_batches_come_from_one_source_in_proportion(
    counts: list[int], batch_size: int, drop_last: bool, seed: int
) -> None:
    plan = list(per_source_batches(counts, batch_size, drop_last, seed, 0))
    assert all(sum(1 for v in row if v) == 1 for row in plan)
    made = [(c // batch_size) + (1 if c % batch_size and not drop_last else 0) for c in counts]
    assert Counter(next(i for i, v in enumerate(row) if v) for row in plan) == Counter(
        {i: m for i, m in enumerate(made) if m}
    )
    total = len(plan)
    seen = [0] * len(counts)
    for t, row in enumerate(plan, 1):
        seen[next(i for i, v in enumerate(row) if v)] += 1
        for i, m in enumerate(made):
            assert abs(seen[i] - t * m / total) < 1 + 1e-9


# --- laps ----------------------------------------------------------------------------


@given(size=st.integers(1, 60), count=st.integers(0, 200), epoch=st.integers(0, 6))
def test_laps_give_each_epoch_its_count_without_replacement_where_possible(
    size: int, count: int, epoch: int
) -> None:
    ranges = lap_ranges(size, count, epoch)
    assert ranges == _reference_laps(size, count, epoch)
    assert sum(b - a for _, a, b in ranges) == count
    assert all(0 <= a <= b <= size for _, a, b in ranges)
    uses = Counter((lap, i) for lap, a, b in ranges for i in range(a, b))
    assert not uses or max(uses.values()) == 1  # a (lap, position) is used once in an epoch
    laps = [lap for lap, _, _ in ranges]
    assert laps == sorted(set(laps))
    if count and count <= size:
        assert len(ranges) == 1  # one lap: no sample twice in the epoch
        following = lap_ranges(size, count, epoch + 1)[0]
        if following[0] == ranges[0][0]:
            assert following[1] >= ranges[0][2]  # epochs sharing a lap take disjoint parts
    if count > size:  # each sample q or q + 1 times
        per_sample = Counter(i for _, a, b in ranges for i in range(a, b))
        assert set(per_sample.values()) <= {count // size, count // size + 1}
        later = lap_ranges(size, count, epoch + 1)
        assert min(lap for lap, _, _ in later) > max(laps)


@given(size=st.integers(1, 60), count=st.integers(1, 300), epoch=st.integers(0, 6),
       data=st.data())  # fmt: skip
def test_a_window_of_the_laps_is_that_part_of_the_whole(
    size: int, count: int, epoch: int, data: st.DataObject
) -> None:
    begin = data.draw(st.integers(0, count))
    stop = data.draw(st.integers(begin, count))
    flat = [(lap, i) for lap, a, b in _reference_laps(size, count, epoch) for i in range(a, b)]
    window = lap_ranges(size, count, epoch, begin, stop)
    assert [(lap, i) for lap, a, b in window for i in range(a, b)] == flat[begin:stop]
    assert all(a < b for _, a, b in window)  # only the laps the window touches


def test_laps_of_a_huge_up_sampled_epoch_are_not_listed() -> None:
    """10**15 positions of a 103-sample source: a window names only its own laps."""
    window = lap_ranges(103, 10**15, 2, 10**14, 10**14 + 250)
    per_epoch = 10**15 // 103 + 1
    first = 2 * per_epoch + 10**14 // 103
    assert 10**14 % 103 == 79  # 24 positions of the first lap, two whole ones, 20 of the next
    assert window == [
        (first, 79, 103),
        (first + 1, 0, 103),
        (first + 2, 0, 103),
        (first + 3, 0, 20),
    ]


# --- counts --------------------------------------------------------------------------


def test_source_counts_and_groups() -> None:
    assert source_counts(6000, [0.2, 0.3, 0.5], 3) == [400, 600, 1000]
    assert source_counts(10, [1, 1, 1], 2) == [2, 1, 1]  # apportion 4, 3, 3; // 2
    assert source_counts(10**15, [1, 3], 1) == [25 * 10**13, 75 * 10**13]
    assert group_of(3, [[0, 1], [2, 3]]) == (1, 1, 2)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([float("inf"), 1], r"weight 0 of the mixture is inf: every weight must be a finite"),
        ([1, float("nan")], r"weight 1 of the mixture is nan"),
        ([1, -0.5], r"weight 1 of the mixture is -0.5"),
        ([1, "x"], r"weight 1 of the mixture is 'x'"),
        ([0, 0.0], r"the weights \[0, 0.0\] are all zero"),
        ([1e308, 1e308], r"add up past float64"),
    ],
)
def test_bad_weights_are_refused_by_name(weights: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MixedStream(["unused/", "unused/"], weights, batch_size=4)


@pytest.mark.parametrize(
    ("samples", "message"),
    [(2**53 + 1, "between 0 and 2\\*\\*53"), (-1, "between 0"), (1.5, "whole number")],
)
def test_bad_samples_per_epoch_are_refused(samples: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MixedStream(["unused/"], [1], batch_size=4, samples_per_epoch=samples)  # type: ignore[arg-type]
