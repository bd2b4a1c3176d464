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

from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

from loader.errors import IncompatibleStateError

__all__ = [
    "STATE_VERSION",
    "Position",
    "check_state",
    "next_position",
    "rank_resume",
    "worker_states",
]

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


class Position(NamedTuple):
    """Where a loop resumed from a state continues: ``epoch``, after ``batch`` items of its pass."""

    epoch: int
    batch: int


def worker_states(state: Any) -> list[Mapping[str, Any]]:
    """The per-worker positions inside a torchdata ``StatefulDataLoader.state_dict()``.

    torchdata nests each worker's iterator state (ours: ``epoch``, ``slot``,
    ``yielded``) a few levels down; they are found by their fields, not by
    torchdata's key names.
    """

    def walk(value: Any) -> Iterator[Mapping[str, Any]]:
        if isinstance(value, Mapping):
            if {"epoch", "slot", "yielded", "num_workers", "world_size"} <= value.keys():
                yield value
                return
            for item in value.values():
                yield from walk(item)

    return list(walk(state))


def next_position(state: Mapping[str, Any], pass_items: Callable[[int, int, int], int]) -> Position:
    """The epoch and item a loop resumed from ``state`` continues at (a pure function).

    ``state`` is ``state_after(batch)``'s dict (``epoch``, ``batches``) or a
    torchdata ``StatefulDataLoader.state_dict()`` (per-worker ``epoch``,
    ``yielded``). ``pass_items(epoch, world_size, num_workers)`` is the number
    of items every rank yields in that epoch's pass. A state at its pass's end
    continues at the next epoch's first item, as resuming it does.

    Raises:
        IncompatibleStateError: neither kind of state.
    """
    if isinstance(state, Mapping) and isinstance(state.get("batches"), int):
        epoch, done = int(state["epoch"]), int(state["batches"])
        world, workers = int(state["world_size"]), int(state["num_workers"])
    else:
        workers_ = worker_states(state)
        if not workers_:
            raise IncompatibleStateError(
                "cannot tell where to continue: not a ShardDataset.state_after() dict nor a "
                "StatefulDataLoader.state_dict() over a shardprep dataset"
            )
        epoch = max(int(w["epoch"]) for w in workers_)
        done = sum(int(w["yielded"]) for w in workers_ if int(w["epoch"]) == epoch)
        world, workers = int(workers_[0]["world_size"]), int(workers_[0]["num_workers"])
    if done >= pass_items(epoch, world, workers):
        return Position(epoch + 1, 0)
    return Position(epoch, done)
