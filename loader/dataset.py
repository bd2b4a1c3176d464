"""ShardDataset: a torch IterableDataset over a shardprep output, exact per rank and resumable.

Composes the loader's stages; each line of ``items`` is one stage. The object
is small and picklable: it reads the manifest (and nothing else) in
``__init__``, opens shard files lazily inside each DataLoader worker, and
resolves its rank when an epoch starts (``loader.world``), never earlier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from itertools import count, islice
from typing import Any

import numpy as np
import numpy.typing as npt
import torch.utils.data

from loader.batch import POSITION, collate_samples
from loader.decode import make_decoder
from loader.epochs import ResumePoint, SharedProgress
from loader.errors import IncompatibleStateError
from loader.guards import check_not_resplit
from loader.options import ReadOptions
from loader.order import epoch_order
from loader.partition import (
    Uneven,
    batch_slot_counts,
    batches_per_rank,
    partition,
    samples_per_rank,
    slot_counts,
)
from loader.prefetch import attach_read_ahead
from loader.read import ShardReader
from loader.reweight import Reweighting
from loader.shuffle import ErrorPolicy, windowed_stream
from loader.source import Source
from loader.state import STATE_VERSION, check_state
from loader.stream import EpochStream
from loader.world import World, resolve_rank, worker_info
from shardprep.shardformat import ShardIndex

__all__ = ["ShardDataset"]


class ShardDataset(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Stream the samples of a shardprep output to one DDP rank and its DataLoader workers.

    With ``batch_size=B`` the dataset yields whole batches (``loader.batch.Batch``
    dicts) and the DataLoader is made with ``batch_size=None``::

        ds = ShardDataset("OUT", batch_size=64)
        loader = DataLoader(ds, batch_size=None, num_workers=4)   # or StatefulDataLoader

    Then ``len(loader) == len(ds)`` is exactly the number of batches every
    rank receives per epoch, for any shard count, world size, ``num_workers``
    and ``drop_last``; only the epoch's last batch can be partial. Without a
    batch size the dataset yields single samples and has no ``len()`` (a
    DataLoader batching them with several workers would make up to
    ``num_workers - 1`` more batches than ``ceil(len / B)``); ``num_samples``
    is the per-rank sample count either way.

    The order is a pure function of (manifest, seed, epoch, world size,
    workers, batch size). Each new iteration streams the next epoch by
    itself; ``set_epoch(e)`` picks one explicitly (the latest call wins).

    Args:
        path: the output folder (or a URL, read through fsspec).
        batch_size: yield batches of this many samples (see above).
        drop_last: with ``batch_size``, leave out each rank's last partial batch.
        seed: seeds every random choice; fixed default, never random.
        shuffle: permute blocks of samples each epoch and shuffle inside a
            bounded window; ``False`` streams shards in order.
        uneven: ``"drop"`` leaves out fewer than ``world_size`` samples per
            epoch; ``"pad"`` repeats samples to fill, flagged ``__padded__``.
        rank, world_size: override ``torch.distributed`` (pass both or neither).
        decode: ``False`` yields raw bytes; ``True`` decodes common extensions
            (``.cls`` to int, ``.npy`` to arrays, images to uint8 CHW tensors);
            a mapping ``{ext: fn}`` adds or replaces decoders.
        transform: applied to each (decoded) sample dict; with ``batch_size``
            it must return a dict.
        shuffle_buffer, shuffle_buffer_bytes: the shuffle window's bounds, in
            samples and bytes; also the worker's memory bound.
        block_size: samples per block of the epoch order.
        allow_pickle: allow decoding pickle/torch members (runs code from the shard).
        read: checksums, whole-shard verification, what an unreadable sample
            does (``on_error="skip"``), remote timeouts: a ``ReadOptions``
            (default ``ReadOptions()``: checksums on, errors raise).
        class_weights: reweight classes at read time (``"balanced"``, ``"sqrt"``,
            a JSON file or ``"cat=2,dog=1"``). With ``resample=True`` each epoch
            draws a seeded multiset with those class proportions (same total);
            with ``resample=False`` the data is unchanged and every sample
            carries ``"__weight__"`` (target share / actual share of its class).
    """

    def __init__(
        self,
        path: str,
        *,
        batch_size: int | None = None,
        drop_last: bool = False,
        seed: int = 0,
        shuffle: bool = True,
        uneven: str = "drop",
        rank: int | None = None,
        world_size: int | None = None,
        decode: bool | Mapping[str, Callable[[bytes], Any]] = False,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        shuffle_buffer: int = 8192,
        shuffle_buffer_bytes: int = 16 << 20,
        block_size: int = 1024,
        allow_pickle: bool = False,
        read: ReadOptions | None = None,
        class_weights: str | None = None,
        resample: bool = True,
    ) -> None:
        super().__init__()
        if seed < 0:
            raise ValueError(f"seed must be non-negative, not {seed}")
        if min(shuffle_buffer, shuffle_buffer_bytes, block_size) < 1:
            raise ValueError("shuffle_buffer, shuffle_buffer_bytes and block_size must be positive")
        if batch_size is not None and (isinstance(batch_size, bool) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive int or None, not {batch_size!r}")
        if drop_last and batch_size is None:
            raise ValueError("drop_last needs a batch_size")
        self.read = read or ReadOptions()
        self.source = Source(path, self.read.remote)
        self.manifest = self.source.manifest()
        self.batch_size, self.drop_last = batch_size, drop_last
        self.seed, self.shuffle, self.uneven = seed, shuffle, Uneven(uneven)
        if rank is not None or world_size is not None:
            resolve_rank(rank, world_size)  # validates an explicit pair now
        self._rank_override = (rank, world_size)
        self._inherited_rank: tuple[int, int] | None = None
        self.decode, self.transform, self.allow_pickle = decode, transform, allow_pickle
        self.shuffle_buffer, self.shuffle_buffer_bytes = shuffle_buffer, shuffle_buffer_bytes
        self.block_size = block_size
        self.class_weights, self.resample = class_weights, resample
        self._sizes = [s.num_samples for s in self.manifest.shards]
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
        if rank is not None and world_size is not None:
            samples_per_rank(self._total, world_size, self.uneven)  # fails early if impossible
        self.progress = SharedProgress()

    # --- world, epoch and length ----------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank, resolved now (see ``loader.world.resolve_rank``)."""
        return self._world()[0]

    @property
    def world_size(self) -> int:
        """The number of ranks, resolved now."""
        return self._world()[1]

    def _world(self) -> tuple[int, int]:
        return resolve_rank(*self._rank_override, self._inherited_rank)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration streams."""
        return self.progress.next_epoch()

    def set_epoch(self, epoch: int) -> None:
        """Stream ``epoch`` next (as ``DistributedSampler.set_epoch``), in every worker.

        Without calls, each iteration streams the epoch after the previous one.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, not {epoch}")
        self.progress.set_epoch(epoch)

    @property
    def num_samples(self) -> int:
        """Samples every rank receives per epoch (before a ``drop_last`` of its last batch)."""
        return samples_per_rank(self._total, self.world_size, self.uneven)

    def __len__(self) -> int:
        """Batches every rank yields per epoch (needs ``batch_size``).

        Raises:
            TypeError: no ``batch_size``: the number of batches is the
                DataLoader's, which cannot count it exactly with several workers.
        """
        if self.batch_size is None:
            raise TypeError(
                "ShardDataset has no len() without batch_size: a DataLoader that batches single "
                "samples from several workers makes more batches than len() would say. Use "
                "ShardDataset(..., batch_size=B) with DataLoader(ds, batch_size=None), or "
                "ds.num_samples for the per-rank sample count"
            )
        return batches_per_rank(self.num_samples, self.batch_size, self.drop_last)

    # --- iteration ----------------------------------------------------------------

    def __iter__(self) -> EpochStream:
        check_not_resplit()
        info = worker_info()  # None in the main process (num_workers=0)
        worker, num_workers = info or (0, 1)
        rank, world_size = self._world()
        counter = None if info is None else worker
        epoch, explicit = self.progress.claim(counter)
        world = World(rank, world_size, worker, num_workers)
        return EpochStream(self, epoch, world, counter, explicit)

    def _slot_samples(self, world_size: int, num_workers: int) -> list[int]:
        """Samples of each worker slot per epoch: whole batches per slot with a batch size."""
        per_rank = samples_per_rank(self._total, world_size, self.uneven)
        if self.batch_size is None:
            return slot_counts(per_rank, num_workers)
        return batch_slot_counts(per_rank, num_workers, self.batch_size, self.drop_last)

    def items_per_slot(self, world_size: int, num_workers: int) -> list[int]:
        """Items (batches, or samples without a batch size) each worker slot yields per epoch."""
        counts = self._slot_samples(world_size, num_workers)
        if self.batch_size is None:
            return counts
        return [-(-count // self.batch_size) for count in counts]

    def items(self, epoch: int, world: World, skip: int) -> Iterator[Any]:
        """Worker slot ``world.worker``'s items of ``epoch`` after its first ``skip`` ones."""
        batch = self.batch_size
        # → the epoch's block order, identical on every rank and worker
        order = epoch_order(self._sizes, self.seed, epoch, self.shuffle, self.block_size)
        # → this (rank, slot)'s sample ranges: whole batches per slot, equal on every rank
        counts = self._slot_samples(world.world_size, world.num_workers)
        pieces = partition(order, self._total, world, self.uneven, counts)
        reader = ShardReader(
            self.source, self.manifest, self.read.verify, self._expander(epoch), self.read.checksums
        )
        decoder = make_decoder(self.decode, self.allow_pickle)
        skipped = skip if batch is None else skip * batch
        try:
            # → remote outputs: the windows' reads fetched ahead (and cached), in the same order
            attach_read_ahead(
                reader,
                self.source,
                self.manifest,
                pieces,
                skipped,
                self.shuffle_buffer,
                self.shuffle_buffer_bytes,
            )
            # → raw samples, read window by window and shuffled inside each window
            samples = windowed_stream(
                pieces,
                reader,
                shuffle=self.shuffle,
                rng_key=(self.seed, epoch, world.rank, world.worker),
                skip=skipped,
                max_samples=self.shuffle_buffer,
                max_bytes=self.shuffle_buffer_bytes,
                policy=ErrorPolicy(self.read.on_error, self.read.max_consecutive_errors),
            )
            # → decoded and transformed samples
            if decoder is not None:
                samples = map(decoder, samples)
            if self.transform is not None:
                samples = map(self.transform, samples)
            if batch is None:
                yield from samples
                return
            # → whole batches: this slot's j-th is the rank's batch j * num_workers + slot
            for j in count(skip):
                chunk = list(islice(samples, batch))
                if not chunk:
                    return
                number = j * world.num_workers + world.worker
                yield collate_samples(
                    chunk, {"epoch": epoch, "batch": number, "num_workers": world.num_workers}
                )
        finally:
            reader.close()

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

    # --- resume -------------------------------------------------------------------

    def fingerprint(self, num_workers: int) -> dict[str, Any]:
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
            "world_size": self.world_size,
            "num_workers": num_workers,
        }

    def state_after(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The resume state once ``batch`` (one this dataset yielded) has been trained on.

        For a plain ``torch.utils.data.DataLoader``: the position is read off
        the batch itself, so it is right whatever the caller counted. Save
        the small JSON-able dict with the checkpoint (it is the same on every
        rank) and pass it to :meth:`resume`. With torchdata's
        ``StatefulDataLoader`` use its ``state_dict()`` instead.

        Raises:
            TypeError: ``batch`` did not come from a ShardDataset with a batch size.
        """
        position = batch.get(POSITION) if isinstance(batch, Mapping) else None
        if not isinstance(position, Mapping):
            raise TypeError(
                "state_after() needs a batch yielded by ShardDataset(batch_size=...) (it carries "
                f"{POSITION!r}); without a batch size, resume through torchdata's "
                "StatefulDataLoader"
            )
        return {
            **self.fingerprint(int(position["num_workers"])),
            "epoch": int(position["epoch"]),
            "batches": int(position["batch"]) + 1,
        }

    def resume(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_after`'s result: the next pass streams the rest of that epoch.

        Call it before iterating the DataLoader (it reaches persistent workers
        too). The epochs after it follow as usual. A state saved on an epoch's
        last batch makes the next pass the following epoch.

        Raises:
            IncompatibleStateError: the state is from another build, seed,
                option set, batch size or world size; or it is past the epoch's end.
        """
        if not isinstance(state, Mapping) or "num_workers" not in state:
            raise IncompatibleStateError("cannot resume: not a state from ShardDataset.state_after")
        check_state(state, self.fingerprint(state["num_workers"]), ("epoch", "batches"))
        if self.batch_size is None or state["batches"] > len(self):
            raise IncompatibleStateError.field_differs(
                "batches", state["batches"], f"at most {len(self) if self.batch_size else 0}"
            )
        if state["batches"] == len(self):
            self.set_epoch(int(state["epoch"]) + 1)
            return
        self.progress.set_resume(
            ResumePoint(int(state["epoch"]), int(state["batches"]), int(state["num_workers"]))
        )

    # --- pickling (DataLoader workers) -------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        # A spawned or forkserver worker has no process group: hand it the rank resolved here.
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            state["_inherited_rank"] = (dist.get_rank(), dist.get_world_size())
        return state
