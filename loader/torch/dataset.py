"""ShardDataset: a torch IterableDataset over a shardprep output, exact per rank and resumable.

The stages are composed in ``loader.core.ShardStream`` (no torch); the torch
side (rank, DataLoader workers, epochs, ``len``, ``state_after``/``resume``)
is ``loader.torch.layer.TorchLayer``, which holds the stream (``ds.stream``). The object is small and picklable: it
reads the manifest (and nothing else) in ``__init__``, opens shard files
lazily inside each DataLoader worker, and resolves its rank when an epoch
starts (``loader.plan.world``), never earlier.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from loader.core import ShardStream
from loader.options import ReadOptions
from loader.torch.layer import TorchLayer
from loader.torch.output import TorchOutput
from shardprep.format.manifest import Manifest

__all__ = ["ShardDataset"]


class ShardDataset(TorchLayer):
    """Stream the samples of a shardprep output to one DDP rank and its DataLoader workers.

    With ``batch_size=B`` the dataset yields whole batches (``loader.torch.batch.Batch``
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
        version: read this version of a build that was appended to (``shardprep build
            --append``; 1 is the first build), exactly as it was; None reads the newest.
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
        version: int | None = None,
    ) -> None:
        self.stream: ShardStream
        stream = ShardStream(
            path,
            batch_size=batch_size,
            drop_last=drop_last,
            seed=seed,
            shuffle=shuffle,
            uneven=uneven,
            decode=decode,
            transform=transform,
            shuffle_buffer=shuffle_buffer,
            shuffle_buffer_bytes=shuffle_buffer_bytes,
            block_size=block_size,
            allow_pickle=allow_pickle,
            read=read,
            class_weights=class_weights,
            resample=resample,
            output=TorchOutput(),
            version=version,
        )
        super().__init__(stream, rank, world_size)
        if rank is not None and world_size is not None:
            stream.samples_per_rank(world_size)  # fails early if impossible

    @property
    def manifest(self) -> Manifest:
        """The output's manifest (read once, when the dataset was made)."""
        return self.stream.manifest

    @property
    def total(self) -> int:
        """Samples in one epoch of the whole dataset (after class-weight resampling)."""
        return self.stream.total
