"""NumPy batches: samples assembled into one batch without torch (``loader.core.ShardStream``).

A batch is a dict, one entry per field:

* ``PackedBytes(data, offsets)`` when every sample's value is raw bytes: one
  contiguous ``uint8`` array and ``int64`` offsets, sample ``i`` being
  ``data[offsets[i]:offsets[i + 1]]``;
* an array when every value is a bool, int or float, or an array of one
  common shape and dtype (stacked along a new first dimension);
* ``__key__``: an array of the keys (``str`` elements);
* otherwise a list, one value per sample;

plus ``"__position__"``: where the batch sits in its epoch (``epoch``,
``batch``, ``num_workers``), as in torch batches (``loader.torch.batch``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from shardprep.format.shardformat import KEY_FIELD, POSITION_FIELD

__all__ = ["POSITION", "PackedBytes", "collate_numpy"]

POSITION = POSITION_FIELD  # the same key as loader.torch.batch.POSITION
KEY = KEY_FIELD


class PackedBytes:
    """One field's payloads back to back: sample ``i`` is ``data[offsets[i]:offsets[i + 1]]``."""

    __slots__ = ("data", "offsets")

    def __init__(self, data: npt.NDArray[np.uint8], offsets: npt.NDArray[np.int64]) -> None:
        self.data = data
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __repr__(self) -> str:
        return f"PackedBytes({len(self)} payloads, {self.data.size} bytes)"

    def item(self, i: int) -> bytes:
        """The payload of sample ``i``."""
        return self.data[int(self.offsets[i]) : int(self.offsets[i + 1])].tobytes()

    def tolist(self) -> list[bytes]:
        """Every payload, as bytes."""
        data, ends = self.data.tobytes(), self.offsets.tolist()
        return [data[a:b] for a, b in zip(ends[:-1], ends[1:], strict=True)]


def collate_numpy(samples: Sequence[Mapping[str, Any]], position: dict[str, Any]) -> dict[str, Any]:
    """One batch from sample dicts (fields in first-seen order; a missing field is ``None``).

    Raises:
        TypeError: a sample is not a dict (a ``transform`` must return one in batch mode).
    """
    for sample in samples:
        if not isinstance(sample, Mapping):
            raise TypeError(
                f"batch_size=... assembles batches from sample dicts, but got a "
                f"{type(sample).__name__}: make `transform` return a dict"
            )
    fields = dict.fromkeys(f for s in samples for f in s)
    batch = {f: _collate_field(f, [s.get(f) for s in samples]) for f in fields}
    batch[POSITION] = position
    return batch


def _collate_field(field: str, values: list[Any]) -> Any:
    first = values[0]
    kind = type(first)
    if not all(type(v) is kind for v in values):
        return values
    if kind is bytes:
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum([len(v) for v in values], out=offsets[1:])
        data = np.frombuffer(b"".join(values), dtype=np.uint8)
        return PackedBytes(data, offsets)
    if field == KEY or kind in (bool, int, float):
        return np.array(values)
    if kind is np.ndarray and all(
        v.shape == first.shape and v.dtype == first.dtype for v in values
    ):
        return np.stack(values)
    return values
