"""Batch: samples assembled into one batch inside the DataLoader worker.

With ``ShardDataset(batch_size=B)`` each worker yields whole batches, and the
DataLoader is created with ``batch_size=None``. A ``Batch`` is a dict: one
entry per field, holding

* ``Packed(data, offsets)`` when every sample's value is raw bytes (every
  member without ``decode``): one contiguous ``uint8`` tensor and ``int64``
  offsets, sample ``i`` being ``data[offsets[i]:offsets[i + 1]]``. Made in
  shared memory inside a worker, it reaches the main process as a file
  descriptor, not as pickled bytes;
* a tensor when every sample's value is a number, or an array/tensor of one
  common shape and dtype (``.cls`` and ``.npy`` after ``decode=True``,
  ``__padded__``, ``__weight__``), stacked along a new first dimension;
* otherwise a list, one value per sample (strings, keys, arrays of differing
  shapes, a field some samples lack);

plus ``"__position__"``: ``{"epoch", "batch", "num_workers"}``, which
``ShardDataset.state_after(batch)`` turns into a resume state.

A DataLoader given a ``batch_size`` as well would batch batches (and its
``len()`` would be wrong): ``default_collate`` refuses a ``Batch`` with a
message saying so, through torch's documented ``default_collate_fn_map``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.utils.data
from torch.utils.data._utils.collate import default_collate, default_collate_fn_map

__all__ = ["POSITION", "Batch", "Packed", "collate_samples", "pack"]

POSITION = "__position__"


class Batch(dict):  # type: ignore[type-arg]
    """One batch of a ShardDataset with a batch size: ``{field: Packed, tensor or list}``."""


class Packed(NamedTuple):
    """One field's payloads, back to back: sample ``i`` is ``data[offsets[i]:offsets[i + 1]]``.

    A named tuple of two tensors, so ``pin_memory``, ``.to(device)`` in
    Lightning and accelerate, and torch's inter-process sharing all handle
    it as they handle any tuple of tensors.
    """

    data: torch.Tensor  # uint8
    offsets: torch.Tensor  # int64, one more than the samples

    def item(self, i: int) -> bytes:
        """The payload of sample ``i``."""
        start, stop = self.offsets[i : i + 2].tolist()
        return bytes(self.data[start:stop].numpy())

    def tolist(self) -> list[bytes]:
        """Every payload, as bytes."""
        data, ends = self.data.numpy().tobytes(), self.offsets.tolist()
        return [data[a:b] for a, b in zip(ends[:-1], ends[1:], strict=True)]

    def tensors(self) -> list[torch.Tensor]:
        """Every payload as a 1-D uint8 view (no copy), e.g. for ``torchvision.io.decode_jpeg``."""
        return list(torch.split(self.data, torch.diff(self.offsets).tolist()))


def pack(payloads: Sequence[bytes | memoryview]) -> Packed:
    """Pack payloads into one uint8 tensor, in shared memory when called in a DataLoader worker."""
    sizes = [len(p) for p in payloads]
    offsets = torch.zeros(len(sizes) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0, out=offsets[1:])
    total = int(offsets[-1])
    if torch.utils.data.get_worker_info() is not None:  # as default_collate: no extra copy later
        data = torch.empty(0, dtype=torch.uint8).new(
            torch.UntypedStorage._new_shared(total)  # type: ignore[no-untyped-call]
        )
    else:
        data = torch.empty(total, dtype=torch.uint8)
    if total:
        data.numpy()[:] = np.frombuffer(b"".join(payloads), dtype=np.uint8)
    return Packed(data, offsets)


def collate_samples(samples: Sequence[Mapping[str, Any]], position: dict[str, int]) -> Batch:
    """One Batch from sample dicts (fields in first-seen order; a missing field is ``None``).

    Raises:
        TypeError: a sample is not a dict (a ``transform`` must return one in batch mode).
    """
    fields: dict[str, None] = {}
    for sample in samples:
        if not isinstance(sample, Mapping):
            raise TypeError(
                f"ShardDataset(batch_size=...) assembles batches from sample dicts, but got a "
                f"{type(sample).__name__}: make `transform` return a dict (or leave batch_size "
                "unset and batch in the DataLoader)"
            )
        fields.update(dict.fromkeys(sample))
    batch = Batch({field: _collate_field([s.get(field) for s in samples]) for field in fields})
    batch[POSITION] = position
    return batch


def _collate_field(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, bytes) and all(type(v) is bytes for v in values):
        return pack(values)
    if isinstance(first, (bool, int, float)) and all(type(v) is type(first) for v in values):
        return default_collate(values)  # type: ignore[no-untyped-call]
    numeric = isinstance(first, torch.Tensor) or (
        isinstance(first, np.ndarray) and first.dtype.kind in "biuf"
    )
    if numeric and all(
        type(v) is type(first) and v.shape == first.shape and v.dtype == first.dtype for v in values
    ):
        return default_collate(values)  # type: ignore[no-untyped-call]
    return list(values)


def _refuse_rebatch(
    batch: list[Batch], *, collate_fn_map: Mapping[Any, Callable[..., Any]] | None = None
) -> Any:
    raise TypeError(
        "ShardDataset(batch_size=...) already yields whole batches, and this DataLoader was "
        "given a batch_size too (it would batch batches, and len(loader) would be wrong): "
        "create it with DataLoader(dataset, batch_size=None, ...)"
    )


default_collate_fn_map[Batch] = _refuse_rebatch
