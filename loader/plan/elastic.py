"""Elastic resume: what an interrupted part of an epoch left, re-split over a new world. Pure; no I/O.

An epoch may be streamed in several **passes**: the run that started it, at
``W`` ranks × ``K`` worker slots, then (after an interruption) a run at
``W'`` × ``K'``, and so on. A pass is described by ``Pass(world_size,
num_workers, batches)``: its world and the batches every rank had consumed
when it stopped (ranks of a DDP job move in lockstep, so one number holds for
all of them; it is what ``ShardDataset.state_after`` saves).

The **sequence** of a pass is a list of sample ranges. The first pass's is
the epoch order (``loader.plan.order.epoch_order``), partitioned as usual
(``loader.plan.partition``). Rank ``r``'s slot ``w`` streams its ranges window by
window, each window in a seeded order (``loader.read.samples``), so the samples it
has handed out after ``c`` of them are the first ``c`` of that stream: whole
windows, plus a seeded subset of the window it was in.

The **rest** of a pass (``pass_rest``) is every real sample its slots had not
yet handed out, in a fixed order: by old rank, then old slot, then position in
the slot's ranges. Padded repeats (``uneven="pad"``) are not part of it: they
were repeats to begin with. Samples the pass would never have streamed (the
``total % W`` tail under ``uneven="drop"``, a ``drop_last`` batch) are not
part of it either. The next pass takes the rest as its sequence and splits it
with its own world's rule (``pass_share``): ``drop`` gives each rank
``len(rest) // W'`` and leaves out the last ``len(rest) % W'`` samples;
``pad`` gives ``ceil(len(rest) / W')`` and fills with flagged repeats. So
across the passes of an epoch every real sample is streamed exactly once,
except those left out by a remainder rule, and the epochs after it are the
normal epochs of the new world.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import NamedTuple

from loader.plan.order import SampleRange
from loader.plan.partition import Uneven, slice_order
from loader.plan.windows import Sizes, plan_windows, window_order

__all__ = [
    "Pass",
    "batches_consumed",
    "epoch_batches",
    "merge_ranges",
    "pass_rest",
    "pass_share",
    "slot_rest",
    "window_key",
]


class Pass(NamedTuple):
    """One interrupted pass over an epoch: its world, and the batches each rank had consumed."""

    world_size: int
    num_workers: int
    batches: int


def pass_share(size: int, world_size: int, uneven: Uneven | str) -> int:
    """Samples every rank streams in a pass over a sequence of ``size`` samples.

    As ``loader.plan.partition.samples_per_rank``, except that a rest smaller than
    the world gives every rank 0 samples under ``drop`` (the epoch is over).
    """
    if Uneven(uneven) is Uneven.PAD:
        return -(-size // world_size)
    return size // world_size


def epoch_batches(history: Sequence[Pass], pass_batches: int) -> int:
    """Batches a rank takes in an epoch: its earlier passes' (``history``), then ``pass_batches``.

    What a trainer that counts an epoch's batches across restarts (Lightning's
    progress, restored from its checkpoint) has reached when the epoch ends.
    """
    return sum(p.batches for p in history) + pass_batches


def batches_consumed(
    counts: Sequence[int], batch_size: int, num_workers: int, batches: int
) -> list[int]:
    """Samples each slot had handed out once its rank consumed ``batches`` batches.

    Slot ``w`` makes the rank's batches ``w, w + K, ...``, each full but for
    the epoch's last one.
    """
    return [
        min(count, len(range(w, batches, num_workers)) * batch_size)
        for w, count in enumerate(counts)
    ]


def window_key(seed: int, epoch: int, rank: int, worker: int, number: int) -> tuple[int, ...]:
    """The shuffle key of (rank, worker) in pass ``number`` of an epoch (pass 0 as ever)."""
    return (seed, epoch, rank, worker) + ((number,) if number else ())


def slot_rest(
    pieces: Sequence[SampleRange],
    consumed: int,
    sizes_of: Callable[[SampleRange], Sizes],
    *,
    shuffle: bool,
    key: tuple[int, ...],
    max_samples: int,
    max_bytes: int,
) -> list[SampleRange]:
    """The real samples of a slot's ``pieces`` not among the first ``consumed`` it streamed.

    In the pieces' order; padded repeats are left out.
    """
    rest: list[SampleRange] = []
    for number, window in enumerate(plan_windows(list(pieces), sizes_of, max_samples, max_bytes)):
        size = sum(len(p) for p in window)
        if consumed >= size:
            consumed -= size
            continue
        if not consumed:
            rest.extend(p for p in window if not p.padded)
            continue
        left = sorted(window_order(key, number, size, shuffle)[consumed:].tolist())
        starts = list(accumulate((len(p) for p in window), initial=0))
        for flat in left:
            i = bisect_right(starts, flat) - 1
            piece = window[i]
            if not piece.padded:
                first = piece.start + flat - starts[i]
                rest.append(SampleRange(piece.shard, first, first + 1))
        consumed = 0
    return rest


def pass_rest(
    sequence: Sequence[SampleRange],
    per_rank: int,
    counts: Sequence[int],
    consumed: Sequence[Sequence[int]],
    sizes_of: Callable[[SampleRange], Sizes],
    *,
    shuffle: bool,
    key: Callable[[int, int], tuple[int, ...]],
    max_samples: int,
    max_bytes: int,
) -> list[SampleRange]:
    """The rest of a pass: what its slots had not streamed, by rank, slot, then position.

    ``per_rank`` and ``counts`` are the pass's share per rank and per slot;
    ``consumed[r][w]`` is how many samples slot ``w`` of rank ``r`` had
    handed out; ``key(r, w)`` that slot's shuffle key. Adjacent ranges are merged.
    """
    size = sum(len(r) for r in sequence)
    rest: list[SampleRange] = []
    for rank, slots in enumerate(consumed):
        start = rank * per_rank
        for worker, (count, done) in enumerate(zip(counts, slots, strict=True)):
            pieces = slice_order(sequence, size, start, start + count)
            start += count
            rest.extend(
                slot_rest(
                    pieces,
                    done,
                    sizes_of,
                    shuffle=shuffle,
                    key=key(rank, worker),
                    max_samples=max_samples,
                    max_bytes=max_bytes,
                )
            )
    return merge_ranges(rest)


def merge_ranges(ranges: Sequence[SampleRange]) -> list[SampleRange]:
    """``ranges`` with each run of adjacent ranges of one shard joined (unpadded input)."""
    merged: list[SampleRange] = []
    for piece in ranges:
        if not len(piece):
            continue
        last = merged[-1] if merged else None
        if last is not None and last.shard == piece.shard and last.stop == piece.start:
            merged[-1] = SampleRange(last.shard, last.start, piece.stop)
        else:
            merged.append(piece)
    return merged
