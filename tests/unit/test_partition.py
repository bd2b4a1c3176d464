"""Partition invariants, exhaustively over a grid of shard counts × world sizes × workers."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loader.errors import WorldMismatchError
from loader.plan.order import SampleRange, epoch_order
from loader.plan.partition import (
    Uneven,
    batch_slot_counts,
    batches_per_rank,
    partition,
    samples_per_rank,
    slot_counts,
)
from loader.plan.world import World


def _expand(pieces: list[SampleRange]) -> list[tuple[int, int, bool]]:
    return [(p.shard, i, p.padded) for p in pieces for i in range(p.start, p.stop)]


def _batches(count: int, batch_size: int) -> int:
    return -(-count // batch_size)


def check_world(
    sizes: list[int], world_size: int, loader_workers: int, uneven: str, seed: int = 0
) -> None:
    """All pieces of one world shape: equal per rank, equal per slot, disjoint, covering."""
    total = sum(sizes)
    num_workers = max(1, loader_workers)
    order = epoch_order(sizes, seed, 3, True, block_size=4)
    per_rank = samples_per_rank(total, world_size, uneven)
    seen: Counter[tuple[int, int]] = Counter()
    padded = 0
    slot_sizes = None
    for rank in range(world_size):
        slots = []
        for worker in range(num_workers):
            samples = _expand(
                partition(order, total, World(rank, world_size, worker, num_workers), uneven)
            )
            slots.append(len(samples))
            for shard, index, is_pad in samples:
                assert 0 <= index < sizes[shard]
                if is_pad:
                    padded += 1
                else:
                    seen[(shard, index)] += 1
        assert sum(slots) == per_rank
        assert max(slots) - min(slots) <= 1
        if slot_sizes is None:
            slot_sizes = slots
        assert slots == slot_sizes, "worker slot w must hold the same count on every rank"
        for batch_size in (1, 3, 16):
            assert sum(_batches(c, batch_size) for c in slots) == sum(
                _batches(c, batch_size) for c in slot_sizes
            )
    assert all(v == 1 for v in seen.values()), "a sample appeared twice in one epoch"
    if uneven == "drop":
        assert padded == 0
        assert total - len(seen) == total % world_size
    else:
        assert len(seen) == total
        assert padded == world_size * per_rank - total


@pytest.mark.parametrize("uneven", ["drop", "pad"])
@pytest.mark.parametrize(
    "sizes",
    [
        [1],
        [7],
        [100] * 10,
        [101, 100, 100, 100, 100, 100, 100, 100, 100, 100],
        [3, 0, 5, 9, 1, 2, 8],
        [13] * 7,
        [2, 1],
    ],
)
def test_grid(sizes: list[int], uneven: str) -> None:
    for world_size, workers in itertools.product([1, 2, 3, 4], [0, 1, 2, 3]):
        if uneven == "drop" and sum(sizes) < world_size:
            with pytest.raises(WorldMismatchError):
                samples_per_rank(sum(sizes), world_size, uneven)
            continue
        check_world(sizes, world_size, workers, uneven)


@given(
    sizes=st.lists(st.integers(0, 60), min_size=1, max_size=12).filter(lambda s: sum(s) >= 8),
    world_size=st.integers(1, 8),
    workers=st.integers(0, 5),
    uneven=st.sampled_from(["drop", "pad"]),
    seed=st.integers(0, 2**32),
)
def test_random_worlds(
    sizes: list[int], world_size: int, workers: int, uneven: str, seed: int
) -> None:
    check_world(sizes, world_size, workers, uneven, seed)


def test_examples_from_the_issue() -> None:
    # 10 shards on 3 ranks × 2 workers; 1 shard on 4 ranks; 7 shards on 4 ranks × 3 workers.
    check_world([100] * 9 + [101], 3, 2, "drop")
    check_world([1001], 4, 0, "drop")
    check_world([143] * 7, 4, 3, "pad")
    assert samples_per_rank(1001, 3, Uneven.DROP) == 333
    assert samples_per_rank(1001, 3, Uneven.PAD) == 334
    assert slot_counts(333, 2) == [167, 166]


def test_pad_wraps_more_than_once() -> None:
    # 3 samples, 8 ranks: every rank gets one, five of them repeats.
    check_world([3], 8, 0, "pad")


def test_epoch_order_is_a_permutation_of_blocks_and_changes_with_epoch() -> None:
    sizes = [10, 3, 25]
    first = epoch_order(sizes, 0, 0, True, block_size=4)
    second = epoch_order(sizes, 0, 1, True, block_size=4)
    again = epoch_order(sizes, 0, 0, True, block_size=4)
    assert first == again
    assert first != second
    assert sorted((p.shard, p.start, p.stop) for p in first) == sorted(
        (p.shard, p.start, p.stop) for p in epoch_order(sizes, 0, 0, False, block_size=4)
    )
    assert sum(len(p) for p in first) == 38
    assert epoch_order(sizes, 0, 0, False, block_size=4)[0] == SampleRange(0, 0, 4)


@given(
    sizes=st.lists(st.integers(0, 60), min_size=1, max_size=10).filter(lambda s: sum(s) >= 8),
    world_size=st.integers(1, 5),
    workers=st.integers(1, 4),
    batch_size=st.integers(1, 20),
    drop_last=st.booleans(),
    uneven=st.sampled_from(["drop", "pad"]),
)
def test_batch_aligned_slots_cover_each_rank_once(
    sizes: list[int], world_size: int, workers: int, batch_size: int, drop_last: bool, uneven: str
) -> None:
    """Whole-batch slots: equal batches per rank, no sample twice, only drop_last tails missing."""
    total = sum(sizes)
    order = epoch_order(sizes, 7, 1, True, block_size=4)
    per_rank = samples_per_rank(total, world_size, uneven)
    counts = batch_slot_counts(per_rank, workers, batch_size, drop_last)
    seen: Counter[tuple[int, int]] = Counter()
    for rank in range(world_size):
        got = 0
        for worker in range(workers):
            world = World(rank, world_size, worker, workers)
            samples = _expand(partition(order, total, world, uneven, counts))
            assert len(samples) == counts[worker]
            got += len(samples)
            seen.update((shard, index) for shard, index, pad in samples if not pad)
        batches = batches_per_rank(per_rank, batch_size, drop_last)
        assert got == (batches * batch_size if drop_last else per_rank)
    assert max(seen.values(), default=1) == 1
    missing = total - len(seen)
    tails = world_size * (per_rank % batch_size) if drop_last else 0
    if uneven == "drop":
        assert missing == total % world_size + tails
    else:
        assert missing <= tails


def test_partition_refuses_counts_of_another_world() -> None:
    order = epoch_order([10], 0, 0, False, block_size=4)
    with pytest.raises(WorldMismatchError, match="slot counts"):
        partition(order, 10, World(0, 1, 0, 2), "drop", [5, 5, 0])
