"""The column path of ``loader.torch.assemble._fast`` (``_field``) against the per-sample path, on
fields it cuts differently: members of one tiny size (gathered per window), members that are
all empty (offsets of zero steps), and members of varied sizes, in batches within one window
and spanning windows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardprep
from loader import ShardDataset
from loader.torch.batch import Packed
from tests.integration.test_assemble import _same


@pytest.fixture(scope="module")
def odd_fields(tmp_path_factory: pytest.TempPathFactory) -> Path:
    raw = tmp_path_factory.mktemp("raw")
    for i in range(57):
        (raw / f"{i:03d}.bin").write_bytes(bytes([i % 251]) * (1 + i * 37 % 300))
        (raw / f"{i:03d}.cls").write_bytes(b"%d" % (i % 10))  # one byte each: fixed rows
        (raw / f"{i:03d}.nil").write_bytes(b"")  # empty each: fixed rows of zero bytes
    out = tmp_path_factory.mktemp("out") / "out"
    shardprep.build(str(raw), str(out), shards=3, workers=1, progress=False, input_format="keyed")
    return out


@pytest.mark.parametrize("window", [4, 8192])
@pytest.mark.parametrize("batch_size", [5, 16])
def test_tiny_empty_and_varied_fields_equal_the_sample_path(
    odd_fields: Path, window: int, batch_size: int
) -> None:
    kwargs = {"batch_size": batch_size, "shuffle_buffer": window, "block_size": 4}
    assert _same(kwargs, odd_fields) == 2 * -(-57 // batch_size)


def test_empty_members_pack_as_zero_offsets(odd_fields: Path) -> None:
    batches = list(ShardDataset(str(odd_fields), batch_size=16, shuffle=False))
    assert [len(b["__key__"]) for b in batches] == [16, 16, 16, 9]
    for b in batches:
        nil, cls = b["nil"], b["cls"]
        assert isinstance(nil, Packed) and isinstance(cls, Packed)
        n = len(b["__key__"])
        assert nil.data.numel() == 0 and torch.equal(
            nil.offsets, torch.zeros(n + 1, dtype=torch.int64)
        )
        assert torch.equal(cls.offsets, torch.arange(n + 1, dtype=torch.int64))
        assert cls.tolist() == [b"%d" % (int(k) % 10) for k in b["__key__"]]
