"""ShardDataset through torch's DataLoader: exactly-once epochs, determinism, resume, errors."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.utils.data

from loader import CorruptShardError, IncompatibleStateError, ReadOptions, ShardDataset
from loader.read import reader as read_module
from loader.torch.batch import Packed
from shardprep.format.errors import ChecksumMismatchError, ManifestError
from shardprep.format.manifest import read_manifest
from shardprep.format.shardformat import decode_index
from tests.conftest import payload
from tests.processes import dataloader_iterator, run_bounded


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
    assert len(samples) == ds.num_samples == 103
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


def batch_keys(loader: Any) -> list[list[str]]:
    return [list(b["__key__"]) for b in loader]


def batch_loader(ds: ShardDataset, workers: int, **kw: Any) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, **kw)


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
@pytest.mark.parametrize(
    ("world_size", "batch_size", "drop_last"),
    [(1, 4, False), (2, 7, False), (3, 5, True), (2, 64, False)],
)
def test_len_is_exactly_the_batches_delivered(
    built: Path, workers: int, world_size: int, batch_size: int, drop_last: bool
) -> None:
    """len(loader) == batches that arrive, on every rank; only the epoch's last batch is partial."""
    seen: list[str] = []
    for rank in range(world_size):
        ds = ShardDataset(
            str(built), batch_size=batch_size, drop_last=drop_last, rank=rank, world_size=world_size
        )
        loader = batch_loader(ds, workers)
        batches = batch_keys(loader)
        per_rank = 103 // world_size
        expected = per_rank // batch_size if drop_last else -(-per_rank // batch_size)
        assert len(loader) == len(ds) == len(batches) == expected
        assert all(len(b) == batch_size for b in batches[:-1])
        assert len(batches[-1]) == (
            batch_size if drop_last else per_rank - (expected - 1) * batch_size
        )
        seen += [k for b in batches for k in b]
    assert len(seen) == len(set(seen))
    dropped = (103 % world_size) + (world_size * (per_rank % batch_size) if drop_last else 0)
    assert len(seen) == 103 - dropped


def test_batches_collate_decoded_fields_into_tensors(built: Path) -> None:
    ds = ShardDataset(str(built), batch_size=8, decode=True, shuffle=False)
    batch = next(iter(batch_loader(ds, 0)))
    assert batch["cls"].dtype == torch.int64 and batch["cls"].shape == (8,)
    assert batch["__padded__"].dtype == torch.bool and not batch["__padded__"].any()
    assert isinstance(batch["bin"], Packed) and batch["bin"].data.dtype == torch.uint8
    classes = {"a": 0, "b": 1, "c": 2}
    assert batch["bin"].tolist() == [
        payload(classes[k.split("__")[0]], int(k.split("__")[1])) for k in batch["__key__"]
    ]
    assert batch["__position__"] == {"epoch": 0, "batch": 0, "num_workers": 1}
    keys = all_keys(built)[:8]
    assert isinstance(batch["__key__"], np.ndarray) and batch["__key__"].tolist() == keys


def test_a_dataloader_batch_size_on_a_batching_dataset_is_refused(built: Path) -> None:
    loader = torch.utils.data.DataLoader(ShardDataset(str(built), batch_size=8), batch_size=4)
    with pytest.raises(TypeError, match="batch_size=None"):
        next(iter(loader))


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("stateful", [False, True], ids=["DataLoader", "StatefulDataLoader"])
def test_double_batching_is_refused_whatever_the_collate_fn(
    built: Path, num_workers: int, stateful: bool
) -> None:
    """A custom collate_fn used to be handed lists of our batches (len 1, 2, ... delivered)."""
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader as make
    else:
        make = torch.utils.data.DataLoader
    ds = ShardDataset(str(built), batch_size=8)
    loader = make(ds, batch_size=4, collate_fn=lambda items: items, num_workers=num_workers)
    with (
        pytest.raises(TypeError, match=r"it would batch batches.*batch_size=None"),
        dataloader_iterator(loader) as items,
    ):
        next(items)


def test_sample_mode_has_no_len_that_could_lie(built: Path) -> None:
    ds = ShardDataset(str(built))
    with pytest.raises(TypeError, match="batch_size"):
        len(ds)
    assert ds.num_samples == 103


