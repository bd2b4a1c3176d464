"""Read-ahead planning: the plan is exactly the reads the reader makes, and groups cover it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from loader.io.source import Source
from loader.plan.order import epoch_order
from loader.plan.partition import partition, slot_counts
from loader.plan.reads import Read, plan_groups, planned_reads
from loader.plan.world import World
from loader.read.reader import ShardReader
from loader.read.samples import ErrorPolicy, sample_stream, shuffled_windows

reads_strategy = st.lists(
    st.builds(
        Read,
        shard=st.integers(0, 2),
        offset=st.integers(0, 5000),
        size=st.integers(0, 3000),
    ),
    max_size=40,
)


@given(reads=reads_strategy, request_bytes=st.integers(1, 8000))
def test_groups_cover_every_read_in_order(reads: list[Read], request_bytes: int) -> None:
    groups = list(plan_groups(iter(reads), request_bytes))
    assert [r for g in groups for r in g.reads] == reads
    for g in groups:
        assert all(r.shard == g.shard and g.start <= r.offset and r.stop <= g.stop for r in g.reads)
        assert g.start == g.reads[0].offset
        assert g.stop == max(r.stop for r in g.reads)
        assert len(g.reads) == 1 or g.stop - g.start <= request_bytes
    for a, b in zip(groups, groups[1:], strict=False):  # a group ends only when it must
        first = b.reads[0]
        joins = first.shard == a.shard and a.start <= first.offset <= a.stop
        assert not joins or max(a.stop, first.stop) - a.start > request_bytes


class RecordingReader(ShardReader):
    """A ShardReader on local files that records the reads it makes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.made: list[Read] = []

    def _pread_into(self, piece: Any, offset: int, size: int, pool: Any) -> Any:
        self.made.append(Read(piece.shard, offset, size))
        return super()._pread_into(piece, offset, size, pool)


@settings(max_examples=15)
@given(
    compressed=st.booleans(),
    seed=st.integers(0, 3),
    workers=st.integers(1, 3),
    window=st.integers(1, 200),
    window_bytes=st.integers(1 << 10, 1 << 17),
    skip=st.integers(0, 400),
)
def test_the_plan_is_the_reads_the_stream_makes(
    built: Path,
    built_zstd: Path,
    compressed: bool,
    seed: int,
    workers: int,
    window: int,
    window_bytes: int,
    skip: int,
) -> None:
    out = built_zstd if compressed else built
    source = Source(str(out))
    manifest = source.manifest()
    sizes = [s.num_samples for s in manifest.shards]
    order = epoch_order(sizes, seed, 1, True, 32)
    for worker in range(workers):
        world = World(0, 1, worker, workers)
        pieces = partition(order, sum(sizes), world, "drop", slot_counts(sum(sizes), workers))
        reader = RecordingReader(source, manifest)
        planner = ShardReader(source, manifest)
        plan = list(planned_reads(pieces, planner, skip, window, window_bytes))
        policy = ErrorPolicy("raise", 1)
        windows = shuffled_windows(
            pieces,
            reader,
            shuffle=True,
            rng_key=(seed, 1, 0, worker),
            skip=skip,
            max_samples=window,
            max_bytes=window_bytes,
            policy=policy,
        )
        stream = sample_stream(windows, policy)
        try:
            for _ in stream:
                pass
        finally:
            reader.close()
            planner.close()
        assert reader.made == plan
