"""Windows: a worker's pieces cut into read windows, and the seeded order each is emitted in.

A window is the next run of the worker's samples holding at most
``max_samples`` samples and ``max_bytes`` bytes (at least one sample); its
boundaries come from the index alone. Each window is read, then emitted in a
permutation keyed by (seed, epoch, rank, worker, window number). Because
windows and permutations are pure functions of metadata, resuming after ``k``
samples skips whole windows without reading them and re-reads only the
window it lands in. Memory is one window.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import numpy.typing as npt

from loader.plan.order import SampleRange
from shardprep.format.rng import derive_rng

Sizes = Sequence[int] | npt.NDArray[np.int64]  # bytes per sample of a range

__all__ = ["Sizes", "plan_windows", "window_order"]


def plan_windows(
    pieces: list[SampleRange],
    sizes_of: Callable[[SampleRange], Sizes],
    max_samples: int,
    max_bytes: int,
) -> Iterator[list[SampleRange]]:
    """Group ``pieces`` (in order) into windows; each window is a list of sub-ranges.

    A window closes before the sample that would take it past ``max_samples``
    samples or ``max_bytes`` bytes; it always holds at least one sample.
    """
    window: list[SampleRange] = []
    count = nbytes = 0
    for piece in pieces:
        sizes = np.asarray(sizes_of(piece), dtype=np.int64)
        i = 0
        while i < len(sizes):
            # how many of the next samples still fit: a cumulative sum, cut by both bounds
            room = sizes[i : i + max(0, max_samples - count)]
            fit = int(np.searchsorted(np.cumsum(room), max_bytes - nbytes, side="right"))
            if fit == 0 and count == 0:
                fit = 1  # a sample larger than max_bytes makes a window on its own
            if fit:
                window.append(
                    SampleRange(piece.shard, piece.start + i, piece.start + i + fit, piece.padded)
                )
                count += fit
                nbytes += int(room[:fit].sum())
                i += fit
            if i < len(sizes):  # the window is full
                yield window
                window, count, nbytes = [], 0, 0
    if window:
        yield window


def window_order(
    rng_key: tuple[int, ...], number: int, size: int, shuffle: bool
) -> npt.NDArray[np.int64]:
    """The order window ``number`` (of ``size`` samples) is emitted in; keyed by ``rng_key``.

    ``rng_key`` is (seed, epoch, rank, worker[, pass]); the window is permuted by
    ``derive_rng(seed, "window", epoch, rank, worker[, pass], number)``.
    """
    if not shuffle:
        return np.arange(size, dtype=np.int64)
    return derive_rng(rng_key[0], "window", *rng_key[1:], number).permutation(size)
