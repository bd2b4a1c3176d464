"""Mix: several shardprep outputs streamed as one, in fixed proportions per epoch. No torch.

**Counts.** With weights ``w`` (normalized) and ``N = samples_per_epoch``
(default: the sources' totals added up), source ``i`` is given
``n_i = apportion(N, w)[i]`` samples (largest remainders), and every one of
``W`` ranks streams ``m_i = n_i // W`` of them per epoch: an epoch holds
exactly ``W * m_i`` samples of source ``i`` (the ``n_i % W`` others are not
streamed; ``uneven`` does not apply to mixtures).

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
  batch). Which batches carry the extra samples is a seeded permutation.
  Samples are shuffled inside each batch.
* ``"per_source"``: every batch comes from one source; source ``i`` makes
  ``ceil(m_i / B)`` batches (``floor`` with ``drop_last``; only its last can
  be partial), and the sources' batches are interleaved in proportion
  (largest deficit first, ties in a seeded order): after any number ``t`` of
  batches, source ``i`` has made ``t * b_i / sum(b)`` of them within ±1
  (``b_i`` its batches per epoch).

Every rank streams the same number of samples and batches; batch ``j`` of a
rank is made by worker slot ``j % K`` as in ``ShardDataset``, so resume works
the same way (at the same world size and ``num_workers``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from loader.core import ShardStream
from loader.decode import make_decoder
from loader.elastic import Pass
from loader.errors import IncompatibleStateError
from loader.npbatch import collate_numpy
from loader.order import SampleRange
from loader.partition import slice_order
from loader.read import ShardReader
from loader.state import STATE_VERSION
from loader.world import World
from shardprep.rng import derive_rng
from shardprep.weighting import apportion

__all__ = [
    "BATCHINGS",
    "MixedStream",
    "lap_ranges",
    "mixed_batches",
    "per_source_batches",
    "source_counts",
]

BATCHINGS = ("mixed", "per_source")
SOURCE = "__source__"  # the index of the source a sample came from, in every sample

Collate = Callable[[Sequence[Mapping[str, Any]], dict[str, Any]], Any]


def source_counts(total: int, weights: Sequence[float], world_size: int) -> list[int]:
    """Samples of each source every rank streams per epoch: ``apportion(total, w)[i] // W``."""
    shares = np.asarray(weights, dtype=np.float64)
    shares = shares / shares.sum()
    return [int(n) // world_size for n in apportion(total, shares)]


def lap_ranges(size: int, count: int, epoch: int) -> list[tuple[int, int, int]]:
    """(lap, start, stop) of the ``count`` positions a source of ``size`` gives epoch ``epoch``."""
    if count == 0:
        return []
    if count <= size:
        per_lap = size // count
        start = (epoch % per_lap) * count
        return [(epoch // per_lap, start, start + count)]
    whole, part = divmod(count, size)
    first = epoch * (whole + 1)
    laps = [(first + k, 0, size) for k in range(whole)]
    return laps + ([(first + whole, 0, part)] if part else [])


def mixed_batches(
    counts: Sequence[int], batch_size: int, drop_last: bool, seed: int, epoch: int
) -> list[list[int]]:
    """Samples of each source in each batch of a rank (mixed batches; see the module doc)."""
    total = sum(counts)
    full, rest = divmod(total, batch_size)
    shares = np.asarray(counts, dtype=np.float64) / max(1, total)
    last = [int(v) for v in apportion(rest, shares)] if rest else [0] * len(counts)
    plan: list[list[int]] = []
    if full:
        left = [c - v for c, v in zip(counts, last, strict=True)]
        base = [v // full for v in left]
        plan = [list(base) for _ in range(full)]
        row = 0
        for i, v in enumerate(left):  # the extras, laid out cyclically: one per batch per source
            for _ in range(v % full):
                plan[row % full][i] += 1
                row += 1
        permutation = derive_rng(seed, "mix-batches", epoch).permutation(full)
        plan = [plan[j] for j in permutation]
    if rest and not drop_last:
        plan.append(last)
    return plan


def per_source_batches(
    counts: Sequence[int], batch_size: int, drop_last: bool, seed: int, epoch: int
) -> list[list[int]]:
    """Batches of one source each, interleaved in proportion (see the module doc)."""
    sizes: list[list[int]] = []
    for count in counts:
        full, rest = divmod(count, batch_size)
        sizes.append([batch_size] * full + ([rest] if rest and not drop_last else []))
    # Largest deficit first: batch t goes to the source furthest behind its share of t
    # (exact integers; ties by a seeded order of the sources).
    made = [len(batches) for batches in sizes]
    total = sum(made)
    priority = derive_rng(seed, "mix-sources", epoch).permutation(len(counts)).tolist()
    seen = [0] * len(counts)
    plan: list[list[int]] = []
    for t in range(1, total + 1):
        i = max(
            (i for i in range(len(counts)) if seen[i] < made[i]),
            key=lambda i: (t * made[i] - seen[i] * total, -priority[i]),
        )
        row = [0] * len(counts)
        row[i] = sizes[i][seen[i]]
        seen[i] += 1
        plan.append(row)
    return plan


class MixedStream:
    """Several shardprep outputs as one stream of batches, in proportions fixed per epoch.

    Args:
        sources: output paths, or ``ShardStream`` objects (without a batch
            size) to set a source's own options: ``class_weights``, ``decode``,
            ``transform``, ``seed``, ``shuffle``, ``block_size``, ``read``.
        weights: one non-negative weight per source (normalized here).
        batch_size: samples per batch (mixing always makes batches).
        samples_per_epoch: ``N``; default: the sources' totals added up.
        batching: ``"mixed"`` or ``"per_source"`` (see the module doc).
        drop_last: leave out each rank's last partial batch(es).
        seed: seeds the batch plan and the shuffle inside each batch.
    """

    collate: Collate = staticmethod(collate_numpy)

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
    ) -> None:
        if not sources or len(weights) != len(sources):
            raise ValueError(f"give one weight per source: {len(sources)} sources, {len(weights)}")
        if any(w < 0 for w in weights) or not sum(weights) > 0:
            raise ValueError(f"weights must be non-negative with a positive sum, not {weights}")
        if isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, not {batch_size!r}")
        if batching not in BATCHINGS:
            raise ValueError(f"batching must be one of {BATCHINGS}, not {batching!r}")
        self.sources = [s if isinstance(s, ShardStream) else ShardStream(s) for s in sources]
        for i, source in enumerate(self.sources):
            if source.batch_size is not None:
                raise ValueError(f"source {i} has a batch_size: give it to the mixture instead")
            if source.total == 0 and weights[i] > 0:
                raise ValueError(f"source {i} ({source.source}) has no samples but weight > 0")
        self.weights = [float(w) for w in weights]
        self.batch_size, self.drop_last, self.seed = batch_size, drop_last, seed
        self.batching = batching
        totals = [s.total for s in self.sources]
        self.samples_per_epoch = sum(totals) if samples_per_epoch is None else samples_per_epoch
        if self.samples_per_epoch < 0:
            raise ValueError(f"samples_per_epoch must be non-negative, not {samples_per_epoch}")

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

    def plan(self, epoch: int, world_size: int) -> list[list[int]]:
        """Samples of each source in each batch of a rank's epoch (the same on every rank)."""
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
        """Slot ``world.worker``'s batches of ``epoch`` after its first ``skip`` ones."""
        _refuse_elastic(history)
        plan = self.plan(epoch, world.world_size)
        counts = self.counts(world.world_size)
        offsets = np.zeros((len(plan) + 1, len(counts)), dtype=np.int64)
        if plan:
            np.cumsum(np.asarray(plan, dtype=np.int64), axis=0, out=offsets[1:])
        readers = [_LapReader(s) for s in self.sources]
        decoders = [make_decoder(s.decode, s.allow_pickle) for s in self.sources]
        ranges = [self._rank_ranges(i, epoch, world, count) for i, count in enumerate(counts)]
        try:
            for j in range(world.worker + skip * world.num_workers, len(plan), world.num_workers):
                samples: list[Any] = []
                for i, take in enumerate(plan[j]):
                    if not take:
                        continue
                    begin = int(offsets[j][i])
                    for lap, piece in _slice_laps(ranges[i], begin, begin + take):
                        chunk = readers[i].read(lap, piece)
                        decoder, transform = decoders[i], self.sources[i].transform
                        for k in range(len(chunk)):
                            sample = chunk.sample(k)
                            sample[SOURCE] = i
                            if decoder is not None:
                                sample = decoder(sample)
                            samples.append(sample if transform is None else transform(sample))
                order = derive_rng(self.seed, "mix-shuffle", epoch, world.rank, j).permutation(
                    len(samples)
                )
                position = {"epoch": epoch, "batch": j, "num_workers": world.num_workers}
                yield self.collate([samples[k] for k in order], position)
        finally:
            for reader in readers:
                reader.close()

    def _rank_ranges(
        self, i: int, epoch: int, world: World, count: int
    ) -> list[tuple[int, SampleRange]]:
        """(lap, range) pieces of source ``i`` this rank streams in ``epoch``, in order."""
        source = self.sources[i]
        begin, stop = world.rank * count, (world.rank + 1) * count
        pieces: list[tuple[int, SampleRange]] = []
        position = 0
        for lap, first, last in lap_ranges(source.total, world.world_size * count, epoch):
            lo, hi = max(first, begin - position + first), min(last, stop - position + first)
            if lo < hi:
                order = source.order(lap)
                pieces += [(lap, p) for p in slice_order(order, source.total, lo, hi)]
            position += last - first
            if position >= stop:
                break
        return pieces

    # --- resume -------------------------------------------------------------------------

    def options_fingerprint(self, world_size: int, num_workers: int) -> dict[str, Any]:
        """The options a resume state must share with this run (they fix the order)."""
        return {
            "version": STATE_VERSION,
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


def _refuse_elastic(history: Sequence[Pass]) -> None:
    if history:
        raise IncompatibleStateError(
            "a mixture resumes at the world size and num_workers it was saved at only (elastic "
            "resume is for a single ShardDataset): resume with the same world",
            field="world_size",
        )


def _slice_laps(
    pieces: Sequence[tuple[int, SampleRange]], begin: int, stop: int
) -> Iterator[tuple[int, SampleRange]]:
    """Positions ``[begin, stop)`` of a list of (lap, range) pieces."""
    position = 0
    for lap, piece in pieces:
        size = len(piece)
        lo, hi = max(begin, position), min(stop, position + size)
        if lo < hi:
            first = piece.start + lo - position
            yield lap, SampleRange(piece.shard, first, first + hi - lo)
        position += size
        if position >= stop:
            return


class _LapReader:
    """A source's reader for one lap at a time (class-weight draws differ per lap)."""

    def __init__(self, source: ShardStream) -> None:
        self._source = source
        self._lap: int | None = None
        self._reader: ShardReader | None = None

    def read(self, lap: int, piece: SampleRange) -> Any:
        reweighted = self._source.class_weights is not None
        if self._reader is None or (reweighted and lap != self._lap):
            self.close()
            self._reader, self._lap = self._source.reader(lap), lap
        return self._reader.read(piece)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
