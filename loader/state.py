"""State: the resume position as a few numbers, and the arithmetic that maps batches to it. Pure.

A state says "epoch e, and worker slot w has consumed c_w samples". It is the
same on every rank (ranks consume in lockstep), so any rank may save it. The
per-slot counts come from replaying how ``torch.utils.data.DataLoader`` takes
batches from an IterableDataset's workers: in turn, worker 0, 1, ..., skipping
workers that have run out. Everything else (order, partition, windows) is
recomputed from the seed on resume.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loader.errors import IncompatibleStateError

__all__ = ["STATE_VERSION", "check_state", "consumed_per_slot", "replay"]

STATE_VERSION = 1

# Fields that must be equal between the saved state and the run that loads it.
MUST_MATCH = (
    "manifest",
    "seed",
    "shuffle",
    "uneven",
    "block_size",
    "shuffle_buffer",
    "shuffle_buffer_bytes",
    "class_weights",
    "world_size",
)


def _batches_of(count: int, batch_size: int, drop_last: bool) -> int:
    return count // batch_size if drop_last else -(-count // batch_size)


def consumed_per_slot(
    batches: int, slot_counts: Sequence[int], batch_size: int, drop_last: bool = False
) -> list[int]:
    """Samples each worker slot had produced once ``batches`` batches were consumed."""
    return replay(batches, slot_counts, batch_size, drop_last)[0]


def replay(
    batches: int, slot_counts: Sequence[int], batch_size: int, drop_last: bool = False
) -> tuple[list[int], int]:
    """(samples consumed per slot, slot that delivers the next batch) after ``batches`` batches.

    DataLoader takes batches from its workers in a fixed cycle 0, 1, ...,
    skipping workers that have run out. After a resume the DataLoader starts
    its cycle at worker 0 again, so the dataset maps worker ``i`` to slot
    ``(next_slot + i) % num_workers``: the resumed cycle then visits the slots
    in the same order as the uninterrupted run would have.

    Raises:
        ValueError: ``batches`` is more than the epoch has.
    """
    per_worker = [_batches_of(c, batch_size, drop_last) for c in slot_counts]
    if batches > sum(per_worker):
        raise ValueError(f"{batches} batches consumed, but the epoch has only {sum(per_worker)}")
    taken = [0] * len(per_worker)
    remaining = batches
    while remaining:
        active = [w for w, b in enumerate(per_worker) if taken[w] < b]
        rounds = min(per_worker[w] - taken[w] for w in active)
        if remaining >= rounds * len(active):
            for w in active:
                taken[w] += rounds
            remaining -= rounds * len(active)
            continue
        full, partial = divmod(remaining, len(active))
        for position, w in enumerate(active):
            taken[w] += full + (1 if position < partial else 0)
        remaining = 0
    consumed = [min(t * batch_size, c) for t, c in zip(taken, slot_counts, strict=True)]
    active = [w for w, b in enumerate(per_worker) if taken[w] < b]
    # Active slots that already took this round's batch have one more than the rest.
    next_slot = min(active, key=lambda w: (taken[w], w)) if active else 0
    return consumed, next_slot


def check_state(saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Raise IncompatibleStateError naming the first field that differs.

    Raises:
        IncompatibleStateError: other version, dataset, seed, options or world size.
    """
    if saved.get("version") != STATE_VERSION:
        raise IncompatibleStateError.field_differs("version", saved.get("version"), STATE_VERSION)
    hints = {
        "manifest": "the state was saved for another build of the data",
        "world_size": "resume with the same number of ranks (elastic re-splitting is not supported)",
    }
    for field in MUST_MATCH:
        if saved.get(field) != current.get(field):
            raise IncompatibleStateError.field_differs(
                field, saved.get(field), current.get(field), hints.get(field, "")
            )
