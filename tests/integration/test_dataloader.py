"""ShardDataset through torch's DataLoader: exactly-once epochs, determinism, resume, errors."""

from __future__ import annotations

import os
import pickle
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.utils.data

from loader import CorruptShardError, IncompatibleStateError, ShardDataset
from loader import read as read_module
from shardprep.errors import ChecksumMismatchError, ManifestError
from shardprep.manifest import read_manifest
from shardprep.shardformat import decode_index
from tests.conftest import payload


def keys_of(batch: list[dict[str, Any]]) -> list[str]:
    return [s["__key__"] for s in batch]


def collate(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return batch


def run(ds: ShardDataset, workers: int, batch_size: int = 4, **kw: Any) -> list[list[str]]:
    loader = torch.utils.data.DataLoader(
        ds, batch_size=batch_size, num_workers=workers, collate_fn=collate, **kw
    )
    return [keys_of(b) for b in loader]


def all_keys(out: Path) -> list[str]:
    keys = []
    for entry in read_manifest(str(out)).shards:
        index = decode_index((out / entry.index_file).read_bytes())
        keys += [index.key(i) for i in range(index.num_samples)]
    return keys


@pytest.mark.parametrize("workers", [0, 2])
def test_epoch_yields_every_sample_once_with_its_bytes(built: Path, workers: int) -> None:
    ds = ShardDataset(str(built))
    loader = torch.utils.data.DataLoader(ds, batch_size=5, num_workers=workers, collate_fn=collate)
    samples = [s for batch in loader for s in batch]
    assert len(samples) == len(ds) == 103
    assert sorted(s["__key__"] for s in samples) == sorted(all_keys(built))
    classes = {"a": 0, "b": 1, "c": 2}
    for s in samples:
        cls, index = s["__key__"].split("__")
        assert s["bin"] == payload(classes[cls], int(index))
        assert s["cls"] == str(classes[cls]).encode()
        assert s["__padded__"] is False


def test_order_is_deterministic_and_changes_per_epoch_and_seed(built: Path) -> None:
    first = run(ShardDataset(str(built), shuffle_buffer=16), workers=2)
    assert run(ShardDataset(str(built), shuffle_buffer=16), workers=2) == first
    other_seed = run(ShardDataset(str(built), seed=1, shuffle_buffer=16), workers=2)
    ds = ShardDataset(str(built), shuffle_buffer=16)
    ds.set_epoch(1)
    next_epoch = run(ds, workers=2)
    assert next_epoch != first and other_seed != first
    flat = sorted(k for b in first for k in b)
    assert (
        sorted(k for b in next_epoch for k in b) == flat == sorted(k for b in other_seed for k in b)
    )


def test_no_shuffle_streams_shards_in_order(built: Path) -> None:
    keys = [k for b in run(ShardDataset(str(built), shuffle=False), workers=0) for k in b]
    assert keys == all_keys(built)


def test_persistent_workers_follow_set_epoch(built: Path) -> None:
    expected = []
    for epoch in range(3):
        ds = ShardDataset(str(built), shuffle_buffer=8)
        ds.set_epoch(epoch)
        expected.append(run(ds, workers=2))
    ds = ShardDataset(str(built), shuffle_buffer=8)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=4, num_workers=2, collate_fn=collate, persistent_workers=True
    )
    for epoch in range(3):
        ds.set_epoch(epoch)
        assert [keys_of(b) for b in loader] == expected[epoch]


