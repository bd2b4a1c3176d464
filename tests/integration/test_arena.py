"""Large batch payloads cross from DataLoader workers through each worker's shared-memory ring
(``loader.torch.arena``): the bytes that arrive are exactly the in-process batches', whether a batch
went through the ring or (ring full) through fresh shared memory, over epochs in which the ring
wraps many times, under fork and spawn; and the main process keeps no ring of an exited worker."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardprep
from loader import CorruptShardError, ReadOptions, ShardDataset
from loader.torch import arena
from shardprep.format.shardformat import decode_index
from tests.conftest import write_class_folders
from tests.processes import dataloader_iterator

pytestmark = pytest.mark.skipif(not arena.RINGS, reason="rings are used on x86-64 only")


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """240 samples of 20-60 KiB in 6 shards: batches of 32 are 1-2 MiB (over SHARE_BYTES)."""
    base = tmp_path_factory.mktemp("big")
    raw = write_class_folders(base / "raw", {"a": 120, "b": 80, "c": 40}, repeat=80)
    shardprep.build(str(raw), str(base / "out"), shards=6, workers=1, progress=False)
    return base / "out"


def _epochs(ds: ShardDataset, loader: Any, epochs: int) -> tuple[list[list[Any]], int, int]:
    """Per epoch, (key, payload) in arrival order; and how many payloads came by ring / shm."""
    seen, ring, shared = [], 0, 0
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        got = []
        for batch in loader:
            packed = batch["bin"]
            if packed.data.numel() >= (1 << 20):
                shared += packed.data.is_shared()
                ring += not packed.data.is_shared()
            got += list(zip(batch["__key__"].tolist(), packed.tolist(), strict=True))
        seen.append(got)
    return seen, ring, shared


def _in_process(out: Path, epochs: int, **kwargs: Any) -> list[list[tuple[str, bytes]]]:
    """Per epoch, (key, payload) of every batch made in process: what workers must deliver."""
    reference = []
    for epoch in range(epochs):
        ds = ShardDataset(str(out), **kwargs)
        ds.set_epoch(epoch)
        reference.append(
            [
                (k, p)
                for b in ds
                for k, p in zip(b["__key__"].tolist(), b["bin"].tolist(), strict=True)
            ]
        )
    return reference


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_ring_and_fresh_shared_memory_deliver_the_in_process_bytes(
    big: Path, context: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = _in_process(big, 3, batch_size=32, seed=3)
    # A ring of two first batches, and a consumer that lets the workers run ahead: the ring
    # wraps every other batch and is often full, so both ways across are taken.
    monkeypatch.setattr(arena, "MIN_BYTES", 0)
    monkeypatch.setattr(arena, "BATCHES", 2)
    ds = ShardDataset(str(big), batch_size=32, seed=3)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=None,
        num_workers=1,
        persistent_workers=True,
        prefetch_factor=6,
        multiprocessing_context=context,
    )
    seen, ring, shared = _epochs(ds, loader, 3)
    assert ring > 0
    if context == "fork":  # a spawned worker imports arena afresh: the small ring is fork's only
        assert shared > 0, (ring, shared)
    assert seen == reference


def test_rings_of_exited_workers_are_dropped(big: Path) -> None:
    ds = ShardDataset(str(big), batch_size=32)
    for epoch in range(3):  # no persistent workers: two new worker processes, two new rings each
        ds.set_epoch(epoch)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        assert sum(len(b["__key__"]) for b in loader) == 240
        del loader
        assert len(arena._received) == 2  # this epoch's: the exited workers' rings are gone
    assert len({ring.owner for ring in arena._received.values()}) == 2


@pytest.mark.parametrize("keep", [2, 1])
def test_batches_the_consumer_keeps_keep_their_bytes(
    big: Path, keep: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A payload is a view of the ring until freed: batches kept while later ones arrive (every
    other one, freed out of order; or all of them, filling the ring) still hold their bytes."""
    reference = {}
    for epoch in range(4):
        ds = ShardDataset(str(big), batch_size=32, seed=5)
        ds.set_epoch(epoch)
        reference |= {(epoch, i): b["bin"].tolist() for i, b in enumerate(ds)}
    monkeypatch.setattr(arena, "MIN_BYTES", 0)
    monkeypatch.setattr(arena, "BATCHES", 3)
    ds = ShardDataset(str(big), batch_size=32, seed=5)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=1, persistent_workers=True, prefetch_factor=2
    )
    kept, ring = {}, 0
    for epoch in range(4):
        ds.set_epoch(epoch)
        for i, batch in enumerate(loader):
            ring += not batch["bin"].data.is_shared()
            if (epoch * 8 + i) % keep == 0:
                kept[epoch, i] = batch
            del batch  # the others are freed here, before the next one arrives
    assert ring > 4 and len(kept) == len(reference) // keep
    for where, batch in kept.items():
        assert batch["bin"].tolist() == reference[where], where


