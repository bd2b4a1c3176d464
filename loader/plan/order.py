"""Epoch order: the sequence of sample ranges every rank agrees on for one epoch. Pure; no I/O.

Each shard is cut into blocks of ``block_size`` consecutive samples; with
shuffling the blocks are permuted by a generator keyed on (seed, epoch). The
result is O(samples / block_size) small records, never a per-sample array.
Samples inside a shard were already shuffled at build time, so a block is a
random draw of the dataset's class mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardprep.format.rng import derive_rng

__all__ = ["SampleRange", "epoch_order"]


@dataclass(frozen=True, slots=True)
class SampleRange:
    """Samples ``start`` to ``stop - 1`` of shard ``shard``; ``padded`` marks repeats."""

    shard: int
    start: int
    stop: int
    padded: bool = False

    def __len__(self) -> int:
        return self.stop - self.start


def epoch_order(
    shard_sizes: Sequence[int], seed: int, epoch: int, shuffle: bool, block_size: int
) -> list[SampleRange]:
    """All samples of the dataset as blocks, in this epoch's order."""
    blocks = [
        SampleRange(shard, start, min(start + block_size, size))
        for shard, size in enumerate(shard_sizes)
        for start in range(0, size, block_size)
    ]
    if not shuffle:
        return blocks
    permutation = derive_rng(seed, "order", epoch).permutation(len(blocks))
    return [blocks[i] for i in permutation]
