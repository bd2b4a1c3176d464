"""Mix: several shardprep outputs streamed as one, in fixed proportions per epoch. No torch.

**Counts.** With weights ``w`` (normalized) and ``N = samples_per_epoch``
(default: the sources' totals added up), source ``i`` is given
``n_i = apportion(N, w)[i]`` samples (largest remainders), and every one of
``W`` ranks streams ``m_i = n_i // W`` of them per epoch: an epoch holds
exactly ``W * m_i`` samples of source ``i`` (the ``n_i % W`` others are not
streamed; ``uneven`` does not apply to mixtures). ``N`` is at most ``2**53``
(the apportionment is float64 arithmetic, exact up to there).

**Which samples.** Source ``i`` (``T_i`` samples after its class weights) is
read in *laps*: lap ``k`` is the source's own epoch order ``k`` (its seed,
block shuffle and class-weight draw). With ``c = W * m_i`` samples per epoch:

* ``c <= T_i`` (down-sampling, or exactly the source): ``p = T_i // c``
  epochs share a lap; epoch ``e`` takes positions ``[(e % p) c, (e % p + 1) c)``
  of lap ``e // p``. No sample repeats within an epoch, nor within the ``p``
  epochs that share a lap; the lap's last ``T_i - p c`` are skipped.
* ``c > T_i`` (up-sampling by repetition): epoch ``e`` takes ``q = c // T_i``
  whole laps and the first ``c % T_i`` positions of one more (laps
  ``e (q + 1)`` onwards): every sample appears ``q`` or ``q + 1`` times.

Rank ``r`` streams positions ``[r m_i, (r + 1) m_i)`` of that sequence.

**Batches** (the same plan on every rank, a function of ``m``, the batch
size, the seed and the epoch; ``M = sum(m)``):

* ``"mixed"``: every batch mixes the sources. The last, partial batch (``M %
  B`` samples, unless ``drop_last``, which leaves its samples out) holds
  ``apportion(M % B, m)``; each of the ``J = M // B`` full batches holds
  ``floor(q_i)`` or ``ceil(q_i)`` samples of source ``i``, where ``q_i`` is
  what remains of ``m_i`` divided by ``J`` (so within ±1 of its share of the
  batch). The rows are laid out cyclically (row ``k`` holds the extra sample
  of source ``i`` when ``(k - o_i) mod J < x_i``, ``x_i`` the source's extras
  and ``o_i`` those of the sources before it), and batch ``j`` is row
  ``(a j + s) mod J``: ``a`` an integer coprime with ``J`` near
  ``0.618 J`` with small partial quotients (so the extras spread evenly), ``s`` seeded per epoch.
  Samples are shuffled inside each batch.
* ``"per_source"``: every batch comes from one source; source ``i`` makes
  ``ceil(m_i / B)`` batches (``floor`` with ``drop_last``; only its last can
  be partial), and the sources' batches are interleaved in proportion
  (largest deficit first, ties in a seeded order): after any number ``t`` of
  batches, source ``i`` has made ``t * b_i / sum(b)`` of them within ±1
  (``b_i`` its batches per epoch).

**Memory and time.** Nothing here is a list as long as the epoch: a plan
gives batch ``j`` (its per-source counts, and where each source's samples
start) from ``O(sources)`` numbers: ``"mixed"`` in ``O(sources log J)`` time
for any ``j`` (prefix counts of the affine layout are floor sums);
``"per_source"`` by replaying the interleave's ``O(sources)`` counters up
to ``j``. A batch's samples are found from its positions (laps, then the
lap's block order, one order cached per source).

**Reading.** Each source reads as a ``ShardStream`` does (``ShardStream.reader``):
a worker slot's pieces of the source, in the order its batches consume them,
are read whole by one reader per lap with class weights (one for all laps
without), which for a remote source fetches them ahead and through the cache
(``loader.plan.reads.piece_plan``, drawn lazily from the batch plan). The
source's ``ReadOptions.on_error`` applies: ``"skip"`` leaves an unreadable
sample out with a warning (naming its shard, key, source and batch), and its
batch comes out short by it: the other batches and every later position stay
exactly the plan's, and a batch whose samples are all unreadable raises.
A mixture's shuffle window is its batch (the samples are shuffled inside it).

Every rank streams the same number of samples and batches; batch ``j`` of a
rank is made by worker slot ``j % K`` as in ``ShardDataset``, so resume works
the same way (at the same world size and ``num_workers``).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from functools import partial
from itertools import accumulate, dropwhile, takewhile
from typing import Any

import numpy as np

from loader.core import ShardStream
from loader.errors import CorruptShardError, IncompatibleStateError
from loader.plan.elastic import Pass
from loader.plan.order import SampleRange
from loader.plan.reads import piece_plan
from loader.plan.state import STATE_VERSION
from loader.plan.world import World
from loader.read.decode import make_decoder
from loader.read.output import NumpyOutput, Output
from loader.read.reader import ShardReader
from loader.read.samples import ErrorPolicy, piece_samples
from shardprep.format.classweights import apportion
from shardprep.format.rng import derive_rng

__all__ = [
    "BATCHINGS",
    "MAX_SAMPLES_PER_EPOCH",
    "MIX_PLAN_VERSION",
    "MixedPlan",
    "MixedStream",
    "PerSourcePlan",
    "floor_sum",
    "lap_ranges",
    "mixed_batches",
    "per_source_batches",
    "source_counts",
]

BATCHINGS = ("mixed", "per_source")
SOURCE = "__source__"  # the index of the source a sample came from, in every sample
MAX_SAMPLES_PER_EPOCH = 2**53  # float64 integers are exact up to here (the apportionment)
MIX_PLAN_VERSION = 2  # 2: "mixed" batches in the affine order (1: a stored seeded permutation)
_GOLDEN = (math.sqrt(5) - 1) / 2


def source_counts(total: int, weights: Sequence[float], world_size: int) -> list[int]:
    """Samples of each source every rank streams per epoch: ``apportion(total, w)[i] // W``."""
    shares = np.asarray(weights, dtype=np.float64)
    shares = shares / shares.sum()
    given = apportion(total, shares)
    if int(given.sum()) != total or (given < 0).any():  # only past float64's exact integers
        raise ValueError(
            f"cannot split {total} samples by the weights {list(weights)} exactly: give "
            f"samples_per_epoch of at most {MAX_SAMPLES_PER_EPOCH}"
        )
    return [int(n) // world_size for n in given]


def lap_ranges(
    size: int, count: int, epoch: int, begin: int = 0, stop: int | None = None
) -> list[tuple[int, int, int]]:
    """(lap, start, stop) of positions ``[begin, stop)`` of the ``count`` a source gives ``epoch``.

    ``size`` is the source's samples per lap; by default all ``count`` positions.
    The list holds only the laps the window touches.
    """
    stop = count if stop is None else stop
    if begin >= stop:
        return []
    if count <= size:
        per_lap = size // count
        start = (epoch % per_lap) * count
        return [(epoch // per_lap, start + begin, start + stop)]
    first = epoch * (count // size + 1)
    return [
        (first + k, max(begin - k * size, 0), min(stop - k * size, size))
        for k in range(begin // size, (stop - 1) // size + 1)
    ]


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum(floor((a * i + b) / m) for i in range(n))`` in ``O(log m)`` steps (``m > 0``)."""
    total = 0
    while n > 0:
        q, a = divmod(a, m)
        total += q * (n * (n - 1) // 2)
        q, b = divmod(b, m)
        total += q * n
        top = a * n + b
        if top < m:
            break
        n, b, m, a = top // m, top % m, a, m
    return total


class MixedPlan:
    """The ``"mixed"`` batch plan of one epoch, batch by batch in ``O(sources)`` memory.

    ``len(plan)`` batches; ``plan.row(j)`` the samples of each source in batch
    ``j``; ``plan.starts(j)`` where batch ``j``'s samples of each source start
    in the rank's sequence of that source (``sum`` of the rows before ``j``).
    """

    def __init__(
        self, counts: Sequence[int], batch_size: int, drop_last: bool, seed: int, epoch: int
    ) -> None:
        self.counts = [int(c) for c in counts]
        total = sum(self.counts)
        self.full, rest = divmod(total, batch_size)
        shares = np.asarray(self.counts, dtype=np.float64) / max(1, total)
        zeros = [0] * len(self.counts)
        self.last = [int(v) for v in apportion(rest, shares)] if rest else zeros
        self.partial = bool(rest) and not drop_last
        left = [c - v for c, v in zip(self.counts, self.last, strict=True)]
        full = max(1, self.full)
        self.base = [v // full for v in left] if self.full else zeros
        self.extra = [v % full for v in left] if self.full else zeros
        # Cyclic layout: source i's extras in rows o_i, o_i + 1, ... (mod J), o_i those before it.
        self.first_row = [sum(self.extra[:i]) % full for i in range(len(self.counts))]
        self.step = _spread_step(full)
        self.shift = int(derive_rng(seed, "mix-batches-affine", epoch).integers(full))

    def __len__(self) -> int:
        return self.full + int(self.partial)

    def __iter__(self) -> Iterator[list[int]]:
        return (self.row(j) for j in range(len(self)))

    def _check(self, j: int, stop: int) -> None:
        if not 0 <= j < stop:
            raise IndexError(f"batch {j} of a plan of {len(self)} batches")

    def row(self, j: int) -> list[int]:
        """Samples of each source in batch ``j``."""
        self._check(j, len(self))
        if j == self.full:
            return list(self.last)
        k = (self.step * j + self.shift) % self.full  # the cyclic layout's row
        return [
            b + int((k - o) % self.full < x)
            for b, x, o in zip(self.base, self.extra, self.first_row, strict=True)
        ]

    def starts(self, j: int) -> list[int]:
        """Samples of each source in the batches before ``j`` (``0 <= j <= len``)."""
        self._check(j, len(self) + 1)
        full = min(j, self.full)  # the partial batch starts where the full ones end
        after = j > self.full  # past the partial batch too
        return [
            full * b + self._extras_before(full, x, o) + (v if after else 0)
            for b, x, o, v in zip(self.base, self.extra, self.first_row, self.last, strict=True)
        ]

    def _extras_before(self, j: int, extra: int, first_row: int) -> int:
        """Batches ``< j`` holding an extra sample: ``(a j' + s - o) mod J < x`` counted."""
        if not extra:
            return 0
        # [y mod J < x] = floor(y / J) - floor((y - x) / J) for 0 <= x <= J
        offset = (self.shift - first_row) % self.full
        return floor_sum(j, self.full, self.step, offset) - floor_sum(
            j, self.full, self.step, offset - extra
        )

    def batches(self, first: int, step: int) -> Iterator[tuple[int, list[int], list[int]]]:
        """(j, row, starts) of batches ``first, first + step, ...``."""
        for j in range(first, len(self), step):
            yield j, self.row(j), self.starts(j)


class PerSourcePlan:
    """The ``"per_source"`` batch plan of one epoch, in ``O(sources)`` memory.

    Batch ``j`` needs the interleave's counters at ``j``: they are replayed
    (``O(j * sources)`` integer steps, no list), so ``batches(first, ...)``
    costs about a microsecond per source for each batch before ``first``.
    """

    def __init__(
        self, counts: Sequence[int], batch_size: int, drop_last: bool, seed: int, epoch: int
    ) -> None:
        self.counts = [int(c) for c in counts]
        self.batch_size = batch_size
        self.made = [c // batch_size + int(c % batch_size > 0 and not drop_last) for c in counts]
        self.priority = derive_rng(seed, "mix-sources", epoch).permutation(len(counts)).tolist()

    def __len__(self) -> int:
        return sum(self.made)

    def __iter__(self) -> Iterator[list[int]]:
        return (row for _, row, _ in self.batches(0, 1))

    def sources(self) -> Iterator[int]:
        """The source of each batch, in order: largest deficit first, ties by seeded priority.

        Batch ``t`` (from 1) goes to the source with the largest ``t * b_i - seen_i * sum(b)``.
        """
        made, priority = self.made, self.priority
        total = len(self)
        seen = [0] * len(made)
        for t in range(1, total + 1):
            best, best_key = -1, 0
            for i, want in enumerate(made):
                if seen[i] < want:
                    key = t * want - seen[i] * total
                    if (
                        best < 0
                        or key > best_key
                        or (key == best_key and priority[i] < priority[best])
                    ):
                        best, best_key = i, key
            seen[best] += 1
            yield best

    def batches(self, first: int, step: int) -> Iterator[tuple[int, list[int], list[int]]]:
        """(j, row, starts) of batches ``first, first + step, ...``."""
        size = self.batch_size
        seen = [0] * len(self.made)
        for j, i in enumerate(self.sources()):
            if j >= first and (j - first) % step == 0:
                row = [0] * len(self.made)
                row[i] = min(size, self.counts[i] - seen[i] * size)
                yield j, row, [k * size for k in seen]
            seen[i] += 1


def mixed_batches(
    counts: Sequence[int], batch_size: int, drop_last: bool, seed: int, epoch: int
) -> MixedPlan:
    """Samples of each source in each batch of a rank (mixed batches; see the module doc)."""
    return MixedPlan(counts, batch_size, drop_last, seed, epoch)


def per_source_batches(
    counts: Sequence[int], batch_size: int, drop_last: bool, seed: int, epoch: int
) -> PerSourcePlan:
    """Batches of one source each, interleaved in proportion (see the module doc)."""
    return PerSourcePlan(counts, batch_size, drop_last, seed, epoch)


def _spread_step(modulus: int) -> int:
    """A multiplier ``a`` coprime with ``modulus`` near ``0.618 modulus`` whose batches spread evenly.

    ``j -> a j mod J`` visits a cyclic interval of rows at an even rate when
    ``a / J`` has small partial quotients (golden-ratio-like): of the 128
    integers nearest ``0.618 J``, the coprime one with the smallest largest
    partial quotient (then the nearest) is taken.
    """
    target = round(_GOLDEN * modulus)
    best: tuple[tuple[int, int], int] | None = None
    for distance in range(64):
        for value in (target - distance, target + distance):
            if 1 <= value < modulus and math.gcd(value, modulus) == 1:
                key = (_largest_quotient(value, modulus), distance)
                if best is None or key < best[0]:
                    best = (key, value)
    return 1 if best is None else best[1]


def _largest_quotient(numerator: int, denominator: int) -> int:
    """The largest partial quotient of the continued fraction of ``denominator / numerator``."""
    largest = 0
    while numerator:
        quotient, rest = divmod(denominator, numerator)
        largest = max(largest, quotient)
        denominator, numerator = numerator, rest
    return largest


class MixedStream:
    """Several shardprep outputs as one stream of batches, in proportions fixed per epoch.

    Args:
        sources: output paths, or ``ShardStream`` objects (without a batch
            size) to set a source's own options: ``class_weights``, ``decode``,
            ``transform``, ``seed``, ``shuffle``, ``block_size``, ``read``.
        weights: one finite, non-negative weight per source, not all zero
            (normalized here).
        batch_size: samples per batch (mixing always makes batches).
        samples_per_epoch: ``N`` (at most ``2**53``); default: the sources'
            totals added up.
        batching: ``"mixed"`` or ``"per_source"`` (see the module doc).
        drop_last: leave out each rank's last partial batch(es).
        seed: seeds the batch plan and the shuffle inside each batch.

    Raises:
        ValueError: a weight that is negative, infinite or not a number (the
            message names it), weights all zero, or another bad argument.
    """

    elastic = False  # resumes at the world size and num_workers it was saved at only

    def __init__(
        self,
        sources: Sequence[str | ShardStream],
        weights: Sequence[float],
        *,
        batch_size: int,
        samples_per_epoch: int | None = None,
        batching: str = "mixed",
        drop_last: bool = False,
        seed: int = 0,
        output: Output | None = None,
    ) -> None:
        if not sources or len(weights) != len(sources):
            raise ValueError(f"give one weight per source: {len(sources)} sources, {len(weights)}")
        self.weights = _check_weights(weights)
        if isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, not {batch_size!r}")
        if batching not in BATCHINGS:
            raise ValueError(f"batching must be one of {BATCHINGS}, not {batching!r}")
        if samples_per_epoch is not None:
            samples_per_epoch = _check_samples(samples_per_epoch)
        self.sources = [s if isinstance(s, ShardStream) else ShardStream(s) for s in sources]
        for i, source in enumerate(self.sources):
            if source.batch_size is not None:
                raise ValueError(f"source {i} has a batch_size: give it to the mixture instead")
            if source.total == 0 and self.weights[i] > 0:
                raise ValueError(f"source {i} ({source.source}) has no samples but weight > 0")
        self.batch_size, self.drop_last, self.seed = batch_size, drop_last, seed
        self.batching = batching
        self.output: Output = output or NumpyOutput()
        totals = [s.total for s in self.sources]
        self.samples_per_epoch = _check_samples(
            sum(totals) if samples_per_epoch is None else samples_per_epoch
        )

    # --- counts ------------------------------------------------------------------------

    def counts(self, world_size: int) -> list[int]:
        """Samples of each source every rank streams per epoch (``m_i``)."""
        return source_counts(self.samples_per_epoch, self.weights, world_size)

    def epoch_counts(self, world_size: int) -> list[int]:
        """Samples of each source the whole epoch holds (``W * m_i``), ``drop_last`` aside."""
        return [world_size * m for m in self.counts(world_size)]

    def samples_per_rank(self, world_size: int) -> int:
        """Samples every rank receives per epoch (before ``drop_last``)."""
        return sum(self.counts(world_size))

    def plan(self, epoch: int, world_size: int) -> MixedPlan | PerSourcePlan:
        """A rank's batch plan of ``epoch`` (the same on every rank), computed batch by batch.

        ``list(plan)`` gives one row of per-source counts per batch (for small epochs).
        """
        make = mixed_batches if self.batching == "mixed" else per_source_batches
        return make(self.counts(world_size), self.batch_size, self.drop_last, self.seed, epoch)

    def batches_per_rank(self, world_size: int) -> int:
        """Batches every rank yields per epoch."""
        return len(self.plan(0, world_size))  # the same number every epoch

    def items_per_slot(
        self, world_size: int, num_workers: int, history: Sequence[Pass] = (), epoch: int = 0
    ) -> list[int]:
        """Batches each worker slot yields per epoch (slot ``w`` makes ``w, w + K, ...``)."""
        _refuse_elastic(history)
        batches = self.batches_per_rank(world_size)
        return [len(range(w, batches, num_workers)) for w in range(num_workers)]

    # --- iteration ----------------------------------------------------------------------

    def iterate(
        self,
        epoch: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        worker: int = 0,
        num_workers: int = 1,
        start: int = 0,
    ) -> Iterator[Any]:
        """Batches of worker ``worker`` of rank ``rank`` in ``epoch``, after its first ``start``."""
        if epoch < 0 or start < 0:
            raise ValueError(f"epoch and start must be non-negative, not {epoch}, {start}")
        return self.items(epoch, World(rank, world_size, worker, num_workers), start)

    def items(
        self, epoch: int, world: World, skip: int, history: Sequence[Pass] = ()
    ) -> Iterator[Any]:
        """Slot ``world.worker``'s batches of ``epoch`` after its first ``skip`` ones.

        Each source is read as ``ShardStream`` reads (``_SourceReads``): its reader, its
        read-ahead and cache for a remote output, its error policy. A mixture's shuffle window
        is its batch: the batch's samples, read in plan order, are emitted in a seeded order.
        """
        _refuse_elastic(history)
        plan = self.plan(epoch, world.world_size)
        counts = self.counts(world.world_size)
        first = world.worker + skip * world.num_workers
        reads = [
            _SourceReads(
                source,
                i,
                _SourceCursor(source, epoch, world.world_size * m, world.rank * m),
                plan,
                world.num_workers,
                self.output.image,
            )
            for i, (source, m) in enumerate(zip(self.sources, counts, strict=True))
        ]
        try:
            for j, row, starts in plan.batches(first, world.num_workers):
                samples: list[Any] = []
                for i, take in enumerate(row):
                    if take:
                        samples.extend(reads[i].batch(j, starts[i], take))
                if not samples:
                    raise _all_skipped(j, reads)
                order = derive_rng(self.seed, "mix-shuffle", epoch, world.rank, j).permutation(
                    len(samples)
                )
                position = {"epoch": epoch, "batch": j, "num_workers": world.num_workers}
                yield self.output.collate([samples[k] for k in order], position)
        finally:
            for source_reads in reads:
                source_reads.close()

    # --- resume -------------------------------------------------------------------------

    def options_fingerprint(self, world_size: int, num_workers: int) -> dict[str, Any]:
        """The options a resume state must share with this run (they fix the order)."""
        return {
            "version": STATE_VERSION,
            "mix_plan": MIX_PLAN_VERSION,
            "sources": [
                {k: v for k, v in s.options_fingerprint(0, 0).items() if k not in _PER_RUN}
                for s in self.sources
            ],
            "weights": self.weights,
            "samples_per_epoch": self.samples_per_epoch,
            "batching": self.batching,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "world_size": world_size,
            "num_workers": num_workers,
        }


_PER_RUN = ("version", "world_size", "num_workers", "batch_size", "drop_last", "uneven")


def _check_weights(weights: Sequence[float]) -> list[float]:
    """The weights as floats.

    Raises:
        ValueError: one is negative, infinite or not a number (named), or all are zero.
    """
    values = []
    for i, weight in enumerate(weights):
        try:
            value = float(weight)
        except (TypeError, ValueError):
            value = math.nan
        if isinstance(weight, bool) or not math.isfinite(value) or value < 0:
            raise ValueError(
                f"weight {i} of the mixture is {weight!r}: every weight must be a finite, "
                f"non-negative number (weights {list(weights)})"
            )
        values.append(value)
    if not sum(values) > 0:
        raise ValueError(f"the weights {list(weights)} are all zero: give a source a positive one")
    if not math.isfinite(sum(values)):
        raise ValueError(f"the weights {list(weights)} add up past float64: scale them down")
    return values


def _check_samples(value: object) -> int:
    """``samples_per_epoch`` as an int.

    Raises:
        ValueError: not a whole number, negative or past ``MAX_SAMPLES_PER_EPOCH``.
    """
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"samples_per_epoch must be a whole number, not {value!r}")
    if not 0 <= value <= MAX_SAMPLES_PER_EPOCH:
        raise ValueError(
            f"samples_per_epoch must be between 0 and 2**53 = {MAX_SAMPLES_PER_EPOCH} (the "
            f"mixture's counts are float64 arithmetic, exact up to there), not {value}"
        )
    return int(value)


def _refuse_elastic(history: Sequence[Pass]) -> None:
    if history:
        raise IncompatibleStateError(
            "a mixture resumes at the world size and num_workers it was saved at only (elastic "
            "resume is for a single ShardDataset): resume with the same world",
            field="world_size",
        )


class _SourceCursor:
    """Where a rank's positions of one source lie: (lap, range) pieces, one lap's order cached."""

    def __init__(self, source: ShardStream, epoch: int, per_epoch: int, offset: int) -> None:
        self._source, self._epoch = source, epoch
        self._per_epoch, self._offset = per_epoch, offset  # the epoch's count; the rank's first
        self._lap: int | None = None
        self._order: list[SampleRange] = []
        self._ends: list[int] = []  # the lap's position after each block

    def copy(self) -> _SourceCursor:
        """The same positions with a cache of their own (for a walk ahead of the reads)."""
        return _SourceCursor(self._source, self._epoch, self._per_epoch, self._offset)

    def pieces(self, begin: int, stop: int) -> Iterator[tuple[int, SampleRange]]:
        """Positions ``[begin, stop)`` of the rank's sequence of this source, as (lap, range)."""
        for lap, lo, hi in lap_ranges(
            self._source.total, self._per_epoch, self._epoch, self._offset + begin,
            self._offset + stop,
        ):  # fmt: skip
            yield from ((lap, piece) for piece in self._slice(lap, lo, hi))

    def _slice(self, lap: int, lo: int, hi: int) -> Iterator[SampleRange]:
        """Positions ``[lo, hi)`` of lap ``lap``'s block order."""
        if lap != self._lap:
            self._order = self._source.order(lap)
            self._ends = list(accumulate(len(block) for block in self._order))
            self._lap = lap
        b = bisect_right(self._ends, lo)  # the block holding position lo
        while lo < hi:
            block = self._order[b]
            first = block.start + lo - (self._ends[b] - len(block))
            take = min(block.stop - first, hi - lo)
            if take > 0:
                yield SampleRange(block.shard, first, first + take)
                lo += take
            b += 1


class _SourceReads:
    """One source's samples for one worker slot, read through the ``ShardStream`` stages.

    The slot's pieces of the source (its batches' positions, in the order they are consumed)
    are read whole, in order, by ``ShardStream.reader`` with the ``piece_plan`` of those same
    pieces: a remote source's reads are fetched ahead (and through its cache), the plan drawn
    lazily from the batch plan (``O(sources)`` memory, no list of the epoch). One reader per
    lap when the source has class weights (each lap draws its own), else one for all laps.
    Unreadable samples follow the source's ``ReadOptions.on_error``: raised, or skipped with
    a warning, the batch then short by them (``piece_samples``).
    """

    def __init__(
        self,
        source: ShardStream,
        number: int,
        positions: _SourceCursor,
        plan: MixedPlan | PerSourcePlan,
        step: int,
        image: Any,
    ) -> None:
        self._source, self._number, self._positions = source, number, positions
        self._plan, self._step = plan, step
        self._decode = make_decoder(source.decode, source.allow_pickle, image)
        self._policy = ErrorPolicy(source.read.on_error, source.read.max_consecutive_errors)
        self._reader: ShardReader | None = None
        self._reader_lap: int | None = None

    def batch(self, j: int, start: int, take: int) -> list[dict[str, Any]]:
        """The samples of batch ``j``: positions ``[start, start + take)`` (fewer if skipped)."""
        note = f" (mixture source {self._number}: batch {j} comes out short by them)"
        samples: list[dict[str, Any]] = []
        transform = self._source.transform
        for lap, piece in self._positions.pieces(start, start + take):
            for sample in piece_samples([piece], self._reader_of(lap, j), self._policy, note):
                sample[SOURCE] = self._number
                if self._decode is not None:
                    sample = self._decode(sample)
                samples.append(sample if transform is None else transform(sample))
        return samples

    def _reader_of(self, lap: int, j: int) -> ShardReader:
        """The reader of ``lap``'s pieces (made at batch ``j``, with its read plan from there)."""
        lap = lap if self._source.class_weights is not None else 0  # one draw for every lap
        if self._reader is None or lap != self._reader_lap:
            self.close()
            walk = partial(self._walk, j, lap)
            self._reader, self._reader_lap = self._source.reader(lap, plan=piece_plan(walk)), lap
        return self._reader

    def _walk(self, j: int, lap: int) -> Iterator[SampleRange]:
        """The pieces ``batch`` will read with ``lap``'s reader, from batch ``j`` on, in order."""
        positions, i = self._positions.copy(), self._number
        weighted = self._source.class_weights is not None
        pieces: Iterator[tuple[int, SampleRange]] = (
            (at, piece)
            for _, row, starts in self._plan.batches(j, self._step)
            if row[i]
            for at, piece in positions.pieces(starts[i], starts[i] + row[i])
        )
        if weighted:  # laps only grow along the slot's batches: this lap's pieces, then stop
            pieces = takewhile(lambda p: p[0] == lap, dropwhile(lambda p: p[0] < lap, pieces))
        return (piece for _, piece in pieces)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    @property
    def last_error(self) -> CorruptShardError | None:
        return self._policy.last_error


def _all_skipped(j: int, reads: Sequence[_SourceReads]) -> CorruptShardError:
    """The error when every sample of batch ``j`` was unreadable and skipped."""
    err = next((r.last_error for r in reads if r.last_error is not None), None)
    if err is None:
        return CorruptShardError(f"mixture batch {j} has no sample")
    reason = f"every sample of mixture batch {j} is unreadable and skipped (last: {err.reason})"
    return CorruptShardError.at(err.shard, err.key, err.offset, reason)
