"""Batches of small samples cross from DataLoader workers whole through the worker's ring
(``loader.torch.batch.Crossing``): payloads, offsets, keys and flags lie in one slot of the ring and
only a small header is pickled; what arrives is exactly what the pickled path delivers, kept
batches stay intact while later ones fall back to pickling, and a dropped batch's slot is
released."""

from __future__ import annotations

import copy
import gc
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardprep
from loader import ShardDataset
from loader.torch import arena
from loader.torch import output as torchoutput
from loader.torch.batch import Batch, Packed
from tests.conftest import write_class_folders

pytestmark = pytest.mark.skipif(not arena.RINGS, reason="rings are used on x86-64 only")


@pytest.fixture(scope="module")
def medium(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """240 samples of 20-60 KiB in 6 shards: a batch of 8 is 160-480 KiB (under SHARE_BYTES),
    so 60 kept batches exceed a ring of 8 MiB."""
    base = tmp_path_factory.mktemp("medium")
    raw = write_class_folders(base / "raw", {"a": 120, "b": 80, "c": 40}, repeat=80)
    shardprep.build(str(raw), str(base / "out"), shards=6, workers=1, progress=False)
    return base / "out"


def _loader(out: Path, workers: int, **kw: Any) -> tuple[ShardDataset, Any]:
    ds = ShardDataset(str(out), batch_size=kw.pop("batch_size", 8), seed=3)
    return ds, torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, **kw)


def _plain(batch: Batch) -> list[tuple[str, Any]]:
    """A batch as plain values, field by field in order (payloads as bytes)."""
    out: list[tuple[str, Any]] = []
    for field, value in batch.items():
        if isinstance(value, Packed):
            out.append((field, (value.tolist(), value.offsets.tolist())))
        elif isinstance(value, torch.Tensor):
            out.append((field, (str(value.dtype), value.tolist())))
        elif isinstance(value, np.ndarray):
            out.append((field, (value.dtype.kind, value.tolist())))
        else:
            out.append((field, value))
    return out


def _in_ring(address: int) -> bool:
    """Whether ``address`` lies in one of the rings this process has received."""
    for ring in arena._received.values():
        start = ring.data.data_ptr()
        if start <= address < start + ring.data.numel():
            return True
    return False


def _addresses(batch: Batch) -> list[int]:
    """Where each array of a batch lies: payload data and offsets, keys, flags."""
    found = [batch["__key__"].ctypes.data, batch["__padded__"].data_ptr()]
    for value in batch.values():
        if isinstance(value, Packed):
            found += [value.offsets.data_ptr()] + ([value.data.data_ptr()] if len(value) else [])
    return found


def _pickled_reference(
    out: Path, monkeypatch: pytest.MonkeyPatch, workers: int, epochs: int, **kw: Any
) -> list[list[Any]]:
    """The same loader's batches with rings off (every array pickled): what must arrive."""
    with monkeypatch.context() as m:
        m.setattr(torchoutput, "RINGS", False)
        ds, loader = _loader(out, workers, **kw)
        reference = []
        for epoch in range(epochs):
            ds.set_epoch(epoch)
            reference.append([_plain(b) for b in loader])
    return reference


@pytest.mark.parametrize("fixture", ["built", "built_zstd"])
def test_small_batches_cross_whole_through_the_ring(
    fixture: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = request.getfixturevalue(fixture)
    reference = _pickled_reference(out, monkeypatch, 2, 2, batch_size=7)
    arena._received.clear()
    ds, loader = _loader(out, 2, batch_size=7)
    for epoch in range(2):
        ds.set_epoch(epoch)
        got = []
        for batch in loader:
            assert all(_in_ring(a) for a in _addresses(batch)), "an array did not cross by ring"
            got.append(_plain(batch))
        assert got == reference[epoch]
    assert len(arena._received) == 2  # one ring per worker


def test_kept_batches_stay_intact_and_dropped_ones_release_their_slots(
    medium: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one worker: 60 batches of 160-480 KiB, more than its ring of 8 MiB holds
    reference = _pickled_reference(medium, monkeypatch, 1, 2, persistent_workers=True)
    arena._received.clear()
    ds, loader = _loader(medium, 1, persistent_workers=True)
    kept: list[list[Batch]] = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        kept.append(list(loader))  # every batch held: the rings fill up
    by_ring = [all(_in_ring(a) for a in _addresses(b)) for e in kept for b in e]
    assert by_ring.count(True) > 0 and by_ring.count(False) > 0, by_ring  # both ways taken
    assert [[_plain(b) for b in e] for e in kept] == reference
    rings = list(arena._received.values())
    assert len(rings) == 1 and all(r.pending for r in rings)
    del kept
    gc.collect()
    assert all(not r.pending for r in rings)  # every slot released, the counter advanced
    assert all(int(r.counter[0]) > 0 for r in rings)
    ds.set_epoch(2)  # and the workers write into their rings again
    assert all(all(_in_ring(a) for a in _addresses(b)) for b in loader)


def _facts(batch: Batch) -> dict[str, Any]:
    """In a DataLoader worker (the collate function): what crosses, and how large it is."""
    header = len(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
    changed = copy.copy(batch)  # as the DataLoader's default_convert copies it
    changed["bin"] = Packed(torch.zeros(3, dtype=torch.uint8), torch.tensor([0, 3]))
    fields = changed.__reduce__()[1][1]
    return {
        "crossing": batch.crossing is not None and changed.crossing is batch.crossing,
        "header": header,
        "payload": int(batch["bin"].data.numel()),
        "inline": [field for field, spec, _ in fields if spec is None],
    }


def test_only_a_small_header_is_pickled_and_a_replaced_field_travels_as_a_value(
    medium: Path,
) -> None:
    ds = ShardDataset(str(medium), batch_size=8, seed=3)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, collate_fn=_facts)
    facts = list(loader)
    assert len(facts) == 30 and all(f["crossing"] for f in facts)
    # the first batch carries the ring itself (pickled here by copy: 8 MiB); no later one
    assert all(f["header"] < 1024 and f["payload"] > 100_000 for f in facts[1:]), facts
    assert all(f["inline"] == ["bin", "__position__"] for f in facts)