@pytest.mark.parametrize(
    ("context", "persistent"),
    # spawn and forkserver matter for persistent workers (set_epoch must reach them); each
    # spawned worker imports torch, so the slow non-persistent variants are left to fork
    [("fork", False), ("fork", True), ("forkserver", True), ("spawn", True)],
)
def test_epoch_advances_by_itself_and_set_epoch_wins(
    built: Path, context: str, persistent: bool
) -> None:
    """Without set_epoch each pass is the next epoch, in every worker, for every start method."""
    options: dict[str, Any] = {"batch_size": 8, "shuffle_buffer": 8, "block_size": 8}
    expected = []
    for epoch in range(4):
        reference = ShardDataset(str(built), **options)
        reference.set_epoch(epoch)
        expected.append(batch_keys(batch_loader(reference, 2)))
    assert len({str(e) for e in expected}) == 4
    ds = ShardDataset(str(built), **options)
    loader = batch_loader(ds, 2, persistent_workers=persistent, multiprocessing_context=context)
    assert [batch_keys(loader) for _ in range(3)] == expected[:3]
    assert ds.epoch == 3
    ds.set_epoch(1)
    assert batch_keys(loader) == expected[1]
    assert batch_keys(loader) == expected[2]


def test_epoch_advances_in_process_and_for_samples(built: Path) -> None:
    ds = ShardDataset(str(built), shuffle_buffer=16)
    passes = [[s["__key__"] for s in ds] for _ in range(2)]
    again = ShardDataset(str(built), shuffle_buffer=16)
    again.set_epoch(1)
    assert passes[1] == [s["__key__"] for s in again] != passes[0]


RESUME_OPTIONS: dict[str, Any] = {"batch_size": 4, "shuffle_buffer": 23, "block_size": 16}


def _stateful(ds: ShardDataset, workers: int, persistent: bool) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(
        ds, batch_size=None, num_workers=workers, persistent_workers=persistent
    )