@pytest.mark.parametrize("workers", [0, 1, 3])
@pytest.mark.parametrize("fixture", ["built", "built_zstd"])
def test_resume_yields_exactly_the_remaining_batches(
    fixture: str, workers: int, request: pytest.FixtureRequest
) -> None:
    out = request.getfixturevalue(fixture)
    options = {"shuffle_buffer": 23, "block_size": 16}
    ds = ShardDataset(str(out), **options)
    ds.set_epoch(2)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=collate)
    batches = [keys_of(b) for b in loader]
    for k in sorted({0, 1, 5, len(batches) // 2, len(batches) - 1, len(batches)}):
        state = ds.state_dict(k, loader)
        assert pickle.loads(pickle.dumps(state)) == state
        resumed = ShardDataset(str(out), **options)
        resumed.load_state_dict(state)
        assert resumed.epoch == 2
        assert run(resumed, workers) == batches[k:], f"resume after {k} batches"


def test_resume_does_not_reread_consumed_windows(
    built_zstd: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read_samples = []
    original = read_module.ShardReader.read

    def counting(self: read_module.ShardReader, piece: Any) -> Any:
        read_samples.append(len(piece))
        return original(self, piece)

    monkeypatch.setattr(read_module.ShardReader, "read", counting)
    ds = ShardDataset(str(built_zstd), shuffle_buffer=50)
    loader = torch.utils.data.DataLoader(ds, batch_size=10, collate_fn=collate)
    state = ds.state_dict(90, loader)  # 900 of 1001 samples consumed
    read_samples.clear()
    resumed = ShardDataset(str(built_zstd), shuffle_buffer=50)
    resumed.load_state_dict(state)
    assert sum(len(b) for b in run(resumed, 0, batch_size=10)) == 101
    assert sum(read_samples) <= 101 + 50, "resume re-read more than the window it lands in"


def test_resume_state_checks(built: Path, built_zstd: Path) -> None:
    ds = ShardDataset(str(built))
    state = ds.state_dict(3)
    with pytest.raises(IncompatibleStateError, match="seed"):
        ShardDataset(str(built), seed=5).load_state_dict(state)
    with pytest.raises(IncompatibleStateError, match="manifest"):
        ShardDataset(str(built_zstd)).load_state_dict(state)
    with pytest.raises(IncompatibleStateError, match="world_size"):
        ShardDataset(str(built), rank=0, world_size=2).load_state_dict(state)
    resumed = ShardDataset(str(built))
    resumed.load_state_dict(state)  # saved with num_workers=0 → 1 slot
    with pytest.raises(IncompatibleStateError, match="num_workers"):
        run(resumed, workers=2)


def test_loaded_state_applies_to_its_epoch_only(built: Path) -> None:
    ds = ShardDataset(str(built))
    state = ds.state_dict(50)
    ds.load_state_dict(state)
    assert sum(map(len, run(ds, 0))) == 53
    ds.set_epoch(1)
    assert sum(map(len, run(ds, 0))) == 103


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_pad_counts_every_sample_once_across_ranks(built: Path, world_size: int) -> None:
    real: list[str] = []
    padded = 0
    for rank in range(world_size):
        ds = ShardDataset(str(built), uneven="pad", rank=rank, world_size=world_size)
        loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=collate)
        samples = [s for b in loader for s in b]
        assert len(samples) == len(ds) == -(-103 // world_size)
        real += [s["__key__"] for s in samples if not s["__padded__"]]
        padded += sum(s["__padded__"] for s in samples)
    assert sorted(real) == sorted(all_keys(built))
    assert padded == world_size * -(-103 // world_size) - 103


def test_shuffle_quality(built_zstd: Path) -> None:
    """Class mix per batch follows the dataset; epoch position is uncorrelated with shard position."""
    keys = all_keys(built_zstd)
    build_position = {k: i for i, k in enumerate(keys)}
    ds = ShardDataset(str(built_zstd), decode=True)
    samples = [
        s for b in torch.utils.data.DataLoader(ds, batch_size=50, collate_fn=collate) for s in b
    ]
    positions = np.array([build_position[s["__key__"]] for s in samples])
    rho = np.corrcoef(np.argsort(np.argsort(positions)), np.arange(len(positions)))[0, 1]
    assert abs(rho) < 0.15
    labels = np.array([s["cls"] for s in samples[:1000]]).reshape(20, 50)
    dataset_share = np.array([600, 300, 101]) / 1001
    batch_share = np.stack([(labels == c).mean(axis=1) for c in range(3)], axis=1)
    assert np.abs(batch_share - dataset_share).max() < 0.25
    assert np.abs(batch_share.mean(axis=0) - dataset_share).max() < 0.02


def test_init_opens_nothing_and_pickles(built: Path) -> None:
    fds = len(os.listdir("/proc/self/fd"))
    threads = threading.active_count()
    ds = ShardDataset(str(built))
    assert len(os.listdir("/proc/self/fd")) == fds
    assert threading.active_count() == threads
    clone = pickle.loads(pickle.dumps(ds))
    assert len(clone) == len(ds)
    assert [s["__key__"] for s in clone] == [s["__key__"] for s in ds]


def test_decode_and_pickle_refusal(built: Path, tmp_path: Path) -> None:
    sample = next(iter(ShardDataset(str(built), decode=True)))
    assert isinstance(sample["cls"], int)
    from loader.decode import make_decoder

    decode = make_decoder(True)
    assert decode is not None
    with pytest.raises(ValueError, match="allow_pickle"):
        decode({"__key__": "k", "pth": b"\x80\x04N."})
    trusted = make_decoder(True, allow_pickle=True)
    assert trusted is not None
    assert trusted({"__key__": "k", "pickle": pickle.dumps([1, 2])})["pickle"] == [1, 2]


def _copy(out: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(out, target)
    return target


def test_truncated_shard_names_shard_key_and_offset(built: Path, tmp_path: Path) -> None:
    out = _copy(built, tmp_path)
    shard = out / "shard-00003.tar"
    shard.write_bytes(shard.read_bytes()[:5000])
    with pytest.raises(CorruptShardError, match="shard-00003.tar") as info:
        list(ShardDataset(str(out), shuffle=False))
    assert info.value.key and info.value.offset >= 0
    assert "truncated" in str(info.value)


def test_skip_policy_keeps_counts_and_flags_substitutes(built: Path, tmp_path: Path) -> None:
    out = _copy(built, tmp_path)
    shard = out / "shard-00003.tar"
    shard.write_bytes(shard.read_bytes()[:5000])
    samples = list(ShardDataset(str(out), on_error="skip", block_size=4))
    assert len(samples) == 103
    missing = set(all_keys(built)) - {s["__key__"] for s in samples if not s["__padded__"]}
    assert 0 < len(missing) <= 13
    assert sum(s["__padded__"] for s in samples) == len(missing)


def test_verify_detects_flipped_byte(built: Path, tmp_path: Path) -> None:
    out = _copy(built, tmp_path)
    shard = out / "shard-00000.tar"
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF
    shard.write_bytes(bytes(data))
    # every sample's checksum is checked by default: the damaged one is named
    with pytest.raises(CorruptShardError, match="checksum mismatch") as info:
        list(ShardDataset(str(out)))
    index = decode_index((out / "shard-00000.idx").read_bytes())
    damaged = int(np.searchsorted(index.sample_offset, 700, side="right")) - 1
    assert (info.value.key, info.value.offset) == (
        index.key(damaged),
        int(index.sample_offset[damaged]),
    )
    with pytest.raises(ChecksumMismatchError, match="shard-00000.tar"):
        list(ShardDataset(str(out), verify=True))


def test_missing_manifest_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="no manifest"):
        ShardDataset(str(tmp_path))


def test_reads_file_urls_and_fsspec_filesystems(built: Path) -> None:
    expected = [s["__key__"] for s in ShardDataset(str(built))]
    assert [s["__key__"] for s in ShardDataset(f"file://{built}")] == expected
    fsspec = pytest.importorskip("fsspec")
    memory = fsspec.filesystem("memory")
    for path in built.iterdir():
        memory.pipe(f"/remote-out/{path.name}", path.read_bytes())
    try:
        remote = ShardDataset("memory://remote-out")
        samples = list(remote)
        assert [s["__key__"] for s in samples] == expected
        assert samples[0]["bin"] == next(iter(ShardDataset(str(built))))["bin"]
    finally:
        memory.rm("/remote-out", recursive=True)


def test_transient_read_errors_are_retried(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loader import source as source_module

    monkeypatch.setattr(source_module, "BACKOFF_S", 0.0)
    failures = {"left": 2}
    original = source_module.Source.open

    def flaky(self: source_module.Source, name: str, *args: Any) -> Any:
        if name.endswith(".idx") and failures["left"]:
            failures["left"] -= 1
            raise ConnectionError("simulated network hiccup")
        return original(self, name, *args)

    monkeypatch.setattr(source_module.Source, "open", flaky)
    assert len(list(ShardDataset(str(built)))) == 103
    assert failures["left"] == 0
