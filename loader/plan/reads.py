"""Reads: what a worker will read, in order, as byte ranges of shard files. Pure; no I/O.

The epoch order is a pure function of (seed, epoch), so a worker knows its whole read
schedule before it reads anything: the windows of ``loader.plan.windows.plan_windows`` over
its pieces, each window one read per piece (a reader's ``span``). ``planned_reads`` replays
exactly that plan (the same windows, the same resume skip); ``plan_groups`` coalesces
adjacent reads of one shard into groups of at most ``request_bytes``. A ``ReadPlan`` says
what a reader will read: ``window_plan`` the windows of a ``ShardStream`` slot, ``piece_plan``
each piece whole in the order given (a mixture source's batches, drawn lazily).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from loader.plan.order import SampleRange
from loader.plan.windows import Sizes, plan_windows
from shardprep.format.shardformat import ShardIndex

__all__ = [
    "Group",
    "Read",
    "ReadPlan",
    "Spans",
    "piece_plan",
    "plan_groups",
    "planned_reads",
    "planned_windows",
    "window_plan",
]


class Spans(Protocol):
    """What planning needs of a reader (``loader.read.reader.ShardReader``): its checked indexes."""

    def sample_sizes(self, piece: SampleRange) -> Sizes:
        """The bytes of each sample of ``piece``."""

    def span(self, piece: SampleRange) -> tuple[int, int]:
        """(offset, size) of the bytes of ``piece`` in its shard file."""

    def index(self, shard: int) -> ShardIndex:
        """The checked index of ``shard``."""


@dataclass(frozen=True, slots=True)
class Read:
    """One read the ``Spans`` will make: ``size`` bytes of ``shard``'s file at ``offset``."""

    shard: int
    offset: int
    size: int

    @property
    def stop(self) -> int:
        return self.offset + self.size


@dataclass(slots=True)
class Group:
    """Consecutive planned reads of one shard covered by one byte span ``[start, stop)``."""

    shard: int
    start: int
    stop: int
    reads: list[Read] = field(default_factory=list)


def planned_reads(
    pieces: list[SampleRange], reader: Spans, skip: int, max_samples: int, max_bytes: int
) -> Iterator[Read]:
    """The reads ``shuffled_windows`` makes, in order (the same windows, the same resume skip)."""
    for window in planned_windows(pieces, reader, skip, max_samples, max_bytes):
        yield from window


def planned_windows(
    pieces: list[SampleRange], reader: Spans, skip: int, max_samples: int, max_bytes: int
) -> Iterator[list[Read]]:
    """``planned_reads`` window by window: each window's reads."""
    for window in plan_windows(pieces, reader.sample_sizes, max_samples, max_bytes):
        size = sum(len(piece) for piece in window)
        if skip >= size:
            skip -= size  # shuffled_windows skips this window without reading it
            continue
        skip = 0
        yield [Read(piece.shard, *reader.span(piece)) for piece in window]


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """What a reader will read, in order; both lazy, each call a fresh iterator.

    ``reads(reader)``: its reads (spans come from the reader's indexes);
    ``shards()``: the shards it reads, in order (repeats allowed), for the index files
    fetched ahead.
    """

    reads: Callable[[Spans], Iterator[Read]]
    shards: Callable[[], Iterator[int]]


def window_plan(pieces: list[SampleRange], skip: int, max_samples: int, max_bytes: int) -> ReadPlan:
    """The reads of ``shuffled_windows`` over ``pieces`` (a ``ShardStream`` slot)."""
    return ReadPlan(
        lambda reader: planned_reads(pieces, reader, skip, max_samples, max_bytes),
        lambda: (piece.shard for piece in pieces),
    )


def piece_plan(pieces: Callable[[], Iterator[SampleRange]]) -> ReadPlan:
    """Each piece read whole, in the order ``pieces()`` gives them (a mixture source's reads).

    ``pieces`` is called twice (reads, shards): it must give the same pieces each time.
    """

    def reads(reader: Spans) -> Iterator[Read]:
        for piece in pieces():
            yield Read(piece.shard, *reader.span(piece))

    return ReadPlan(reads, lambda: (piece.shard for piece in pieces()))


def plan_groups(reads: Iterator[Read], request_bytes: int) -> Iterator[Group]:
    """Group ``reads`` in order: a read joins the group before it when it is of the same shard,
    starts inside or right at the end of the group's span (zstd frames shared by two windows
    overlap) and the span stays within ``request_bytes``. A larger read is a group of its own."""
    group: Group | None = None
    for read in reads:
        if (
            group is not None
            and read.shard == group.shard
            and group.start <= read.offset <= group.stop
            and max(group.stop, read.stop) - group.start <= request_bytes
        ):
            group.stop = max(group.stop, read.stop)
            group.reads.append(read)
            continue
        if group is not None:
            yield group
        group = Group(read.shard, read.offset, read.stop, [read])
        if read.size > request_bytes:  # no read can join it: out now, before the next read is
            yield group  # planned (which may wait for another shard's index)
            group = None
    if group is not None:
        yield group
