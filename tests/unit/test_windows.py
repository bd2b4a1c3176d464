"""Window planning: the vectorized ``plan_windows`` cuts exactly where a one-sample-at-a-time
greedy cut does (the definition in its docstring), for any sizes and bounds."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from loader.plan.order import SampleRange
from loader.plan.windows import plan_windows


def _greedy(
    pieces: list[SampleRange], sizes: dict[int, list[int]], max_samples: int, max_bytes: int
) -> list[list[SampleRange]]:
    windows: list[list[SampleRange]] = []
    window: list[SampleRange] = []
    count = nbytes = 0
    for piece in pieces:
        start = piece.start
        for i, size in enumerate(sizes[piece.shard][piece.start : piece.stop]):
            if count and (count >= max_samples or nbytes + size > max_bytes):
                cut = piece.start + i
                if cut > start:
                    window.append(SampleRange(piece.shard, start, cut, piece.padded))
                windows.append(window)
                window, count, nbytes, start = [], 0, 0, cut
            count += 1
            nbytes += size
        if piece.stop > start:
            window.append(SampleRange(piece.shard, start, piece.stop, piece.padded))
    if window:
        windows.append(window)
    return windows


@given(
    shards=st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=30), min_size=1, max_size=5),
    max_samples=st.integers(1, 12),
    max_bytes=st.integers(0, 200),
    data=st.data(),
)
def test_windows_match_the_greedy_definition(
    shards: list[list[int]], max_samples: int, max_bytes: int, data: st.DataObject
) -> None:
    sizes = dict(enumerate(shards))
    pieces = []
    for shard, values in sizes.items():
        a = data.draw(st.integers(0, len(values) - 1))
        b = data.draw(st.integers(a + 1, len(values)))
        pieces.append(SampleRange(shard, a, b, data.draw(st.booleans())))

    def sizes_of(piece: SampleRange) -> np.ndarray:
        return np.array(sizes[piece.shard][piece.start : piece.stop], dtype=np.int64)

    got = list(plan_windows(pieces, sizes_of, max_samples, max_bytes))
    assert got == _greedy(pieces, sizes, max_samples, max_bytes)
    assert sum(len(r) for w in got for r in w) == sum(len(p) for p in pieces)
