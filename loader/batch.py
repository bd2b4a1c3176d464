"""Batch: samples assembled into one batch inside the DataLoader worker.

With ``ShardDataset(batch_size=B)`` each worker yields whole batches, and the
DataLoader is created with ``batch_size=None``. A ``Batch`` is a dict: one
entry per field, holding

* a tensor when every sample's value is a number, or an array/tensor of one
  common shape and dtype (``.cls`` and ``.npy`` after ``decode=True``,
  ``__padded__``, ``__weight__``), stacked along a new first dimension;
* otherwise a list, one value per sample (raw bytes, strings, keys, arrays of
  differing shapes);

plus ``"__position__"``: ``{"epoch", "batch", "num_workers"}``, which
``ShardDataset.state_after(batch)`` turns into a resume state.

A DataLoader given a ``batch_size`` as well would batch batches (and its
``len()`` would be wrong): ``default_collate`` refuses a ``Batch`` with a
message saying so, through torch's documented ``default_collate_fn_map``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate, default_collate_fn_map

__all__ = ["POSITION", "Batch", "collate_samples"]

POSITION = "__position__"


class Batch(dict):  # type: ignore[type-arg]
    """One batch of a ShardDataset with a batch size: ``{field: tensor or list}``."""


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
