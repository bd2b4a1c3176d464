"""ShardDataset: a torch IterableDataset over a shardprep output, exact per rank and resumable.

Composes the loader's stages; each line of ``__iter__`` is one stage. The
object is small and picklable: it reads the manifest (and nothing else) in
``__init__``, and opens shard files lazily inside each DataLoader worker.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch.utils.data

from loader.decode import make_decoder
from loader.errors import IncompatibleStateError
from loader.order import epoch_order
from loader.partition import Uneven, partition, samples_per_rank, slot_counts
from loader.read import ShardReader
from loader.reweight import Reweighting
from loader.shuffle import ErrorPolicy, windowed_stream
from loader.source import Source
from loader.state import STATE_VERSION, check_state, replay
from loader.world import World, detect_rank
from shardprep.shardformat import ShardIndex

__all__ = ["ShardDataset"]


class ShardDataset(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Stream the samples of a shardprep output to one DDP rank and its DataLoader workers.

    Every rank yields exactly ``len(self)`` samples per epoch, and with a
    DataLoader ``batch_size`` exactly the same number of batches, for any
    shard count, world size and ``num_workers``. The order is a pure function
    of (manifest, seed, epoch, world size, workers); call ``set_epoch(e)``
    before each epoch for a new order.

    Args:
        path: the output folder (or a URL, read through fsspec).
        seed: seeds every random choice; fixed default, never random.
        shuffle: permute blocks of samples each epoch and shuffle inside a
            bounded window; ``False`` streams shards in order.
        uneven: ``"drop"`` leaves out fewer than ``world_size`` samples per
            epoch; ``"pad"`` repeats samples to fill, flagged ``__padded__``.
        rank, world_size: override ``torch.distributed`` (pass both or neither).
        decode: ``False`` yields raw bytes; ``True`` decodes common extensions;
            a mapping ``{ext: fn}`` adds or replaces decoders.
        transform: applied to each (decoded) sample dict.
        shuffle_buffer, shuffle_buffer_bytes: the shuffle window's bounds, in
            samples and bytes; also the worker's memory bound.
        block_size: samples per block of the epoch order.
        verify: check each shard's sha256 when a worker first reads it.
        allow_pickle: allow decoding pickle/torch members (runs code from the shard).
        on_error: ``"raise"`` (default) or ``"skip"``: replace unreadable samples
            with a flagged repeat, giving up after ``max_consecutive_errors``.
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
        verify: bool = False,
        allow_pickle: bool = False,
        on_error: str = "raise",
        max_consecutive_errors: int = 10,
        class_weights: str | None = None,
        resample: bool = True,
    ) -> None:
        super().__init__()
        if seed < 0:
            raise ValueError(f"seed must be non-negative, not {seed}")
        if min(shuffle_buffer, shuffle_buffer_bytes, block_size) < 1:
            raise ValueError("shuffle_buffer, shuffle_buffer_bytes and block_size must be positive")
        self.source = Source(path)
        self.manifest = self.source.manifest()
        self.seed, self.shuffle, self.uneven = seed, shuffle, Uneven(uneven)
        self.rank, self.world_size = detect_rank(rank, world_size)
        self.decode, self.transform, self.allow_pickle = decode, transform, allow_pickle
        self.shuffle_buffer, self.shuffle_buffer_bytes = shuffle_buffer, shuffle_buffer_bytes
        self.block_size, self.verify = block_size, verify
        ErrorPolicy(on_error, max_consecutive_errors)  # validates
        self.on_error, self.max_consecutive_errors = on_error, max_consecutive_errors
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
        samples_per_rank(self._total, self.world_size, self.uneven)  # fails early if impossible
        # The epoch lives in a shared anonymous page, so persistent DataLoader
        # workers (forked once) see set_epoch() calls made later in the parent.
        self._epoch_cell: mmap.mmap | None = mmap.mmap(-1, 8)
        self._epoch = 0
        self._resume: dict[str, Any] | None = None

    # --- epoch and length ---------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch whose order is streamed next (set with :meth:`set_epoch`)."""
        if self._epoch_cell is not None:
            return int(struct.unpack_from("<q", self._epoch_cell)[0])
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (and so the order) of the next iteration, as with DistributedSampler.

        A loaded resume state applies only to its own epoch.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, not {epoch}")
        self._epoch = epoch
        if self._epoch_cell is not None:
            struct.pack_into("<q", self._epoch_cell, 0, epoch)
        if self._resume is not None and self._resume["epoch"] != epoch:
            self._resume = None

    def __len__(self) -> int:
        """Samples this rank yields per epoch (the same on every rank)."""
        return samples_per_rank(self._total, self.world_size, self.uneven)

    # --- iteration ----------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        # → which rank and worker slot this is (slots rotate after a resume, see state.replay)
        world, skip = self._world_and_skip(epoch)
        # → the epoch's block order, identical on every rank and worker
        order = epoch_order(self._sizes, self.seed, epoch, self.shuffle, self.block_size)
        # → this (rank, slot)'s sample ranges: equal counts per rank and per worker slot
        pieces = partition(order, self._total, world, self.uneven)
        reader = ShardReader(self.source, self.manifest, self.verify, self._expander(epoch))
        decoder = make_decoder(self.decode, self.allow_pickle)
        try:
            # → raw samples, read window by window and shuffled inside each window
            for sample in windowed_stream(
                pieces,
                reader,
                shuffle=self.shuffle,
                rng_key=(self.seed, epoch, world.rank, world.worker),
                skip=skip,
                max_samples=self.shuffle_buffer,
                max_bytes=self.shuffle_buffer_bytes,
                policy=ErrorPolicy(self.on_error, self.max_consecutive_errors),
            ):
                # → decoded and transformed samples
                if decoder is not None:
                    sample = decoder(sample)
                yield sample if self.transform is None else self.transform(sample)
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

    def _fields(self) -> dict[str, Any]:
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
            "world_size": self.world_size,
        }

    def state_dict(
        self,
        batches: int,
        dataloader: torch.utils.data.DataLoader | None = None,  # type: ignore[type-arg]
    ) -> dict[str, Any]:
        """The position after ``batches`` batches of the current epoch came out of ``dataloader``.

        Without a dataloader, ``batches`` counts samples taken by iterating the
        dataset directly. The result is a small JSON-able dict, the same on every
        rank; save it with the checkpoint and pass it to :meth:`load_state_dict`.
        """
        num_workers = max(1, dataloader.num_workers) if dataloader is not None else 1
        batch_size = (dataloader.batch_size or 1) if dataloader is not None else 1
        drop_last = bool(dataloader.drop_last) if dataloader is not None else False
        counts = slot_counts(len(self), num_workers)
        consumed, next_slot = replay(batches, counts, batch_size, drop_last)
        resumed = self._resume
        if resumed is not None and resumed["epoch"] == self.epoch:
            # ``batches`` counts from the resumed iteration: add what came before it.
            if resumed["num_workers"] != num_workers:
                raise IncompatibleStateError.field_differs(
                    "num_workers", resumed["num_workers"], num_workers
                )
            start = resumed["next_slot"]
            shifted, next_position = replay(
                batches, self._remaining(resumed), batch_size, drop_last
            )
            consumed = list(resumed["consumed"])
            for position, slot in enumerate(self._rotation(start, num_workers)):
                consumed[slot] += shifted[position]
            next_slot = (start + next_position) % num_workers
        return {
            **self._fields(),
            "epoch": self.epoch,
            "num_workers": num_workers,
            "consumed": consumed,
            "next_slot": next_slot,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`'s result: the next iteration of that epoch continues there.

        Call it before creating the DataLoader iterator. It also sets the epoch.

        Raises:
            IncompatibleStateError: the state is from another build, seed,
                option set or world size.
        """
        check_state(state, self._fields())
        self.set_epoch(int(state["epoch"]))
        self._resume = dict(state)

    def _world_and_skip(self, epoch: int) -> tuple[World, int]:
        """This process's World (worker → slot) and how many of its samples to skip."""
        world = World.for_worker(self.rank, self.world_size)
        state = self._resume
        if state is None or state["epoch"] != epoch:
            return world, 0
        if state["num_workers"] != world.num_workers:
            raise IncompatibleStateError.field_differs(
                "num_workers",
                state["num_workers"],
                world.num_workers,
                "create the DataLoader with the same num_workers as when the state was saved",
            )
        slot = (state["next_slot"] + world.worker) % world.num_workers
        world = World(world.rank, world.world_size, slot, world.num_workers)
        return world, int(state["consumed"][slot])

    @staticmethod
    def _rotation(start: int, num_workers: int) -> list[int]:
        """Slots served by DataLoader workers 0, 1, ... after a resume that starts at ``start``."""
        return [(start + i) % num_workers for i in range(num_workers)]

    def _remaining(self, state: Mapping[str, Any]) -> list[int]:
        """Samples each resumed DataLoader worker still had to deliver, in worker order."""
        counts = slot_counts(len(self), state["num_workers"])
        rotation = self._rotation(state["next_slot"], state["num_workers"])
        return [counts[slot] - state["consumed"][slot] for slot in rotation]

    # --- pickling (DataLoader workers) -------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_epoch"] = self.epoch
        state["_epoch_cell"] = (
            None  # an anonymous mapping cannot be pickled; forked workers share it
        )
        return state
