"""Shard indexes read and checked once, where the dataset is constructed (``loader.read.reader.
checked_indexes``): forked DataLoader workers inherit them instead of reading, hashing and
checking every index again; a spawned worker (the dataset pickled) reads its own; an index
that fails at construction is reported where it is read, as before."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch.utils.data

import loader.read.reader
from loader import ShardDataset
from loader.io.source import Source
from loader.read.reader import checked_indexes
from shardprep.format.errors import ChecksumMismatchError
from tests.processes import dataloader_iterator

BATCH = 8


def _loader(ds: ShardDataset, workers: int, context: str | None = None) -> Any:
    return torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=workers, multiprocessing_context=context
    )


def _keys(ds: ShardDataset, workers: int, context: str | None = None) -> list[list[str]]:
    return [b["__key__"].tolist() for b in _loader(ds, workers, context)]


@pytest.fixture
def out(built: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "out"
    shutil.copytree(built, copy)
    return copy


def _hide_indexes(out: Path) -> list[Path]:
    hidden = sorted(out.glob("*.idx"))
    assert len(hidden) == 8
    for f in hidden:
        f.rename(f.with_suffix(".gone"))
    return hidden


def test_forked_workers_use_the_indexes_checked_at_construction(out: Path) -> None:
    want = _keys(ShardDataset(str(out), batch_size=BATCH, seed=3), 2, "fork")
    want0 = _keys(ShardDataset(str(out), batch_size=BATCH, seed=3), 0)
    ds = ShardDataset(str(out), batch_size=BATCH, seed=3)
    assert sorted(ds.stream._indexes) == list(range(8))  # type: ignore[attr-defined]
    _hide_indexes(out)  # the workers never read an index file: they inherit the checked ones
    assert _keys(ds, 2, "fork") == want
    assert sum(len(k) for k in want) == 103 and len(want) == len(ds)
    assert _keys(ds, 0) == want0  # in process too


def test_a_spawned_worker_reads_and_checks_its_own_indexes(out: Path) -> None:
    ds = ShardDataset(str(out), batch_size=BATCH, seed=3)
    hidden = _hide_indexes(out)
    with (
        pytest.raises(Exception, match=r"shard-\d{5}\.idx: cannot read") as caught,
        dataloader_iterator(_loader(ds, 1, "spawn")) as batches,
    ):
        next(batches)
    assert any(f.name in str(caught.value) for f in hidden)


def test_an_index_failing_at_construction_is_reported_where_it_is_read(out: Path) -> None:
    damaged = out / "shard-00003.idx"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    ds = ShardDataset(str(out), batch_size=BATCH, seed=3)  # constructing does not raise
    assert sorted(ds.stream._indexes) == [0, 1, 2, 4, 5, 6, 7]  # type: ignore[attr-defined]
    with pytest.raises(ChecksumMismatchError, match="shard-00003.idx"):
        _keys(ds, 0)


def test_indexes_over_the_budget_are_not_shared(out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = Source(str(out))
    manifest = source.manifest()
    assert sorted(checked_indexes(source, manifest)) == list(range(8))
    total = sum(e.index_bytes for e in manifest.shards)
    monkeypatch.setattr(loader.read.reader, "SHARED_INDEX_BYTES", total - 1)  # the files' bytes
    assert checked_indexes(source, manifest) == {}
    monkeypatch.setattr(loader.read.reader, "SHARED_INDEX_BYTES", total)
    assert len(checked_indexes(source, manifest)) == 8
    monkeypatch.setattr(loader.read.reader, "INDEX_CACHE_BYTES", 1000)  # their slimmed bytes
    assert checked_indexes(source, manifest) == {}


def test_the_indexes_are_checked_on_threads_that_are_gone_once_constructed(
    out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second thread reads and hashes the next index file while the last one is checked
    (sha256 lets the GIL go); it is gone once the dataset is made (a DataLoader forks its
    workers after), and an index failing its sha256 is left out as before."""
    import threading

    names: set[str] = set()
    load = loader.read.reader.ShardReader._hashed_index

    def spy(self: loader.read.reader.ShardReader, shard: int) -> Any:
        names.add(threading.current_thread().name)
        return load(self, shard)

    monkeypatch.setattr(loader.read.reader.ShardReader, "_hashed_index", spy)
    bad = sorted(out.glob("*.idx"))[5]
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))  # fails its sha256
    found = checked_indexes(Source(str(out)), ShardDataset(str(out)).manifest)
    assert sorted(found) == [0, 1, 2, 3, 4, 6, 7]
    assert len(names) == 1 and next(iter(names)).startswith("shardprep-index"), names
    assert not [t for t in threading.enumerate() if t.name.startswith("shardprep-index")]
