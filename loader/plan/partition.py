"""Partition: cut the epoch order into one contiguous piece per (rank, worker). Pure; no I/O.

Invariants, for every world shape and dataset size:

* every rank gets exactly ``samples_per_rank`` samples, so DDP never waits on
  a rank that ran out of data;
* worker slot ``w`` gets the same count on every rank, so every rank yields
  the same number of batches;
* with a batch size, slot counts are whole batches (batch ``i`` of a rank is
  made by slot ``i % num_workers``), so only the epoch's last batch can be
  partial and the DataLoader's round-robin over workers delivers batches
  ``0, 1, 2, ...`` in order: ``len(loader)`` is exactly what arrives;
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
from loader.plan.order import SampleRange
from loader.plan.world import World

__all__ = [
    "Uneven",
    "batch_slot_counts",
    "batches_per_rank",
    "partition",
    "samples_per_rank",
    "slot_counts",
]


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


def batches_per_rank(per_rank: int, batch_size: int, drop_last: bool) -> int:
    """Batches every rank yields per epoch: the last one partial unless ``drop_last``."""
    return per_rank // batch_size if drop_last else -(-per_rank // batch_size)


def batch_slot_counts(
    per_rank: int, num_workers: int, batch_size: int, drop_last: bool
) -> list[int]:
    """Samples of each worker slot when slot ``w`` makes batches ``w, w + num_workers, ...``.

    Every slot holds whole batches except the one that makes the epoch's last,
    partial batch; with ``drop_last`` that partial batch's samples are left out.
    """
    full, rest = divmod(per_rank, batch_size)
    counts = [batch_size * len(range(w, full, num_workers)) for w in range(num_workers)]
    if rest and not drop_last:
        counts[full % num_workers] += rest
    return counts


def partition(
    order: Sequence[SampleRange],
    total: int,
    world: World,
    uneven: Uneven | str,
    counts: Sequence[int] | None = None,
) -> list[SampleRange]:
    """This (rank, worker)'s ranges, in stream order.

    ``counts`` are the samples of each worker slot (``slot_counts`` or
    ``batch_slot_counts``); by default the rank's share split evenly.
    """
    per_rank = samples_per_rank(total, world.world_size, uneven)
    if counts is None:
        counts = slot_counts(per_rank, world.num_workers)
    if len(counts) != world.num_workers or sum(counts) > per_rank:
        raise WorldMismatchError(f"slot counts {list(counts)} do not fit {world}")
    start = world.rank * per_rank + sum(counts[: world.worker])
    return slice_order(order, total, start, start + counts[world.worker])


def slice_order(
    order: Sequence[SampleRange], total: int, start: int, stop: int
) -> list[SampleRange]:
    """Positions ``[start, stop)`` of the epoch sequence; positions ≥ ``total`` wrap, padded."""
    pieces: list[SampleRange] = []
    if start >= stop:
        return pieces
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
