"""Partition: cut the epoch order into one contiguous piece per (rank, worker). Pure; no I/O.

Invariants, for every world shape and dataset size:

* every rank gets exactly ``samples_per_rank`` samples, so DDP never waits on
  a rank that ran out of data;
* worker slot ``w`` gets the same count on every rank (counts of slots differ
  by at most one), so a DataLoader with any ``batch_size`` yields the same
  number of batches on every rank;
* pieces are disjoint and, apart from padding or the dropped tail, cover the
  epoch exactly once.

With ``uneven="drop"`` the last ``total % world_size`` samples of the epoch
order are left out (a different set each epoch when shuffling). With
``uneven="pad"`` the sequence wraps around to its start and repeats are
flagged ``padded``.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

from loader.errors import WorldMismatchError
from loader.order import SampleRange
from loader.world import World

__all__ = ["Uneven", "partition", "samples_per_rank", "slot_counts"]


class Uneven(str, Enum):
    """What to do with the ``total % world_size`` samples that do not divide evenly."""

    DROP = "drop"
    PAD = "pad"


def samples_per_rank(total: int, world_size: int, uneven: Uneven | str) -> int:
    """Samples every rank yields per epoch.

    Raises:
        WorldMismatchError: ``drop`` with fewer samples than ranks (every rank would get 0).
    """
    if Uneven(uneven) is Uneven.PAD:
        return -(-total // world_size)
    if total < world_size:
        raise WorldMismatchError(
            f"{total} samples cannot give each of {world_size} ranks one sample with "
            "uneven='drop'; use uneven='pad' or more data"
        )
    return total // world_size


def slot_counts(per_rank: int, num_workers: int) -> list[int]:
    """Samples of each worker slot on a rank: as equal as possible, larger slots first."""
    base, extra = divmod(per_rank, num_workers)
    return [base + (1 if w < extra else 0) for w in range(num_workers)]


def partition(
    order: Sequence[SampleRange], total: int, world: World, uneven: Uneven | str
) -> list[SampleRange]:
    """This (rank, worker)'s ranges, in stream order."""
    per_rank = samples_per_rank(total, world.world_size, uneven)
    counts = slot_counts(per_rank, world.num_workers)
    start = world.rank * per_rank + sum(counts[: world.worker])
    return slice_order(order, total, start, start + counts[world.worker])


def slice_order(
    order: Sequence[SampleRange], total: int, start: int, stop: int
) -> list[SampleRange]:
    """Positions ``[start, stop)`` of the epoch sequence; positions ≥ ``total`` wrap, padded."""
    pieces: list[SampleRange] = []
    position = 0  # sequence position of the current block's first sample
    lap = start // total
    while start < stop:
        local = start - lap * total  # position within this lap of the order
        position = 0
        for block in order:
            if position + len(block) > local and start < stop:
                first = block.start + max(0, local - position)
                take = min(block.stop - first, stop - start)
                pieces.append(SampleRange(block.shard, first, first + take, padded=lap > 0))
                start += take
                local += take
            position += len(block)
            if start >= stop:
                break
        lap += 1
    return pieces
