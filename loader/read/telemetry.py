"""Telemetry: where one pass's time goes, counted at batch granularity, always on. No torch.

A pass (one worker slot's share of an epoch, or the main process's with
``num_workers=0``) counts into one ``Clock``: a row of ``int64`` counters
(``ROW`` of them). The torch layer gives each slot a row of the dataset's shared-memory
tensor (``loader.torch.epochs.SharedProgress``), so what a DataLoader worker counts is
in the main process as it is counted, with nothing sent; ``loader.core.ShardStream``
alone keeps a private row. Every count is an addition of ``time.perf_counter_ns``
differences once per batch (once per piece read for ``read``), never per sample.

Stages (nanoseconds in the row, seconds in ``EpochStats``), each counted where it runs:

* ``plan``: the pass's order, partition and read plan, and its reader (``ShardStream.items``);
* ``read``: the bytes of each piece (``ShardReader.read``: file reads, the read-ahead,
  zstd frames, index checks);
* ``checksums``: cutting samples out of the read windows and checking their checksums
  (the per-sample path); gathered batches check theirs inside ``assemble``;
* ``decode``: decoders and the user's ``transform``;
* ``assemble``: making the batch (collate, or the gather with its checksums and, for
  large local samples, their reads);
* ``handoff``: pickling the batch for the main process (in the worker's queue thread);
* ``network``: waiting on the object store (a URL: the source's ``io_counts()["wait_ns"]``,
  inside ``read`` or on read-ahead threads, so not added to the others).

The main process adds what only it sees: ``wait`` (inside ``next()`` on the batch
iterator: the training loop waiting for the next batch), ``compute`` (between a
batch's arrival and the next ``next()``: the training step) and the time to the first
batch. ``epoch_stats`` adds the rows of one pass into an ``EpochStats``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = [
    "IO_KEYS",
    "ROW",
    "STAGES",
    "Clock",
    "EpochStats",
    "Timed",
    "epoch_stats",
]

STAGES = ("plan", "read", "checksums", "decode", "assemble", "handoff", "network")
PLAN, READ, CHECKSUMS, DECODE, ASSEMBLE, HANDOFF, NETWORK = range(len(STAGES))
IO_KEYS = ("requests", "bytes", "retries", "cache_hits", "cache_misses")

# the row: the pass's part (reset when a pass starts), then the main process's part
EPOCH = 0  # epoch + 1 of the pass counted (0: none)
SAMPLES, BATCHES, REMOTE = 1, 2, 3  # REMOTE: 1 when the io counters below were read
STAGE0 = 4
IO0 = STAGE0 + len(STAGES)
PASS_END = IO0 + len(IO_KEYS)
WAIT, COMPUTE, FIRST, ASKED = range(
    PASS_END, PASS_END + 4
)  # main process only (ASKED: next() calls)
ROW = PASS_END + 4

Row = npt.NDArray[np.int64]
T = TypeVar("T")


class Clock:
    """One process's counters of one pass, in ``row`` (shared memory, or a private row).

    Counted through a ``memoryview`` of the row: an addition to one of its cells costs
    about a fifth of a NumPy element's (tens of nanoseconds)."""

    __slots__ = ("cells", "row")

    def __init__(self, row: Row | None = None) -> None:
        self.row: Row = np.zeros(ROW, np.int64) if row is None else row
        self.cells = self.row.data

    def start(self, epoch: int) -> None:
        """A pass of ``epoch`` starts: its part of the row is zeroed (the main part stays)."""
        self.row[:PASS_END] = 0
        self.cells[EPOCH] = epoch + 1

    def add(self, stage: int, ns: int) -> None:
        """``ns`` more nanoseconds in ``stage`` (``STAGES`` index)."""
        self.cells[STAGE0 + stage] += ns

    def batch(self, samples: int) -> None:
        """One more item handed out, of ``samples`` samples."""
        cells = self.cells
        cells[SAMPLES] += samples
        cells[BATCHES] += 1

    def count(self, samples: int, batches: int) -> None:
        """``batches`` more items handed out, of ``samples`` samples in all."""
        cells = self.cells
        cells[SAMPLES] += samples
        cells[BATCHES] += batches

    def elapsed(self, stage: int) -> int:
        """Nanoseconds counted in ``stage`` so far (to subtract a nested stage)."""
        ns: int = self.cells[STAGE0 + stage]
        return ns

    def io_since(self, before: Mapping[str, int], now: Mapping[str, int]) -> None:
        """A remote source's counters moved from ``before`` to ``now`` in this pass."""
        cells = self.cells
        cells[REMOTE] = 1
        for k, key in enumerate(IO_KEYS):
            cells[IO0 + k] += now.get(key, 0) - before.get(key, 0)
        cells[STAGE0 + NETWORK] += now.get("wait_ns", 0) - before.get("wait_ns", 0)

    def stats(self) -> EpochStats:
        """This row alone as ``EpochStats``."""
        return epoch_stats(self.row[None, :])

    def __getstate__(self) -> Row:
        return self.row  # (a memoryview does not pickle)

    def __setstate__(self, row: Row) -> None:
        self.row, self.cells = row, row.data


