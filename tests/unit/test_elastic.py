"""Elastic resume, pure layer: a pass interrupted at W x K, resumed at W' x K', covers the epoch once.

Every (W, K) -> (W', K') pair over W, W' in {1, 2, 3, 4} and K, K' in {0, 1, 3}
(``num_workers=0`` is one slot, the main process). The simulation streams each
slot window by window in the seeded window order, as ``loader.read.samples`` does,
and makes rank batches round-robin over slots, as the DataLoader does.
"""

from __future__ import annotations

from collections import Counter
from itertools import product

from hypothesis import given, settings
from hypothesis import strategies as st

from loader.plan.elastic import Pass, batches_consumed, pass_rest, pass_share, window_key
from loader.plan.order import SampleRange, epoch_order
from loader.plan.partition import batch_slot_counts, slice_order
from loader.plan.windows import plan_windows, window_order

WORLDS = (1, 2, 3, 4)
WORKERS = (0, 1, 3)
Sample = tuple[int, int, bool]  # shard, sample, padded


class _Setup:
    def __init__(self, shard_sizes: list[int], batch_size: int, drop_last: bool, uneven: str,
                 window: int, seed: int) -> None:  # fmt: skip
        self.shard_sizes, self.batch_size, self.drop_last = shard_sizes, batch_size, drop_last
        self.uneven, self.window, self.seed = uneven, window, seed

    def sizes_of(self, piece: SampleRange) -> list[int]:
        """A made-up byte size per sample, so that byte bounds cut windows too."""
        return [1 + (piece.shard * 31 + i) % 5 for i in range(piece.start, piece.stop)]

    def counts(self, size: int, world: Pass) -> tuple[int, list[int]]:
        per_rank = pass_share(size, world.world_size, self.uneven)
        slots = max(1, world.num_workers)
        return per_rank, batch_slot_counts(per_rank, slots, self.batch_size, self.drop_last)

    def run(
        self, sequence: list[SampleRange], world: Pass, number: int, epoch: int
    ) -> tuple[list[list[list[Sample]]], set[tuple[int, int]]]:
        """Every rank's batches in this pass; and the real samples of ``sequence`` no slot got."""
        size = sum(len(r) for r in sequence)
        per_rank, counts = self.counts(size, world)
        slots = len(counts)
        ranks, assigned = [], set()
        for rank in range(world.world_size):
            start = rank * per_rank
            streams = []
            for worker, count in enumerate(counts):
                pieces = slice_order(sequence, size, start, start + count)
                start += count
                key = window_key(self.seed, epoch, rank, worker, number)
                stream: list[Sample] = []
                for k, win in enumerate(plan_windows(pieces, self.sizes_of, self.window, 12)):
                    flat = [(p.shard, i, p.padded) for p in win for i in range(p.start, p.stop)]
                    stream += [flat[j] for j in window_order(key, k, len(flat), True)]
                assigned |= {(s, i) for s, i, padded in stream if not padded}
                streams.append(stream)
            batches = []
            for i in range(sum(-(-c // self.batch_size) for c in counts)):
                j = (i // slots) * self.batch_size
                batches.append(streams[i % slots][j : j + self.batch_size])
            ranks.append(batches)
        real = {(r.shard, i) for r in sequence for i in range(r.start, r.stop)}
        return ranks, real - assigned

    def rest(self, sequence: list[SampleRange], world: Pass, number: int, epoch: int) -> list[SampleRange]:  # fmt: skip
        per_rank, counts = self.counts(sum(len(r) for r in sequence), world)
        consumed = batches_consumed(counts, self.batch_size, len(counts), world.batches)
        return pass_rest(
            sequence,
            per_rank,
            counts,
            [consumed] * world.world_size,
            self.sizes_of,
            shuffle=True,
            key=lambda rank, worker: window_key(self.seed, epoch, rank, worker, number),
            max_samples=self.window,
            max_bytes=12,
        )


@settings(max_examples=20)  # each example checks all 144 world pairs
@given(
    shard_sizes=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    batch_size=st.integers(1, 9),
    drop_last=st.booleans(),
    uneven=st.sampled_from(["drop", "pad"]),
    window=st.integers(1, 7),
    seed=st.integers(0, 3),
    where=st.floats(0, 1),
    third=st.booleans(),
)
def test_every_world_pair_covers_the_epoch_exactly_once(
    shard_sizes: list[int],
    batch_size: int,
    drop_last: bool,
    uneven: str,
    window: int,
    seed: int,
    where: float,
    third: bool,
) -> None:
    setup = _Setup(shard_sizes, batch_size, drop_last, uneven, window, seed)
    epoch = 5
    order = epoch_order(shard_sizes, seed, epoch, True, 3)
    total = sum(shard_sizes)
    everything = {(s, i) for s, n in enumerate(shard_sizes) for i in range(n)}
    for (w0, k0), (w1, k1) in product(product(WORLDS, WORKERS), repeat=2):
        if uneven == "drop" and total < w0:
            continue  # the first pass refuses this world (samples_per_rank)
        first = setup.run(order, Pass(w0, max(1, k0), 0), 0, epoch)
        length = len(first[0][0])
        assert {len(batches) for batches in first[0]} == {length}
        stop = int(where * length)  # batches every rank consumed before the interruption
        seen = [s for batches in first[0] for b in batches[:stop] for s in b]
        rest = setup.rest(order, Pass(w0, max(1, k0), stop), 0, epoch)
        left_out = set(first[1])
        passes = [(rest, Pass(w1, max(1, k1), 0), 1)]
        if third:  # interrupted again half way, resumed at the first world
            second = setup.run(rest, passes[0][1], 1, epoch)
            half = len(second[0][0]) // 2
            seen += [s for batches in second[0] for b in batches[:half] for s in b]
            left_out |= second[1]
            done = Pass(w1, max(1, k1), half)
            passes = [(setup.rest(rest, done, 1, epoch), Pass(w0, max(1, k0), 0), 2)]
        for sequence, world, number in passes:
            ranks, never = setup.run(sequence, world, number, epoch)
            assert len({len(batches) for batches in ranks}) == 1, "unequal steps per rank"
            size = sum(len(r) for r in sequence)
            per_rank = pass_share(size, world.world_size, uneven)
            assert [sum(map(len, b)) for b in ranks] == [
                sum(setup.counts(size, world)[1])
            ] * world.world_size
            assert per_rank * world.world_size >= size - (world.world_size - 1)
            seen += [s for batches in ranks for b in batches for s in b]
            left_out |= never
        real = Counter((s, i) for s, i, padded in seen if not padded)
        assert not real or max(real.values()) == 1, "a sample was streamed twice in the epoch"
        assert not (set(real) & left_out)
        assert set(real) | left_out == everything, "a sample was lost"
        # The remainder rule: what is left out is only a pass's remainder, never more.
        slack = (w0 + w1 + (w0 if third else 0)) * (1 + (batch_size if drop_last else 0))
        assert len(left_out) <= slack


def test_the_rest_after_nothing_is_the_first_pass_in_slot_order() -> None:
    """With nothing consumed, the rest is every real sample the pass assigned, by rank and slot."""
    setup = _Setup([10, 7], 3, False, "drop", 4, 1)
    order = epoch_order([10, 7], 1, 0, True, 3)
    rest = setup.rest(order, Pass(2, 2, 0), 0, 0)
    assert sum(len(r) for r in rest) == 16  # 17 // 2 * 2
    per_rank, counts = setup.counts(17, Pass(2, 2, 0))
    flat = [(p.shard, i) for p in slice_order(order, 17, 0, 16) for i in range(p.start, p.stop)]
    assert [(r.shard, i) for r in rest for i in range(r.start, r.stop)] == flat


def test_pass_share_of_a_small_rest() -> None:
    assert pass_share(2, 3, "drop") == 0
    assert pass_share(2, 3, "pad") == 1
    assert pass_share(0, 4, "pad") == 0
    assert batches_consumed([9, 6, 6], 3, 3, 5) == [6, 6, 3]
    assert batches_consumed([9, 6, 4], 3, 3, 9) == [9, 6, 4]
