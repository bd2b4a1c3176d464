"""Batch: samples assembled into one batch inside the DataLoader worker.

With ``ShardDataset(batch_size=B)`` each worker yields whole batches, and the
DataLoader is created with ``batch_size=None``. A ``Batch`` is a dict: one
entry per field, holding

* ``Packed(data, offsets)`` when every sample's value is raw bytes (every
  member without ``decode``): one contiguous ``uint8`` tensor and ``int64``
  offsets, sample ``i`` being ``data[offsets[i]:offsets[i + 1]]``. A batch
  crosses from a worker as one message: its large payload tensors (1 MiB or
  more) as shared memory, everything else as a few contiguous buffers, never
  as one pickled object per sample;
* a tensor when every sample's value is a number, or an array/tensor of one
  common shape and dtype (``.cls`` and ``.npy`` after ``decode=True``,
  ``__padded__``, ``__weight__``), stacked along a new first dimension;
* ``__key__``: a numpy array of the keys (``str`` elements), which the
  DataLoader's ``default_convert`` and the pickler handle as one object;
* otherwise a list, one value per sample (strings, arrays of differing shapes,
  a field some samples lack);

plus ``"__position__"``: ``{"epoch", "batch", "num_workers"}``, which
``ShardDataset.state_after(batch)`` turns into a resume state.

A DataLoader given a ``batch_size`` as well would batch batches (and its
``len()`` would be wrong): ``default_collate`` refuses a ``Batch`` with a
message saying so, through torch's documented ``default_collate_fn_map``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from time import perf_counter_ns
from typing import Any

import numpy as np
import torch
import torch.utils.data
from torch.utils.data._utils.collate import default_collate, default_collate_fn_map

from loader.read.telemetry import HANDOFF, Clock
from loader.torch.arena import Arena, receive_bytes
from shardprep.format.shardformat import KEY_FIELD, POSITION_FIELD

__all__ = ["POSITION", "Batch", "Crossing", "Packed", "collate_samples", "cross", "pack"]

POSITION = POSITION_FIELD  # the loader's own fields: shardprep.format.shardformat
KEY = KEY_FIELD


class Batch(dict):  # type: ignore[type-arg]
    """One batch of a ShardDataset with a batch size: ``{field: Packed, tensor or list}``.

    Pickled (from a DataLoader worker to the main process), the fields its ``crossing``
    describes travel as where their arrays lie in the worker's shared-memory ring
    (``Crossing``); other small tensors inside the one message and large ones as shared
    memory (see ``_portable``).
    """

    crossing: Crossing | None = None  # set by the assembler in a DataLoader worker
    clock: Clock | None = None  # a DataLoader worker's pass: its pickling is counted (handoff)

    def __copy__(self) -> Batch:  # (the DataLoader's default_convert copies each batch)
        copy = Batch(self)
        copy.crossing = self.crossing
        copy.clock = self.clock
        return copy

    def __reduce__(self) -> tuple[Any, ...]:
        clock = self.clock
        if clock is None:
            return self._reduce()
        began = perf_counter_ns()
        try:
            return self._reduce()
        finally:
            clock.add(HANDOFF, perf_counter_ns() - began)

    def _reduce(self) -> tuple[Any, ...]:
        crossing = self.crossing
        if crossing is None:
            return (_rebuild_batch, ({field: _portable(v) for field, v in self.items()},))
        fields: list[tuple[str, Any, Any]] = []
        for field, value in self.items():
            described = crossing.specs.get(field)
            if described is not None and described[0] is value:  # still the value written
                fields.append((field, described[1], None))
            else:
                fields.append((field, None, _portable(value)))
        return (_rebuild_crossed, (crossing.ticket.fields(), fields))


class Crossing:
    """How a batch made in a DataLoader worker crosses to the main process: one ticket for the
    slot of the worker's ring (``loader.torch.arena``) that holds its arrays, and for each field
    described the value it describes and where its arrays lie in the slot (offset, NumPy dtype,
    count: one-dimensional; a ``Packed`` has two: data and offsets). Only this small header is
    pickled: in the
    main process every array is a view of the slot (no copy), which the worker reuses once
    every view of it is freed."""

    __slots__ = ("specs", "ticket")

    def __init__(self, ticket: Any, specs: dict[str, tuple[Any, tuple[Any, ...]]]) -> None:
        self.ticket = ticket
        self.specs = specs


def cross(
    arena: Arena, fields: list[tuple[str, Any, list[np.ndarray[Any, Any]]]]
) -> Crossing | None:
    """How a batch made in a DataLoader worker crosses: each field's arrays (``fields``: the
    field, its value in the batch, its arrays) written into one slot of the worker's ring
    (``Arena.place``). None if the ring has no room (the batch then crosses pickled)."""
    placed = arena.place([part for _, _, parts in fields for part in parts])
    if placed is None:
        return None
    ticket, places = placed
    specs: dict[str, tuple[Any, tuple[Any, ...]]] = {}
    at = 0
    for field, value, parts in fields:
        specs[field] = (value, tuple(places[at : at + len(parts)]))
        at += len(parts)
    return Crossing(ticket, specs)


SHARE_BYTES = 1 << 20  # a tensor this large crosses from a worker in shared memory


class Packed:
    """One field's payloads, back to back: sample ``i`` is ``data[offsets[i]:offsets[i + 1]]``.

    ``pin_memory()`` and ``.to(device, non_blocking=...)`` (what Lightning and
    accelerate call to move a batch) return a new ``Packed``.
    """

    __slots__ = ("_ticket", "data", "offsets")

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor, ticket: Any = None) -> None:
        self.data = data  # uint8
        self.offsets = offsets  # int64, one more than the samples
        self._ticket = (
            ticket  # data's place in a worker's ring (``loader.torch.arena``), if it is there
        )

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __repr__(self) -> str:
        return f"Packed({len(self)} payloads, {self.data.numel()} bytes)"

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

    def pin_memory(self, device: Any = None) -> Packed:
        return Packed(self.data.pin_memory(), self.offsets.pin_memory())

    def to(self, *args: Any, **kwargs: Any) -> Packed:
        return Packed(self.data.to(*args, **kwargs), self.offsets.to(*args, **kwargs))

    def __reduce__(self) -> tuple[Any, ...]:
        data = self._ticket if self._ticket is not None else _portable(self.data)
        return (_rebuild_packed, (data, _portable(self.offsets)))


def _portable(value: Any) -> Any:
    """How a value crosses from a worker: a small CPU tensor as a numpy array, in the pickle.

    Torch hands every tensor over as a shared-memory file descriptor, which
    costs a socket round trip (about 0.35 ms here) per tensor; a few KiB of
    offsets or flags cross far faster inside the one pickled message.
    """
    small = (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and not value.requires_grad
        and value.numel() * value.element_size() < SHARE_BYTES
    )
    return _Small(value.numpy()) if small else value


class _Small:
    __slots__ = ("array",)

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array


def _restored(value: Any) -> Any:
    return torch.from_numpy(value.array) if isinstance(value, _Small) else value


def _rebuild_packed(data: Any, offsets: Any) -> Packed:
    return Packed(_restored(data), _restored(offsets))


def _rebuild_batch(items: dict[str, Any]) -> Batch:
    return Batch({field: _restored(value) for field, value in items.items()})


_DTYPES: dict[str, np.dtype[Any]] = {}  # NumPy dtypes by their ``str``, made once


def _rebuild_crossed(slot: tuple[Any, ...], fields: list[tuple[str, Any, Any]]) -> Batch:
    """In the main process: the batch over its ring ``slot`` (a ``Ticket``'s fields), whose
    bytes are lent until every array over them is freed."""
    data = receive_bytes(*slot)
    batch = Batch()
    for field, spec, value in fields:
        if spec is None:
            batch[field] = _restored(value)
            continue
        if len(spec) == 2:  # a Packed: data and offsets
            (a, _, n), (b, _, m) = spec
            batch[field] = Packed(
                torch.from_numpy(np.frombuffer(data, np.uint8, n, a)),
                torch.from_numpy(np.frombuffer(data, np.int64, m, b)),
            )
            continue
        ((a, name, n),) = spec
        dtype = _DTYPES.get(name)
        if dtype is None:
            dtype = _DTYPES[name] = np.dtype(name)
        array = np.frombuffer(data, dtype, n, a)
        batch[field] = array if array.dtype.kind in "US" else torch.from_numpy(array)  # keys: NumPy
    return batch


def pack(payloads: Sequence[bytes]) -> Packed:
    """Pack payloads into one uint8 tensor; a large one in shared memory inside a DataLoader worker."""
    count = len(payloads)
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, payloads), dtype=np.int64, count=count), out=offsets[1:])
    total = int(offsets[-1])
    if total >= SHARE_BYTES and torch.utils.data.get_worker_info() is not None:
        # As default_collate does: made in shared memory, it crosses to the main process as is.
        data = torch.empty(0, dtype=torch.uint8).new(
            torch.UntypedStorage._new_shared(total)  # type: ignore[no-untyped-call]
        )
        view = data.numpy()  # each payload copied once, straight into shared memory
        ends = offsets.tolist()
        for payload, start, stop in zip(payloads, ends[:-1], ends[1:], strict=True):
            view[start:stop] = np.frombuffer(payload, dtype=np.uint8)
    elif total:
        data = torch.frombuffer(bytearray().join(payloads), dtype=torch.uint8)  # one copy
    else:
        data = torch.empty(0, dtype=torch.uint8)
    return Packed(data, torch.from_numpy(offsets))


def collate_samples(samples: Sequence[Mapping[str, Any]], position: dict[str, int]) -> Batch:
    """One Batch from sample dicts (fields in first-seen order; a missing field is ``None``).

    Raises:
        TypeError: a sample is not a dict (a ``transform`` must return one in batch mode).
    """
    first = samples[0]
    if not all(type(s) is dict for s in samples):  # the common case needs no ABC checks
        for sample in samples:
            if not isinstance(sample, Mapping):
                raise TypeError(
                    f"ShardDataset(batch_size=...) assembles batches from sample dicts, but got "
                    f"a {type(sample).__name__}: make `transform` return a dict (or leave "
                    "batch_size unset and batch in the DataLoader)"
                )
    try:  # the common case: every sample has the first one's fields, and no others
        if any(len(s) != len(first) for s in samples):
            raise KeyError
        columns = {f: [s[f] for s in samples] for f in first}
    except KeyError:  # some samples lack (or add) a field: it is None where missing
        fields = dict.fromkeys(f for s in samples for f in s)
        columns = {f: [s.get(f) for s in samples] for f in fields}
    batch = Batch({field: _collate_field(field, values) for field, values in columns.items()})
    batch[POSITION] = position
    return batch


def _collate_field(field: str, values: list[Any]) -> Any:
    first = values[0]
    kind = type(first)
    if all(type(v) is kind for v in values):
        if kind is bytes:
            return pack(values)
        if field == KEY:  # one array object: DataLoader's default_convert and pickle pass it whole
            return np.array(values)
        if kind is bool:
            return torch.from_numpy(np.array(values, dtype=np.bool_))
        if kind in (int, float):
            return default_collate(values)  # type: ignore[no-untyped-call]
        numeric = kind is torch.Tensor or (kind is np.ndarray and first.dtype.kind in "biuf")
        if numeric and all(v.shape == first.shape and v.dtype == first.dtype for v in values):
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
