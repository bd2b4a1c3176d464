"""The batch assembler (``loader.torch.assemble``) makes exactly the batches the per-sample path
makes (per-sample dicts joined by ``collate_samples``, forced here with an identity
``transform``): same fields in the same order, same keys, flags, weights, payload bytes and
offsets, same positions; and a damaged member raises the same error, naming the sample."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardprep
from loader import CorruptShardError, ReadOptions, ShardDataset
from loader.torch.batch import Packed
from shardprep.format.shardformat import decode_index


def _same(ds_kwargs: dict[str, Any], out: Path, epochs: int = 2) -> int:
    """Assert fast == reference batch by batch over ``epochs``; return the batches compared."""
    compared = 0
    for epoch in range(epochs):
        fast = ShardDataset(str(out), **ds_kwargs)
        slow = ShardDataset(str(out), transform=lambda s: s, **ds_kwargs)
        fast.set_epoch(epoch)
        slow.set_epoch(epoch)
        got, want = list(fast), list(slow)
        assert len(got) == len(want) == len(fast)
        for a, b in zip(got, want, strict=True):
            assert list(a) == list(b)  # same fields, same order
            for field in a:
                x, y = a[field], b[field]
                if isinstance(x, Packed):
                    assert torch.equal(x.data, y.data) and torch.equal(x.offsets, y.offsets)
                elif isinstance(x, torch.Tensor):
                    assert x.dtype == y.dtype and torch.equal(x, y)
                elif isinstance(x, np.ndarray):
                    assert x.tolist() == y.tolist()
                else:
                    assert x == y
            compared += 1
    return compared


@pytest.mark.parametrize("batch_size", [1, 7, 64, 103])
@pytest.mark.parametrize("window", [5, 40, 8192])
def test_plain_batches_equal_the_sample_path(built: Path, batch_size: int, window: int) -> None:
    # blocks of 4: a window holds many chunks; windows of 5 samples: most batches span windows
    kwargs = {"batch_size": batch_size, "shuffle_buffer": window, "block_size": 4}
    assert _same(kwargs, built) == 2 * -(-103 // batch_size)


def test_zstd_uneven_ranks_and_unchecked_batches_equal_the_sample_path(built_zstd: Path) -> None:
    for kwargs in (
        {"batch_size": 16, "rank": 2, "world_size": 3, "uneven": "pad"},
        {"batch_size": 16, "read": ReadOptions(checksums=False)},
        {"batch_size": 33, "shuffle": False, "drop_last": True},
    ):
        assert _same(kwargs, built_zstd) > 0


@pytest.mark.parametrize("resample", [True, False])
def test_reweighted_batches_equal_the_sample_path(built: Path, resample: bool) -> None:
    kwargs = {"batch_size": 10, "class_weights": "balanced", "resample": resample}
    assert _same(kwargs, built) > 0
    if not resample:  # the weights travel as a float64 tensor
        batch = next(iter(ShardDataset(str(built), **kwargs)))
        assert batch["__weight__"].dtype == torch.float64


def test_samples_with_different_members_fall_back_to_the_sample_path(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(40):
        (raw / f"{i:03d}.jpg").write_bytes(bytes([i]) * (i + 1))
        if i % 3 == 0:
            (raw / f"{i:03d}.txt").write_bytes(b"caption %d" % i)  # some samples only
    out = tmp_path / "out"
    shardprep.build(str(raw), str(out), shards=3, workers=1, progress=False, input_format="keyed")
    assert _same({"batch_size": 8}, out) == 2 * 5
    # windows of 3 samples: every batch spans windows, its earlier samples carried as copies
    assert _same({"batch_size": 8, "shuffle_buffer": 3}, out) == 2 * 5
    batches = list(ShardDataset(str(out), batch_size=8, shuffle=False))
    assert any(isinstance(b["txt"], list) and None in b["txt"] for b in batches)


@pytest.mark.parametrize(
    ("sample", "window", "where"),
    [(5, 8192, "_assemble"), (1, 3, "carry"), (5, 3, "_assemble")],
)
def test_a_damaged_member_raises_what_the_sample_path_raises(
    built: Path, tmp_path: Path, sample: int, window: int, where: str
) -> None:
    """With windows of 3 samples, batches of 8 span windows: sample 1 of shard 3 is damaged in
    a part carried to the next window (``Window.carry`` raises), sample 5 in a batch whose
    earlier samples are carried (the batch is made from sample dicts, ``Carried.sample``)."""
    out = tmp_path / "out"
    shutil.copytree(built, out)
    index = decode_index((out / "shard-00003.idx").read_bytes(), "idx")
    member = int(index.member_start[sample])
    with open(out / "shard-00003.tar", "r+b") as f:
        f.seek(int(index.member_offset[member]) + 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    errors = []
    for kwargs in ({"batch_size": 8}, {"batch_size": 8, "transform": lambda s: s}):
        kwargs["shuffle_buffer"] = window
        with pytest.raises(CorruptShardError) as info:
            list(ShardDataset(str(out), **kwargs))
        errors.append(str(info.value))
        if "transform" not in kwargs:
            assert where in [entry.name for entry in info.traceback]
    assert errors[0] == errors[1]
    assert index.key(sample) in errors[0] and "checksum mismatch" in errors[0]
