"""Mixing arithmetic (loader.mix): source counts, laps, and both batch plans. Pure."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from loader.groups import group_of
from loader.mix import lap_ranges, mixed_batches, per_source_batches, source_counts

counts_st = st.lists(st.integers(0, 300), min_size=1, max_size=4)


@given(counts=counts_st, batch_size=st.integers(1, 40), drop_last=st.booleans(),
       seed=st.integers(0, 5), epoch=st.integers(0, 5))  # fmt: skip
def test_mixed_batches_are_proportional_within_one(
    counts: list[int], batch_size: int, drop_last: bool, seed: int, epoch: int
) -> None:
    plan = mixed_batches(counts, batch_size, drop_last, seed, epoch)
    total = sum(counts)
    full, rest = divmod(total, batch_size)
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
    assert plan == mixed_batches(counts, batch_size, drop_last, seed, epoch)


@given(counts=counts_st, batch_size=st.integers(1, 40), drop_last=st.booleans(),
       seed=st.integers(0, 5))  # fmt: skip
def test_per_source_batches_come_from_one_source_in_proportion(
    counts: list[int], batch_size: int, drop_last: bool, seed: int
) -> None:
    plan = per_source_batches(counts, batch_size, drop_last, seed, 0)
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


@given(size=st.integers(1, 60), count=st.integers(0, 200), epoch=st.integers(0, 6))
def test_laps_give_each_epoch_its_count_without_replacement_where_possible(
    size: int, count: int, epoch: int
) -> None:
    ranges = lap_ranges(size, count, epoch)
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


def test_source_counts_and_groups() -> None:
    assert source_counts(6000, [0.2, 0.3, 0.5], 3) == [400, 600, 1000]
    assert source_counts(10, [1, 1, 1], 2) == [2, 1, 1]  # apportion 4, 3, 3; // 2
    assert group_of(3, [[0, 1], [2, 3]]) == (1, 1, 2)