def test_in_process_batches_kept_or_freed_keep_their_bytes(big: Path) -> None:
    """In the main process large payloads go into reused buffers (``assemble.Recycler``): a
    buffer is reused only once its batch is freed, so kept batches keep their bytes."""
    reference = {}
    for epoch in range(3):
        slow = ShardDataset(str(big), batch_size=32, seed=7, transform=lambda s: s)
        slow.set_epoch(epoch)
        reference |= {(epoch, i): b["bin"].tolist() for i, b in enumerate(slow)}
    ds = ShardDataset(str(big), batch_size=32, seed=7)
    kept = {}
    for epoch in range(3):
        ds.set_epoch(epoch)
        for i, batch in enumerate(ds):
            assert batch["bin"].tolist() == reference[epoch, i]
            if i % 3 == 0:
                kept[epoch, i] = batch
            del batch
    assert len(ds.stream.output._recycler._free) > 0  # buffers were handed back and reused
    for where, batch in kept.items():
        assert batch["bin"].tolist() == reference[where], where


def test_batches_spanning_windows_cross_through_the_ring(
    big: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows of at most 1.5 MiB hold fewer samples than a batch of 32 (1-2 MiB): every batch
    spans windows, its earlier samples carried as copies (``assemble.Carried``); each still
    crosses through the ring (a ring with room for all of them), with the in-process bytes."""
    kwargs: dict[str, Any] = {"batch_size": 32, "seed": 11, "shuffle_buffer_bytes": 3 << 19}
    reference = _in_process(big, 2, transform=lambda s: s, **kwargs)  # the per-sample path
    monkeypatch.setattr(arena, "MIN_BYTES", 64 << 20)
    ds = ShardDataset(str(big), **kwargs)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=1, persistent_workers=True
    )
    seen, ring, shared = _epochs(ds, loader, 2)
    assert shared == 0 and ring >= 8, (ring, shared)
    assert seen == reference


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_the_ring_under_each_sharing_strategy(
    big: Path, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torch's default strategy the ring is a ``memfd`` (its pages made on first use, one
    descriptor for ring and counter); under ``file_system`` it is torch's own shared storage.
    Either way the bytes are the in-process ones, over epochs in which the ring wraps."""
    reference = _in_process(big, 2, batch_size=32, seed=13)
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(strategy)
    try:
        monkeypatch.setattr(arena, "MIN_BYTES", 0)  # 5 first batches: it wraps every epoch
        arena._received.clear()
        ds = ShardDataset(str(big), batch_size=32, seed=13)
        loader = torch.utils.data.DataLoader(
            ds, batch_size=None, num_workers=1, persistent_workers=True
        )
        seen, ring, shared = _epochs(ds, loader, 2)
        (received,) = arena._received.values()
        storage = received.data.untyped_storage()
        if strategy == "file_descriptor" and arena.MEMFD:
            fd, _ = storage._share_fd_cpu_()
            assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:shardprep-ring")
        else:
            assert storage._share_filename_cpu_()  # torch's named segment
        del loader, received, storage
    finally:
        torch.multiprocessing.set_sharing_strategy(before)
    assert ring >= 8, (ring, shared)  # half the batches are over 1 MiB; 20 MiB through a 6 MiB ring
    assert seen == reference


def _damage(out: Path, shard: int, sample: int) -> str:
    """Flip one byte of ``sample``'s first member in ``shard``; its key."""
    index = decode_index((out / f"shard-{shard:05d}.idx").read_bytes(), "idx")
    member = int(index.member_start[sample])
    with open(out / f"shard-{shard:05d}.tar", "r+b") as f:
        f.seek(int(index.member_offset[member]) + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    return index.key(sample)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_damaged_member_of_a_large_batch(big: Path, tmp_path: Path, workers: int) -> None:
    """Payloads of 1 MiB or more are checked on their copy, in a reused buffer (in process) or
    in a ring slot (a worker). A damaged member raises what the per-sample path raises, naming
    the sample; under ``on_error="skip"`` the batches are the per-sample path's, byte for byte."""
    out = tmp_path / "out"
    shutil.copytree(big, out)
    key = _damage(out, 2, 7)
    errors = []
    for transform in (None, lambda s: s):
        ds = ShardDataset(str(out), batch_size=32, seed=17, transform=transform)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        with pytest.raises(CorruptShardError) as info, dataloader_iterator(loader) as items:
            list(items)
        errors.append(str(info.value).splitlines()[-1])  # a worker's: after its traceback
    assert errors[0] == errors[1] and key in errors[0] and "checksum mismatch" in errors[0]

    skip = ReadOptions(on_error="skip")
    slow = ShardDataset(str(out), batch_size=32, seed=17, read=skip, transform=lambda s: s)
    want = [(b["__key__"].tolist(), b["bin"].tolist(), b["__padded__"].tolist()) for b in slow]
    ds = ShardDataset(str(out), batch_size=32, seed=17, read=skip)
    got = [
        (b["__key__"].tolist(), b["bin"].tolist(), b["__padded__"].tolist())
        for b in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    ]
    assert got == want and sum(sum(p) for _, _, p in got) == 1  # the damaged sample, stood in for


def _flip_at(out: Path, shard: int, sample: int, region: str) -> tuple[str, str]:
    """Flip one byte of ``sample`` in ``shard`` outside its data (version 3 index): in its
    .cls member's tar header or in the padding before it. Its key and what the error says."""
    index = decode_index((out / f"shard-{shard:05d}.idx").read_bytes(), "idx")
    member = int(index.member_start[sample])
    end = int(index.member_offset[member]) + int(index.member_size[member])
    assert index.version == 3 and end % 512  # the .bin member is padded
    cls_header = int(index.member_offset[member + 1]) - 512
    position = cls_header + 3 if region == "header" else end + 5
    with open(out / f"shard-{shard:05d}.tar", "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    said = (
        f"the tar header of its .cls member (at offset {cls_header})"
        if region == "header"
        else f"the zero padding before its .cls member's tar header (offset {end})"
    )
    return index.key(sample), said


@pytest.mark.parametrize("region", ["header", "padding"])
@pytest.mark.parametrize("workers", [0, 1])
def test_a_damaged_header_or_padding_in_a_large_batch(
    big: Path, tmp_path: Path, workers: int, region: str
) -> None:
    """A large batch's samples are checked by streaming checksums (the bytes between members
    from the window, the data from its copy): a flipped byte in a tar header or in the
    padding between members raises what the per-sample path raises, naming the sample and
    what is damaged; under ``on_error="skip"`` the batches are the per-sample path's, byte
    for byte."""
    out = tmp_path / "out"
    shutil.copytree(big, out)
    key, said = _flip_at(out, 2, 7, region)
    errors = []
    for transform in (None, lambda s: s):
        ds = ShardDataset(str(out), batch_size=32, seed=17, transform=transform)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        with pytest.raises(CorruptShardError) as info, dataloader_iterator(loader) as items:
            list(items)
        errors.append(str(info.value).splitlines()[-1])
    assert errors[0] == errors[1] and f"sample {key!r}" in errors[0] and said in errors[0]

    skip = ReadOptions(on_error="skip")
    slow = ShardDataset(str(out), batch_size=32, seed=17, read=skip, transform=lambda s: s)
    want = [(b["__key__"].tolist(), b["bin"].tolist(), b["__padded__"].tolist()) for b in slow]
    ds = ShardDataset(str(out), batch_size=32, seed=17, read=skip)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    got = [(b["__key__"].tolist(), b["bin"].tolist(), b["__padded__"].tolist()) for b in loader]
    assert got == want and sum(sum(p) for _, _, p in got) == 1  # the damaged sample, stood in for
