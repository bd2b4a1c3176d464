"""Core: a shardprep output as a stream of samples or NumPy batches for one (rank, worker). No torch.

``ShardStream`` holds everything that decides *what* a rank and worker read
(the epoch order, the partition, reading, window shuffling, class weights and
resume arithmetic) and nothing that depends on a framework: the rank, the
world size, the worker and the epoch are explicit arguments, as in
``tf.data.Dataset.shard(num_shards, index)``. It imports neither torch nor
anything that does, so JAX, TensorFlow and NumPy users can use it as is::

    from loader.core import ShardStream

    stream = ShardStream("OUT", batch_size=64, seed=0)
    for batch in stream.iterate(epoch, rank=r, world_size=w):   # dicts of NumPy arrays
        ...

``loader.ShardDataset`` is the torch layer over it: it resolves the rank from
``torch.distributed`` and the worker from the DataLoader, counts epochs in
shared memory, and assembles batches as torch tensors; the samples are the
ones ``ShardStream.iterate`` gives for the same (epoch, rank, world size,
worker, number of workers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from itertools import count, islice
from time import perf_counter_ns
from typing import Any

import numpy as np
import numpy.typing as npt

from loader.io.executor import Executor
from loader.io.files import THREAD_NAME, large_samples, leaves_unread
from loader.io.ranges import BufferPool
from loader.io.readahead import read_ahead
from loader.io.source import Source
from loader.options import ReadOptions
from loader.plan.elastic import Pass, batches_consumed, pass_rest, pass_share, window_key
from loader.plan.order import SampleRange, epoch_order
from loader.plan.partition import (
    Uneven,
    batch_slot_counts,
    batches_per_rank,
    samples_per_rank,
    slice_order,
    slot_counts,
)
from loader.plan.reads import ReadPlan, window_plan
from loader.plan.reweight import Reweighting
from loader.plan.state import STATE_VERSION
from loader.plan.world import World
from loader.read.decode import make_decoder
from loader.read.output import NumpyOutput, Output
from loader.read.reader import ShardReader, checked_indexes
from loader.read.samples import ErrorPolicy, sample_stream, shuffled_windows
from loader.read.telemetry import (
    ASSEMBLE,
    BATCHES,
    CHECKSUMS,
    DECODE,
    PLAN,
    READ,
    SAMPLES,
    STAGE0,
    Clock,
    EpochStats,
)
from shardprep.format.manifest import Manifest
from shardprep.format.shardformat import KEY_FIELD, ShardIndex
from shardprep.format.versions import read_version

__all__ = ["ShardStream"]


class ShardStream:
    """The samples of a shardprep output for any (epoch, rank, world size, worker, workers).

    Arguments are those of ``loader.ShardDataset`` (see there) less the rank
    and world size, which ``iterate`` takes explicitly. With ``batch_size``,
    ``iterate`` yields batches: dicts of NumPy arrays (``loader.read.npbatch``);
    otherwise sample dicts (``{ext: bytes}`` plus ``__key__``, or decoded values).
    ``output`` (``loader.read.output``) changes the array type: the torch layer
    gives one that makes torch batches and image tensors.

    The order is a pure function of (manifest, seed, epoch, world size,
    workers, batch size): every process computing a share of the same epoch
    agrees on the whole split without talking to the others.
    """

    elastic = (
        True  # a state saved at another world size or num_workers resumes (loader.plan.elastic)
    )

    def __init__(
        self,
        path: str,
        *,
        batch_size: int | None = None,
        drop_last: bool = False,
        seed: int = 0,
        shuffle: bool = True,
        uneven: str = "drop",
        decode: bool | Mapping[str, Callable[[bytes], Any]] = False,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        shuffle_buffer: int = 8192,
        shuffle_buffer_bytes: int = 16 << 20,
        block_size: int = 1024,
        allow_pickle: bool = False,
        read: ReadOptions | None = None,
        class_weights: str | None = None,
        resample: bool = True,
        output: Output | None = None,
        version: int | None = None,
    ) -> None:
        if seed < 0:
            raise ValueError(f"seed must be non-negative, not {seed}")
        if min(shuffle_buffer, shuffle_buffer_bytes, block_size) < 1:
            raise ValueError("shuffle_buffer, shuffle_buffer_bytes and block_size must be positive")
        if batch_size is not None and (isinstance(batch_size, bool) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive int or None, not {batch_size!r}")
        if drop_last and batch_size is None:
            raise ValueError("drop_last needs a batch_size")
        self.read = read or ReadOptions()
        self.output: Output = output or NumpyOutput()
        self.source = Source(path, self.read.remote)
        self.manifest = self._version(path, version)
        self.batch_size, self.drop_last = batch_size, drop_last
        self.seed, self.shuffle, self.uneven = seed, shuffle, Uneven(uneven)
        self.decode, self.transform, self.allow_pickle = decode, transform, allow_pickle
        self.shuffle_buffer, self.shuffle_buffer_bytes = shuffle_buffer, shuffle_buffer_bytes
        self.block_size = block_size
        self.class_weights, self.resample = class_weights, resample
        self._sizes = [s.num_samples for s in self.manifest.shards]
        # read and checked here, before a DataLoader forks its workers: they inherit them
        self._indexes = checked_indexes(self.source, self.manifest)
        self._reweighting: Reweighting | None = None
        if class_weights is not None:
            if self.manifest.class_names is None:
                raise ValueError("class_weights needs a labelled dataset; this one has no classes")
            self._reweighting = Reweighting(
                class_weights,
                self.manifest.class_names,
                [s.class_counts for s in self.manifest.shards],
            )
            if resample:
                self._sizes = self._reweighting.shard_sizes()
        self._total = sum(self._sizes)
        # where this process's passes count their time (loader.read.telemetry); the torch
        # layer gives each pass a row of the dataset's shared counters instead
        self.clock = Clock()

    def _version(self, path: str, version: int | None) -> Manifest:
        """The manifest of version ``version`` of the build at ``path`` (None: the newest),
        checked against the sha256 the newest records (shardprep.format.versions)."""
        newest = self.source.manifest()
        return read_version(newest, version, partial(self.source.read_bytes, setup=True), path)

    # --- counts -----------------------------------------------------------------------

    @property
    def total(self) -> int:
        """Samples in one epoch of the whole dataset (after class-weight resampling)."""
        return self._total

    def samples_per_rank(self, world_size: int) -> int:
        """Samples every rank receives per epoch (before a ``drop_last`` of its last batch).

        Raises:
            WorldMismatchError: ``uneven="drop"`` with fewer samples than ranks.
        """
        return samples_per_rank(self._total, world_size, self.uneven)

    def batches_per_rank(self, world_size: int) -> int:
        """Batches every rank yields per epoch (needs ``batch_size``)."""
        if self.batch_size is None:
            raise TypeError("batches_per_rank needs a batch_size")
        return batches_per_rank(self.samples_per_rank(world_size), self.batch_size, self.drop_last)

    def slot_samples(
        self, world_size: int, num_workers: int, history: Sequence[Pass] = (), epoch: int = 0
    ) -> list[int]:
        """Samples of each worker slot in a pass: whole batches per slot with a batch size.

        ``history`` lists the earlier passes of ``epoch`` (elastic resume,
        ``loader.plan.elastic``); empty for a normal epoch, whose counts are the same
        for every epoch. With a history, the rest is computed from the shard
        indexes (they are read).
        """
        if history:
            reader = self.reader(epoch)
            try:
                size = sum(len(r) for r in self._sequence(epoch, history, reader))
            finally:
                reader.close()
            per_rank = pass_share(size, world_size, self.uneven)
        else:
            per_rank = self.samples_per_rank(world_size)
        return self._split(per_rank, num_workers)

    def _split(self, per_rank: int, num_workers: int) -> list[int]:
        if self.batch_size is None:
            return slot_counts(per_rank, num_workers)
        return batch_slot_counts(per_rank, num_workers, self.batch_size, self.drop_last)

    def items_per_slot(
        self, world_size: int, num_workers: int, history: Sequence[Pass] = (), epoch: int = 0
    ) -> list[int]:
        """Items (batches, or samples without a batch size) each worker slot yields in a pass."""
        counts = self.slot_samples(world_size, num_workers, history, epoch)
        if self.batch_size is None:
            return counts
        return [-(-c // self.batch_size) for c in counts]

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
        """The items of worker ``worker`` (of ``num_workers``) of rank ``rank`` in ``epoch``.

        ``start`` skips that many items (batches, or samples) of this worker's
        share, e.g. to resume: whole consumed windows are not read again.
        Run one iterator per (rank, worker); together they yield the epoch.
        """
        if epoch < 0 or start < 0:
            raise ValueError(f"epoch and start must be non-negative, not {epoch}, {start}")
        return self.items(epoch, World(rank, world_size, worker, num_workers), start)

    def items(
        self, epoch: int, world: World, skip: int, history: Sequence[Pass] = ()
    ) -> Iterator[Any]:
        """Worker slot ``world.worker``'s items of ``epoch`` after its first ``skip`` ones.

        With a ``history`` of earlier passes (elastic resume), the pass streams
        the rest those passes left, re-split over ``world``. A URL's requests, bytes and
        waits in the pass are counted when it ends (``loader.read.telemetry``).
        """
        clock = self.clock
        remote = self.source.remote  # (a local output has no requests to count)
        before = self.source.io_counts() if remote else {}
        yield from self._pass(epoch, world, skip, history)
        if remote:  # (not in a finally: a pass left mid-way has no epoch count)
            clock.io_since(before, self.source.io_counts())

    def _pass(self, epoch: int, world: World, skip: int, history: Sequence[Pass]) -> Iterator[Any]:
        clock = self.clock
        began = perf_counter_ns()
        clock.start(epoch)
        batch = self.batch_size
        decoder = make_decoder(self.decode, self.allow_pickle, self.output.image)
        policy = ErrorPolicy(self.read.on_error, self.read.max_consecutive_errors)
        # batches gathered straight from the windows, with no per-sample dict (the torch layer)
        gather = (
            batch is not None
            and self.output.gathers
            and decoder is None
            and self.transform is None
            and not policy.skip
        )
        # → this (rank, slot)'s sample ranges: whole batches per slot, equal on every rank
        pieces = self._pieces(epoch, world, history)
        rng_key = window_key(self.seed, epoch, world.rank, world.worker, len(history))
        skipped = skip if batch is None else skip * batch
        # → a reader of the windows' reads, performed ahead in the same order (remote: fetched
        # and cached; local large samples: the next window); windows are read into reused
        # buffers (sample dicts hold copies); alone in its process, the reader shares its
        # local reads with one more thread
        plan = window_plan(pieces, skipped, self.shuffle_buffer, self.shuffle_buffer_bytes)
        alone = world.num_workers == 1
        reader = self.reader(
            epoch, BufferPool(), plan, True, unread=gather, alone=alone, clock=clock
        )
        clock.add(PLAN, perf_counter_ns() - began)
        try:
            # → windows read in turn, each emitted in a seeded order
            windows = shuffled_windows(
                pieces,
                reader,
                shuffle=self.shuffle,
                rng_key=rng_key,
                skip=skipped,
                max_samples=self.shuffle_buffer,
                max_bytes=self.shuffle_buffer_bytes,
                policy=policy,
            )
            # this slot's j-th batch is the rank's batch j * num_workers + slot
            position: dict[str, Any] = {"epoch": epoch, "num_workers": world.num_workers}
            if history:
                position["history"] = [list(p) for p in history]
            positions = (
                {**position, "batch": j * world.num_workers + world.worker} for j in count(skip)
            )
            if gather:
                # → whole batches, gathered from the windows' buffers
                gathered = self.output.gather(windows, batch, positions)  # type: ignore[arg-type]
                yield from _timed_gather(gathered, clock)
                return
            # → raw samples, one dict each
            samples = sample_stream(windows, policy)
            if batch is None:
                yield from _single(samples, decoder, self.transform, clock)
                return
            # → whole batches: each one's samples (read, checked), decoded and transformed, then
            # collated, the time of each step counted once per batch (loader.read.telemetry)
            transform = self.transform
            for at in positions:
                asked = perf_counter_ns()
                read = clock.elapsed(READ)
                chunk = list(islice(samples, batch))
                if not chunk:
                    return
                cut = perf_counter_ns()
                clock.add(CHECKSUMS, cut - asked - (clock.elapsed(READ) - read))
                if decoder is not None:
                    chunk = [decoder(s) for s in chunk]
                if transform is not None:
                    chunk = [transform(s) for s in chunk]
                decoded = perf_counter_ns()
                clock.add(DECODE, decoded - cut)
                made = self.output.collate(chunk, at)
                clock.add(ASSEMBLE, perf_counter_ns() - decoded)
                clock.batch(len(chunk))
                yield made
        finally:
            reader.close()

    def _pieces(self, epoch: int, world: World, history: Sequence[Pass]) -> list[SampleRange]:
        """This (rank, slot)'s ranges of the pass's sequence, in stream order.

        With a ``history`` the sequence needs sample sizes: a reader of its own reads the
        indexes (the stream's reader is made after, with the read plan of these pieces).
        """
        if history:
            reader = self.reader(epoch)
            try:
                sequence = self._sequence(epoch, history, reader)
            finally:
                reader.close()
        else:
            sequence = self.order(epoch)
        size = sum(len(r) for r in sequence)
        if history:
            per_rank = pass_share(size, world.world_size, self.uneven)
        else:
            per_rank = self.samples_per_rank(world.world_size)
        counts = self._split(per_rank, world.num_workers)
        begin = world.rank * per_rank + sum(counts[: world.worker])
        return slice_order(sequence, size, begin, begin + counts[world.worker])

    def order(self, epoch: int) -> list[SampleRange]:
        """The epoch's block order over all samples, identical on every rank and worker."""
        return epoch_order(self._sizes, self.seed, epoch, self.shuffle, self.block_size)

    def _sequence(
        self, epoch: int, history: Sequence[Pass], reader: ShardReader
    ) -> list[SampleRange]:
        """The sequence a pass splits: the epoch order, or what the ``history`` passes left."""
        sequence = self.order(epoch)  # → the epoch's block order
        for number, done in enumerate(history):  # → the rest of each earlier pass, in turn
            if self.batch_size is None:
                raise ValueError("an elastic resume needs a batch_size (passes count batches)")
            per_rank = pass_share(sum(len(r) for r in sequence), done.world_size, self.uneven)
            counts = self._split(per_rank, done.num_workers)
            consumed = batches_consumed(counts, self.batch_size, done.num_workers, done.batches)
            sequence = pass_rest(
                sequence,
                per_rank,
                counts,
                [consumed] * done.world_size,
                reader.sample_sizes,
                shuffle=self.shuffle,
                key=partial(_pass_key, self.seed, epoch, number),
                max_samples=self.shuffle_buffer,
                max_bytes=self.shuffle_buffer_bytes,
            )
        return sequence

    def reader(
        self,
        epoch: int,
        pool: BufferPool | None = None,
        plan: ReadPlan | None = None,
        local_ahead: bool = False,
        unread: bool = False,
        alone: bool = False,
        clock: Clock | None = None,
    ) -> ShardReader:
        """A reader of this output with ``epoch``'s class-weight draw (close it after use).

        With a ``plan`` of what it will read, a remote output's reads are performed ahead (and
        through the cache) in that order (``loader.io.readahead``); with ``local_ahead`` too, a
        local output of large samples is read one window ahead on one thread, the same way.
        ``unread``: batches read their own large samples from a local output
        (``loader.torch.scatter``) instead. ``alone``: the reader is alone in its process (in
        process, or a DataLoader's only worker): its local reads are shared with one more
        thread. All of a reader's threads belong to one executor, closed with the reader.
        ``clock``: where its reads' time is counted (``loader.read.telemetry``).
        """
        read = self.read
        unread = unread and leaves_unread(self.source, self.manifest, read.checksums, read.mapped)
        ahead = local_ahead and not unread and not read.mapped and large_samples(self.manifest)
        executor = None
        if not self.source.remote and (alone or ahead):
            executor = Executor(1, THREAD_NAME)
        io = None
        if plan is not None:
            window = self.shuffle_buffer_bytes if ahead else 0
            io = read_ahead(self.source, self.manifest, plan, window, executor)
        return ShardReader(
            self.source,
            self.manifest,
            read=self.read,
            expand=self._expander(epoch),
            pool=pool,
            io=io,
            unread=unread,
            shared=self._indexes,
            split=executor if alone else None,
            executor=executor,
            clock=clock,
        )

    def _expander(
        self, epoch: int
    ) -> Callable[[int, ShardIndex], tuple[npt.NDArray[np.int64], list[float] | None]] | None:
        """How a shard's samples are repeated, dropped or weighted this epoch (class_weights)."""
        reweighting = self._reweighting
        if reweighting is None:
            return None
        if not self.resample:

            def weigh(
                shard: int, index: ShardIndex
            ) -> tuple[npt.NDArray[np.int64], list[float] | None]:
                weights = reweighting.class_weight[np.maximum(index.label, 0)].tolist()
                return np.arange(index.num_samples, dtype=np.int64), weights

            return weigh

        def draw(shard: int, index: ShardIndex) -> tuple[npt.NDArray[np.int64], list[float] | None]:
            return reweighting.sample_ids(index.label, shard, self.seed, epoch), None

        return draw

    def epoch_stats(self) -> EpochStats:
        """Where this process's latest pass spent its time (``loader.read.telemetry``): counts
        and seconds by stage of the last ``iterate``/``items`` run here."""
        return self.clock.stats()

    # --- resume -------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # a spawned DataLoader worker reads its own indexes: pickled, they would cross once
        # per worker in full (a forked one inherits them)
        return {**self.__dict__, "_indexes": {}, "clock": Clock()}

    def options_fingerprint(self, world_size: int, num_workers: int) -> dict[str, Any]:
        """The options a resume state must share with this run (they fix the order)."""
        return {
            "version": STATE_VERSION,
            "manifest": self.manifest.fingerprint,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "uneven": self.uneven.value,
            "block_size": self.block_size,
            "shuffle_buffer": self.shuffle_buffer,
            "shuffle_buffer_bytes": self.shuffle_buffer_bytes,
            "class_weights": None
            if self.class_weights is None
            else f"{self.class_weights} resample={self.resample}",
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "world_size": world_size,
            "num_workers": num_workers,
        }


def _pass_key(seed: int, epoch: int, number: int, rank: int, worker: int) -> tuple[int, ...]:
    return window_key(seed, epoch, rank, worker, number)


def _timed_gather(batches: Iterator[Any], clock: Clock) -> Iterator[Any]:
    """``batches`` (gathered: ``Output.gather``) with each one's time counted as ``assemble``,
    less the reads it waited for (``read``); the counts inline (once per batch)."""
    cells, at_read, at_assemble = clock.cells, STAGE0 + READ, STAGE0 + ASSEMBLE
    asked, read = perf_counter_ns(), cells[at_read]
    for made in batches:
        cells[at_assemble] += perf_counter_ns() - asked - (cells[at_read] - read)
        cells[SAMPLES] += len(made[KEY_FIELD])
        cells[BATCHES] += 1
        yield made
        asked, read = perf_counter_ns(), cells[at_read]


def _single(
    samples: Iterator[dict[str, Any]],
    decoder: Callable[[dict[str, Any]], dict[str, Any]] | None,
    transform: Callable[[dict[str, Any]], Any] | None,
    clock: Clock,
) -> Iterator[Any]:
    """Single samples (no batch size), decoded and transformed; counted when the pass ends or
    is left (no time per sample: with no batch, only ``plan`` and ``read`` are timed)."""
    if decoder is not None:
        samples = map(decoder, samples)
    items: Iterator[Any] = samples if transform is None else map(transform, samples)
    # the row's cells and indexes held here: the finally may run at interpreter exit (a script
    # that ends mid-epoch), when this module's globals are already gone
    cells, at_samples, at_batches = clock.cells, SAMPLES, BATCHES
    handed = 0
    try:
        for item in items:
            handed += 1
            yield item
    finally:
        cells[at_samples] += handed
        cells[at_batches] += handed
