"""A small batch's crossing in one process: ``Arena.place`` writes its arrays into one slot of
the ring, aligned, and ``loader.torch.batch._rebuild_crossed`` lends them back as views of the ring
(``loader.torch.arena._Ring``), whose bytes return to the worker oldest first once every view of a
payload is freed."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from loader.torch import arena
from loader.torch.arena import ALIGN, HEADER, Arena
from loader.torch.batch import Packed, _rebuild_crossed, cross


@pytest.fixture(autouse=True)
def _no_rings_left() -> None:
    arena._received.clear()


def _fields() -> list[tuple[str, object, list[np.ndarray]]]:
    keys = np.array([f"key-{i}" for i in range(5)])  # <U5: 20 bytes each
    flags = np.array([False, True, False, False, True])  # 5 bytes: the next array is padded
    payloads = np.frombuffer(b"abcdefghijklmnopq", dtype=np.uint8)  # 17 bytes
    offsets = np.array([0, 3, 3, 10, 12, 17], dtype=np.int64)
    packed = Packed(torch.from_numpy(payloads.copy()), torch.from_numpy(offsets))
    return [
        ("bin", packed, [payloads, offsets]),
        ("__key__", keys, [keys]),
        ("__padded__", torch.from_numpy(flags), [flags]),
    ]


def test_place_writes_every_array_aligned_and_the_rebuilt_batch_equals_it() -> None:
    ring = Arena()
    ring.reserve(1)  # the ring exists; nothing committed
    assert ring.reserve(3) is not None
    ring._allocated = 3  # the next slot begins at an odd offset: arrays are still aligned
    fields = _fields()
    crossing = cross(ring, fields)
    assert crossing is not None
    ticket = crossing.ticket
    assert ticket.begin == 3 and ticket.storage is not None  # the first ticket carries the ring
    places = [p for _, spec in crossing.specs.values() for p in spec]
    assert [(d, n) for _, d, n in places] == [("|u1", 17), ("<i8", 6), ("<U5", 5), ("|b1", 5)]
    written = ring._data.numpy()[HEADER + ticket.begin :]  # type: ignore[union-attr]
    arrays = [a for *_, p in fields for a in p]
    for (start, dtype, count), array in zip(places, arrays, strict=True):
        assert (HEADER + ticket.begin + start) % ALIGN == 0, (start, dtype)
        got = np.frombuffer(written, dtype=dtype, count=count, offset=start)
        assert got.tobytes() == array.tobytes()
    assert ticket.size >= sum(-(-a.nbytes // ALIGN) * ALIGN for _, _, p in fields for a in p)

    specs = [(f, spec, None) for f, (_, spec) in crossing.specs.items()]
    batch = _rebuild_crossed(ticket.fields(), specs)
    assert batch["bin"].tolist() == [b"abc", b"", b"defghij", b"kl", b"mnopq"]
    assert batch["__key__"].tolist() == [f"key-{i}" for i in range(5)]
    assert batch["__padded__"].tolist() == [False, True, False, False, True]
    assert batch["bin"].offsets.dtype == torch.int64


def test_place_writes_nothing_when_the_ring_has_no_room() -> None:
    ring = Arena()
    ring.reserve(1)
    capacity = len(ring._view)  # type: ignore[arg-type]
    ring._allocated = capacity  # all of it handed out, none released
    assert ring.place([np.zeros(64, dtype=np.uint8)]) is None
    assert ring._allocated == capacity and not ring._announced
    ring._counter[0] = capacity  # released: the next placement fits, and carries the ring
    placed = ring.place([np.zeros(64, dtype=np.uint8)])
    assert placed is not None and placed[0].storage is not None


def test_lent_payloads_return_to_the_worker_oldest_first_once_every_view_is_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (a table of its own: this process owns the ring, so it would stay in the module's table
    # and be counted by tests/integration/test_arena.py run after this one)
    monkeypatch.setattr(arena, "_received", {})
    ring = Arena()
    tickets = []
    for size in (100, 200, 300):
        placed = ring.place([np.full(size, size // 100, dtype=np.uint8)])
        assert placed is not None
        tickets.append(placed[0])
    arrays = [arena.receive_bytes(*t.fields()) for t in tickets]
    received = arena._received[ring.ring]
    consumed = [t.consumed for t in tickets]
    assert [a[0] for a in arrays] == [1, 2, 3] and int(received.counter[0]) == 0

    view = torch.from_numpy(arrays[0][10:20])  # a view keeps the first payload lent
    del arrays[1]  # the second is freed first: it waits for the first
    gc.collect()
    assert int(received.counter[0]) == 0 and len(received.pending) == 3
    del arrays[0]
    gc.collect()
    assert int(received.counter[0]) == 0  # the view still holds the first
    assert view.tolist() == [1] * 10
    del view
    assert int(received.counter[0]) == consumed[0] + consumed[1]  # both, in order
    arrays.clear()
    assert int(received.counter[0]) == sum(consumed) and not received.pending