@dataclass(frozen=True)
class EpochStats:
    """One rank's pass of an epoch: counts, seconds by stage and, in the main process, the wait.

    ``stages`` adds the rank's workers (so with 4 workers it can reach 4x the wall
    time); ``wait_s``/``compute_s``/``first_batch_s`` are None where the main process
    did not see the batches arrive (workers, without ``ds.timed(loader)``); ``io`` is
    None for a local output.
    """

    epoch: int
    samples: int
    batches: int
    stages: Mapping[str, float]
    wait_s: float | None = None
    compute_s: float | None = None
    first_batch_s: float | None = None
    io: Mapping[str, int] | None = None

    @property
    def wait_share(self) -> float | None:
        """The share of the loop's time spent waiting for batches (None: not measured)."""
        if self.wait_s is None or self.compute_s is None:
            return None
        total = self.wait_s + self.compute_s
        return self.wait_s / total if total > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        """A flat dict of numbers, for ``self.log_dict`` or a print: ``stage_<name>_s``,
        ``io_<key>``; measures that are None are left out."""
        flat: dict[str, float] = {
            "epoch": self.epoch,
            "samples": self.samples,
            "batches": self.batches,
        }
        for name, value in (
            ("wait_s", self.wait_s),
            ("compute_s", self.compute_s),
            ("wait_share", self.wait_share),
            ("first_batch_s", self.first_batch_s),
        ):
            if value is not None:
                flat[name] = value
        flat.update({f"stage_{name}_s": s for name, s in self.stages.items()})
        if self.io is not None:
            flat.update({f"io_{key}": n for key, n in self.io.items()})
        return flat


def epoch_stats(rows: Row, main: Row | None = None) -> EpochStats:
    """The pass counted in ``rows`` (one per slot; those of another epoch, or none, left
    out): the latest epoch any of them counted. ``main``: the main process's row, for the
    wait it saw.
    """
    epochs = rows[:, EPOCH]
    latest = int(epochs.max()) if len(epochs) else 0
    mine = rows[epochs == latest] if latest else rows[:0]
    total = mine.sum(axis=0) if len(mine) else np.zeros(ROW, np.int64)
    stages = {name: int(total[STAGE0 + k]) / 1e9 for k, name in enumerate(STAGES)}
    io = None
    if int(total[REMOTE]):
        io = {key: int(total[IO0 + k]) for k, key in enumerate(IO_KEYS)}
    wait = compute = first = None
    if main is not None and int(main[FIRST]):
        wait, compute = int(main[WAIT]) / 1e9, int(main[COMPUTE]) / 1e9
        first = int(main[FIRST]) / 1e9
    return EpochStats(
        epoch=latest - 1,
        samples=int(total[SAMPLES]),
        batches=int(total[BATCHES]),
        stages=stages,
        wait_s=wait,
        compute_s=compute,
        first_batch_s=first,
        io=io,
    )


class LoopClock:
    """The main process's view of the training loop: ``wait`` inside ``next()``, ``compute``
    between an item's arrival and the next ``next()``, in the main part of ``row``.

    ``loader.torch.stream.EpochStream`` does the same inline (its ``__next__`` is the
    in-process loop's ``next()``): a method call is a noticeable share of a batch there."""

    __slots__ = ("cells", "last", "started")

    def __init__(self, row: Row) -> None:
        row[WAIT:ROW] = 0
        self.cells = row.data
        self.started = time.perf_counter_ns()
        self.last = 0  # when the last item arrived (0: none yet)

    def asked(self) -> int:
        """``next()`` is called now: the time since the last arrival was the loop's."""
        now = time.perf_counter_ns()
        if self.last:
            self.cells[COMPUTE] += now - self.last
        return now

    def arrived(self, asked: int) -> None:
        """The item asked for at ``asked`` arrived now (or the pass ended)."""
        now = time.perf_counter_ns()
        cells = self.cells
        cells[WAIT] += now - asked
        if not self.last:
            cells[FIRST] = now - self.started
        self.last = now


class Timed(Generic[T]):
    """Iterating ``loader`` with the main process's wait and compute counted (``LoopClock``)
    into ``row`` from ``iter()`` on (None: counted elsewhere, passed through); ``len()`` is
    the loader's."""

    def __init__(self, loader: Iterable[T], row: Row | None) -> None:
        self.loader = loader
        self._row = row

    def __len__(self) -> int:
        if not isinstance(self.loader, Sized):
            raise TypeError(f"{type(self.loader).__name__} has no len()")
        return len(self.loader)

    def __iter__(self) -> Iterator[T]:
        if self._row is None:
            yield from self.loader
            return
        clock = LoopClock(self._row)
        asked = clock.asked()
        items = iter(self.loader)  # (starts the workers: the loop waits for them too)
        while True:
            try:
                item = next(items)
            except StopIteration:
                clock.arrived(asked)
                return
            clock.arrived(asked)
            yield item
            asked = clock.asked()