# every worker layout on the plain output; the zstd output (whose frames change what a window
# reads, not the loader's state) in process and across 3 persistent workers
@pytest.mark.parametrize(
    ("fixture", "workers", "persistent"),
    [
        ("built", 0, False),
        ("built", 1, False),
        ("built", 1, True),
        ("built", 3, False),
        ("built", 3, True),
        ("built_zstd", 0, False),
        ("built_zstd", 3, True),
    ],
)
def test_stateful_dataloader_resumes_exactly(
    fixture: str, workers: int, persistent: bool, request: pytest.FixtureRequest
) -> None:
    """torchdata: state after k batches (epoch 0 or 1) + a fresh loader = exactly the rest, then epoch 2."""
    out = str(request.getfixturevalue(fixture))
    reference = _stateful(ShardDataset(out, **RESUME_OPTIONS), workers, persistent)
    epochs = [batch_keys(reference) for _ in range(3)]
    assert epochs[0] != epochs[1]
    total = len(epochs[0])
    for epoch, k in [
        (0, 0),
        (0, 1),
        (0, 5),
        (0, total),
        (1, total // 2),
        (1, total - 1),
        (1, total),
    ]:
        loader = _stateful(ShardDataset(out, **RESUME_OPTIONS), workers, persistent)
        for _ in range(epoch):
            batch_keys(loader)
        iterator = iter(loader)
        for _ in range(k):
            next(iterator)
        state = json.loads(json.dumps(loader.state_dict()))
        del iterator
        fresh = _stateful(ShardDataset(out, **RESUME_OPTIONS), workers, persistent)
        fresh.load_state_dict(state)
        if k < total:
            assert batch_keys(fresh) == epochs[epoch][k:], f"epoch {epoch}, after {k} batches"
        else:  # saved after the last batch, never past it (as Lightning does): the next epoch
            assert batch_keys(fresh) == epochs[epoch + 1], f"epoch {epoch} complete"
        if epoch == 1 and k < total:
            assert batch_keys(fresh) == epochs[2], "the epoch after a resumed one"


def test_stateful_dataloader_resumes_in_a_fresh_process(built_zstd: Path, tmp_path: Path) -> None:
    out = str(built_zstd)
    loader = _stateful(ShardDataset(out, **RESUME_OPTIONS), 2, False)
    iterator = iter(loader)
    seen = [list(next(iterator)["__key__"]) for _ in range(9)]
    (tmp_path / "state.json").write_text(json.dumps(loader.state_dict()))
    del iterator
    script = f"""
import json, sys
from torchdata.stateful_dataloader import StatefulDataLoader
from loader import ShardDataset
loader = StatefulDataLoader(ShardDataset({out!r}, **{RESUME_OPTIONS!r}), batch_size=None, num_workers=2)
loader.load_state_dict(json.load(open({str(tmp_path / "state.json")!r})))
print(json.dumps([list(b["__key__"]) for b in loader]))
"""
    done = run_bounded([sys.executable, "-c", script], timeout=120)
    assert done.returncode == 0, done.stderr
    reference = batch_keys(_stateful(ShardDataset(out, **RESUME_OPTIONS), 2, False))
    assert seen + json.loads(done.stdout) == reference


def test_stateful_state_is_small_and_checked(built: Path) -> None:
    loader = _stateful(ShardDataset(str(built), **RESUME_OPTIONS), 0, False)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    assert len(json.dumps(state)) < 2000
    other = _stateful(ShardDataset(str(built), seed=3, **RESUME_OPTIONS), 0, False)
    other.load_state_dict(state)
    with pytest.raises(IncompatibleStateError, match="seed"):
        next(iter(other))


@pytest.mark.parametrize(
    ("fixture", "workers"), [("built", 0), ("built", 1), ("built", 3), ("built_zstd", 3)]
)
def test_plain_dataloader_resumes_from_the_last_batch(
    fixture: str, workers: int, request: pytest.FixtureRequest
) -> None:
    """state_after(batch) + resume(state): exactly the remaining batches, for any num_workers."""
    out = str(request.getfixturevalue(fixture))
    ds = ShardDataset(out, **RESUME_OPTIONS)
    ds.set_epoch(2)
    batches = list(batch_loader(ds, workers))
    keys = [list(b["__key__"]) for b in batches]
    for k in sorted({1, 5, len(batches) // 2, len(batches) - 1, len(batches)}):
        state = ds.state_after(batches[k - 1])
        assert json.loads(json.dumps(state)) == state
        resumed = ShardDataset(out, **RESUME_OPTIONS)
        resumed.resume(state)
        loader = batch_loader(resumed, workers)
        ds.set_epoch(3)
        epoch3 = batch_keys(batch_loader(ds, workers))
        ds.set_epoch(2)
        if k < len(batches):
            assert resumed.epoch == 2
            assert batch_keys(loader) == keys[k:], f"resume after {k} batches"
        else:  # saved on the epoch's last batch: the next pass is the next epoch
            assert resumed.epoch == 3
        assert batch_keys(loader) == epoch3, "next epoch is normal"


def test_resume_does_not_reread_consumed_windows(
    built_zstd: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read_samples = []
    original = read_module.ShardReader.read

    def counting(self: read_module.ShardReader, piece: Any) -> Any:
        read_samples.append(len(piece))
        return original(self, piece)

    monkeypatch.setattr(read_module.ShardReader, "read", counting)
    resumed = ShardDataset(str(built_zstd), batch_size=10, shuffle_buffer=50)
    resumed.resume({**resumed.fingerprint(1), "epoch": 0, "batches": 90})  # 900 of 1001 consumed
    assert sum(len(b["__key__"]) for b in batch_loader(resumed, 0)) == 101
    assert sum(read_samples) <= 101 + 50, "resume re-read more than the window it lands in"


def test_resume_state_checks(built: Path, built_zstd: Path) -> None:
    ds = ShardDataset(str(built), batch_size=4)
    state = ds.state_after(next(iter(batch_loader(ds, 0))))
    with pytest.raises(IncompatibleStateError, match="seed"):
        ShardDataset(str(built), batch_size=4, seed=5).resume(state)
    with pytest.raises(IncompatibleStateError, match="manifest"):
        ShardDataset(str(built_zstd), batch_size=4).resume(state)
    with pytest.raises(IncompatibleStateError, match="batch_size"):
        ShardDataset(str(built), batch_size=5).resume(state)
    with pytest.raises(IncompatibleStateError, match="history"):
        ShardDataset(str(built), batch_size=4).resume({**state, "history": [[1, 0, 2]]})
    with pytest.raises(IncompatibleStateError, match="batches"):
        ShardDataset(str(built), batch_size=4).resume({**state, "batches": 27})
    with pytest.raises(TypeError, match="state_after"):
        ds.state_after({"__key__": ["x"]})
    # Another num_workers (or world size) is an elastic resume: the rest of the epoch, re-split.
    resumed = ShardDataset(str(built), batch_size=4)
    resumed.resume({**state, "num_workers": 2})  # as if saved with 2 workers: slot 0 made 4
    assert sum(map(len, batch_keys(batch_loader(resumed, 0)))) == 103 - 4


def test_resumed_state_applies_to_its_epoch_only(built: Path) -> None:
    ds = ShardDataset(str(built), batch_size=4)
    ds.resume({**ds.fingerprint(1), "epoch": 0, "batches": 20})
    assert sum(map(len, batch_keys(batch_loader(ds, 0)))) == 23
    assert sum(map(len, batch_keys(batch_loader(ds, 0)))) == 103  # epoch 1: whole
    ds.resume({**ds.fingerprint(1), "epoch": 0, "batches": 20})
    ds.set_epoch(1)
    assert sum(map(len, batch_keys(batch_loader(ds, 0)))) == 103


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_pad_counts_every_sample_once_across_ranks(built: Path, world_size: int) -> None:
    real: list[str] = []
    padded = 0
    for rank in range(world_size):
        ds = ShardDataset(str(built), uneven="pad", rank=rank, world_size=world_size)
        loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=collate)
        samples = [s for b in loader for s in b]
        assert len(samples) == ds.num_samples == -(-103 // world_size)
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


def _open_files() -> dict[str, str]:
    links = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            links[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the listing's own descriptor, closed by now
            continue
    return links


def test_init_opens_nothing_and_pickles(built: Path) -> None:
    """No shard, no thread: only the epoch counters' shared page, already unlinked from /dev/shm."""
    before = _open_files()
    threads = threading.active_count()
    ds = ShardDataset(str(built))
    new = [link for fd, link in _open_files().items() if fd not in before]
    assert len(new) == 1 and new[0].startswith("/dev/shm/") and new[0].endswith("(deleted)")
    assert threading.active_count() == threads
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.num_samples == ds.num_samples
    assert [s["__key__"] for s in clone] == [s["__key__"] for s in ds]


def test_decode_and_pickle_refusal(built: Path, tmp_path: Path) -> None:
    sample = next(iter(ShardDataset(str(built), decode=True)))
    assert isinstance(sample["cls"], int)
    from loader.read.decode import make_decoder

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
    samples = list(ShardDataset(str(out), read=ReadOptions(on_error="skip"), block_size=4))
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
        list(ShardDataset(str(out), read=ReadOptions(verify=True)))


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
    from loader.io import source as source_module

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


def _flat_batches(loader: Any) -> list[tuple[str, bytes, bool]]:
    return [
        (str(key), data, bool(pad))
        for b in loader
        for key, data, pad in zip(b["__key__"], b["bin"].tolist(), b["__padded__"], strict=True)
    ]


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_batch_path_delivers_what_the_sample_path_does(built_zstd: Path, workers: int) -> None:
    """Same samples and payload bytes; the same order with one worker slot (0 or 1 workers)."""
    out = str(built_zstd)
    batched = _flat_batches(batch_loader(ShardDataset(out, batch_size=16), workers))
    samples = [
        (s["__key__"], s["bin"], s["__padded__"])
        for s in torch.utils.data.DataLoader(
            ShardDataset(out), batch_size=None, num_workers=workers
        )
    ]
    assert len(batched) == len(samples) == 1001
    if workers <= 1:
        assert batched == samples
    else:  # the worker slots are cut at whole batches here, evenly there
        assert sorted(batched) == sorted(samples)


def test_batches_cross_through_the_workers_ring_whatever_their_size(built_zstd: Path) -> None:
    """A worker hands a payload tensor of 1 MiB or more over through shared memory (its ring,
    ``loader.torch.arena``; or a fresh segment), never one socket round trip per tensor; a batch of
    small samples crosses whole through the ring too (payloads, offsets, keys and flags in one
    slot, ``loader.torch.batch.Crossing``), only a small header pickled."""
    from loader.torch import arena
    from loader.torch.batch import SHARE_BYTES

    for batch_size, shared in ((8, False), (1001, True)):
        arena._received.clear()
        # one window holds the epoch (17 MiB): a batch spanning windows is made from samples
        ds = ShardDataset(str(built_zstd), batch_size=batch_size, shuffle_buffer_bytes=32 << 20)
        loader = batch_loader(ds, 1)
        batch = next(iter(loader))
        assert (batch["bin"].data.numel() >= SHARE_BYTES) is shared
        if arena.RINGS:  # through the worker's ring, which the first batch brought along
            assert len(arena._received) == 1
            assert not batch["bin"].data.is_shared()
        else:
            assert batch["bin"].data.is_shared() is shared
        assert not batch["bin"].offsets.is_shared() and not batch["__padded__"].is_shared()
    fresh = batch_loader(ShardDataset(str(built_zstd), batch_size=1001), 1)
    reference = _flat_batches(batch_loader(ShardDataset(str(built_zstd), batch_size=1001), 0))
    assert _flat_batches(fresh) == reference
