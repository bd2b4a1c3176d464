"""State: one resume state (``ResumeState``), its validation, and the arithmetic behind it. Pure.

A ``ResumeState`` is the options that fix the order (manifest fingerprint,
seed, shuffle, window, batch size, world size, ``num_workers``, ...), the
epoch, the epoch's earlier passes (``history``, after elastic resumes) and a
position in the current pass, at one of two levels:

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

Its dict form (``as_dict``) is what is saved: flat, JSON-able, versioned
(``STATE_VERSION``). ``ResumeState.parse`` reads either form back, checked
against the current options: another version, build or option raises
``IncompatibleStateError`` naming the field. The world size and
``num_workers`` may differ (elastic resume, ``loader.plan.elastic``): the
consumed part of the pass becomes one more entry of ``history`` and the rest
is re-split over the new world. A torchdata ``StatefulDataLoader.state_dict()``
holds one worker-level state per worker; ``rank_state`` adds them up into the
rank-level state (ranks of a DDP job move in lockstep).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from loader.errors import IncompatibleStateError
from loader.plan.elastic import Pass

__all__ = [
    "ELASTIC_FIELDS",
    "STATE_VERSION",
    "Position",
    "ResumeState",
    "check_state",
    "next_position",
    "rank_resume",
    "rank_state",
    "worker_states",
]

STATE_VERSION = 2
ELASTIC_FIELDS = ("world_size", "num_workers")  # the options an elastic resume may change
_RANK_POSITION = ("epoch", "batches")
_WORKER_POSITION = ("epoch", "slot", "yielded")

_HINTS = {
    "manifest": "the state was saved for another build of the data, or another version of "
    "it (a build appended to: a state resumes only on the version it was saved on; pass "
    "ShardDataset(OUT, version=N), and see each version's manifest sha256 with shardprep "
    "inspect OUT)",
    "world_size": "this dataset resumes at the world size it was saved at only (elastic resume "
    "is for a ShardDataset with a batch_size)",
    "num_workers": "torchdata's StatefulDataLoader restores the num_workers it saved only; for "
    "another number pass its state_dict() to ShardDataset.resume(state) and iterate a new "
    "StatefulDataLoader without load_state_dict (elastic resume)",
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


@dataclass(frozen=True)
class ResumeState:
    """A position in a pass of an epoch, with the options that fix the order.

    ``options`` is the stream's ``options_fingerprint`` at the world the state
    was saved in (it holds ``world_size`` and ``num_workers``). The position is
    rank-level (``batches``: items every rank had consumed in the pass; what
    ``state_after`` saves) or worker-level (``slot`` and ``yielded``: one
    torchdata worker's slot and the items it had yielded).
    """

    options: Mapping[str, Any]
    epoch: int
    history: tuple[Pass, ...] = ()
    batches: int | None = None
    slot: int | None = None
    yielded: int | None = None

    @property
    def world_size(self) -> int:
        """The number of ranks the state was saved at."""
        return int(self.options["world_size"])

    @property
    def num_workers(self) -> int:
        """The worker slots per rank the state was saved with."""
        return int(self.options["num_workers"])

    @property
    def rank_level(self) -> bool:
        """Whether the position is a rank's (``batches``) rather than a worker's."""
        return self.batches is not None

    def as_dict(self) -> dict[str, Any]:
        """The saved form: the options, the position and ``history`` in one flat dict."""
        position: dict[str, Any] = {"epoch": self.epoch}
        if self.batches is not None:
            position["batches"] = self.batches
        else:
            position["slot"], position["yielded"] = self.slot, self.yielded
        return {**self.options, **position, "history": [list(p) for p in self.history]}

    @classmethod
    def parse(cls, saved: Any, current: Mapping[str, Any], elastic: bool = False) -> ResumeState:
        """``saved`` (either level's dict) checked against the ``current`` options.

        ``elastic``: the world size and ``num_workers`` may differ from
        ``current``'s; they are then taken from ``saved``.

        Raises:
            IncompatibleStateError: not a state, another version, build or
                option (the message names the field), a missing or negative
                position, a malformed ``history``.
        """
        rank_level = isinstance(saved, Mapping) and "batches" in saved
        required = _RANK_POSITION if rank_level else _WORKER_POSITION
        expected = dict(current)
        if elastic and isinstance(saved, Mapping):
            for field in ELASTIC_FIELDS:
                value = saved.get(field)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise IncompatibleStateError.field_differs(field, value, "a positive int")
                expected[field] = value
        check_state(saved, expected, required)
        options = {field: saved[field] for field in expected}
        history = parse_history(saved.get("history", []))
        if rank_level:
            return cls(options, int(saved["epoch"]), history, batches=int(saved["batches"]))
        return cls(
            options,
            int(saved["epoch"]),
            history,
            slot=int(saved["slot"]),
            yielded=int(saved["yielded"]),
        )


def parse_history(value: Any) -> tuple[Pass, ...]:
    """The ``history`` of a saved state as passes, checked.

    Raises:
        IncompatibleStateError: not a list of ``[world_size, num_workers, batches]``.
    """
    if not isinstance(value, Sequence) or not all(
        isinstance(p, Sequence)
        and len(p) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) for v in p)
        and p[0] >= 1
        and p[1] >= 1
        and p[2] >= 0
        for p in value
    ):
        raise IncompatibleStateError.field_differs(
            "history", value, "a list of [world_size, num_workers, batches]"
        )
    return tuple(Pass(*p) for p in value)


def rank_state(loader_state: Any, current: Mapping[str, Any]) -> ResumeState:
    """The rank-level state of a torchdata ``StatefulDataLoader.state_dict()``.

    Its worker-level states (one per worker, found by their fields) add up:
    in the latest epoch among them, the rank had consumed the items every
    worker had yielded (a worker still on an older epoch had finished that
    epoch's slot and yielded nothing of the new one). ``current`` are the
    options to check against, the world size and ``num_workers`` excepted.

    Raises:
        IncompatibleStateError: no worker state of this kind of dataset inside,
            or one made under other options.
    """
    found = worker_states(loader_state)
    if not found:
        raise IncompatibleStateError(
            "cannot resume: not a ShardDataset.state_after() dict nor a "
            "StatefulDataLoader.state_dict() over a shardprep dataset"
        )
    workers = [ResumeState.parse(w, current, elastic=True) for w in found]
    epoch = max(w.epoch for w in workers)
    latest = [w for w in workers if w.epoch == epoch]
    first = latest[0]
    for other in latest[1:]:
        if (other.options, other.history) != (first.options, first.history):
            raise IncompatibleStateError(
                "cannot resume: the workers' states inside this StatefulDataLoader state were "
                "saved in different worlds or passes",
                field="history",
            )
    batches = sum(w.yielded or 0 for w in latest)
    return ResumeState(first.options, epoch, first.history, batches=batches)


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
