"""State: resume positions as a few numbers, their validation, and the arithmetic behind them. Pure.

Two positions exist, one per way of resuming:

* **A worker's position** (torchdata's ``StatefulDataLoader`` protocol): the
  epoch, the worker slot and how many items (batches, or samples without a
  batch size) that slot has yielded. torchdata saves one per worker and
  restores the DataLoader's worker rotation itself.
* **A rank's position** (plain ``torch.utils.data.DataLoader``): the epoch and
  how many batches of it were consumed, read off the last batch itself
  (``ShardDataset.state_after(batch)``), so no caller-side count can be wrong.
  On resume, DataLoader worker ``d`` takes over slot ``(batches + d) % K`` and
  skips the batches that slot had already made (``rank_resume``): the
  restarted round-robin then delivers exactly the remaining batches in order.

Both carry the options that fix the order (manifest fingerprint, seed,
shuffle, window, batch size, world size, ...); loading a state made under
other options raises ``IncompatibleStateError`` naming the field. A rank's
position may resume at another world size or ``num_workers`` (elastic
resume, ``loader.elastic``); it then also carries the epoch's earlier passes
(``history``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loader.errors import IncompatibleStateError

__all__ = ["STATE_VERSION", "check_state", "rank_resume"]

STATE_VERSION = 2

_HINTS = {
    "manifest": "the state was saved for another build of the data",
    "world_size": "a torchdata state resumes at the same number of ranks only; for another world "
    "size save ShardDataset.state_after(batch) and call ShardDataset.resume(state) (elastic "
    "resume, with a batch_size)",
    "num_workers": "a torchdata state resumes with the same num_workers only; for another number "
    "save ShardDataset.state_after(batch) and call ShardDataset.resume(state) (elastic resume)",
    "batch_size": "create the ShardDataset with the same batch_size as when the state was saved",
}


def rank_resume(batches: int, num_workers: int, worker: int) -> tuple[int, int]:
    """(slot, batches to skip) for DataLoader worker ``worker`` after ``batches`` consumed batches.

    Batch ``i`` of a rank's epoch is made by slot ``i % num_workers``. The
    restarted DataLoader asks worker 0 first, so worker ``d`` plays slot
    ``(batches + d) % num_workers``, which had made every batch ``i <
    batches`` with ``i % num_workers == slot``.
    """
    if batches < 0 or not 0 <= worker < num_workers:
        raise ValueError(f"bad resume position: {batches} batches, worker {worker}/{num_workers}")
    slot = (batches + worker) % num_workers
    return slot, len(range(slot, batches, num_workers))


def check_state(
    saved: Mapping[str, Any], current: Mapping[str, Any], required: tuple[str, ...]
) -> None:
    """Raise IncompatibleStateError naming the first field of ``current`` that ``saved`` contradicts.

    Raises:
        IncompatibleStateError: another version or dataset, other options,
            or one of the ``required`` position fields missing.
    """
    if not isinstance(saved, Mapping):
        raise IncompatibleStateError(
            f"cannot resume: a state is a dict, not {type(saved).__name__}"
        )
    if saved.get("version") != STATE_VERSION:
        raise IncompatibleStateError.field_differs(
            "version", saved.get("version"), STATE_VERSION, "the state comes from another release"
        )
    for field, value in current.items():
        if saved.get(field) != value:
            raise IncompatibleStateError.field_differs(
                field, saved.get(field), value, _HINTS.get(field, "")
            )
    for field in required:
        if not isinstance(saved.get(field), int) or saved[field] < 0:
            raise IncompatibleStateError(
                f"cannot resume: the state's {field!r} is {saved.get(field)!r}, not a count",
                field=field,
                saved=saved.get(field),
            )
