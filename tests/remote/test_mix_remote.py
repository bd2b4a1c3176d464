"""Mixtures of remote builds (moto S3 behind the latency proxy) read through the ShardStream stages.

Each source of a mixture reads its slot's pieces through ``ShardStream.reader`` with their read
plan: a remote source's reads are fetched ahead (coalesced, on the read-ahead threads) and through
its cache, and unreadable samples follow the source's ``on_error`` (skip: the batch comes out
short by them, with one warning naming the shard, the key, the source and the batch).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from loader import CorruptShardError, ReadOptions, RemoteOptions
from loader.compose.mix import MixedStream
from loader.core import ShardStream
from loader.io import source as source_module
from shardprep.format.manifest import read_manifest
from shardprep.format.shardformat import decode_index
from tests.remote.test_read_s3 import gets, read_ahead_threads
from tests.s3 import Proxy, S3Server

LATENCY_S = 0.002  # per client->server chunk: every GET pays a round trip
Batch = list[tuple[str, int, bytes]]


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_module, "BACKOFF_S", 0.01)


def _read(s3: S3Server, proxy: Proxy, on_error: str = "raise", **remote: Any) -> ReadOptions:
    options = RemoteOptions(storage_options=s3.storage_options(proxy.endpoint), **remote)
    return ReadOptions(on_error=on_error, remote=options)


def _mixture(tar: str, zstd: str, read: ReadOptions | None = None, **kw: Any) -> MixedStream:
    """tar class-balanced (200 of its 103 a lap: three laps, a reader each), zstd 400 of 1001."""
    sources = [ShardStream(tar, class_weights="balanced", read=read), ShardStream(zstd, read=read)]
    return MixedStream(sources, [1, 2], batch_size=10, samples_per_epoch=600, seed=3, **kw)


def _batches(mix: MixedStream, epoch: int = 0, **where: int) -> list[Batch]:
    return [
        list(zip(b["__key__"].tolist(), b["__source__"].tolist(), b["bin"].tolist(), strict=True))
        for b in mix.iterate(epoch, **where)
    ]


def _slots(mix: MixedStream) -> list[list[Batch]]:
    """Rank 1 of 2, both worker slots of 2, then slot 1 resumed after 2 batches (epoch 1)."""
    where = {"rank": 1, "world_size": 2, "num_workers": 2}
    return [_batches(mix, 1, worker=w, **where) for w in (0, 1)] + [
        _batches(mix, 1, worker=1, start=2, **where)
    ]


@pytest.mark.parametrize("batching", ["mixed", "per_source"])
def test_a_remote_mixture_reads_ahead_and_gives_the_local_batches(
    s3: S3Server,
    proxy: Proxy,
    uploaded: dict[str, str],
    built: Path,
    built_zstd: Path,
    batching: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy.latency = LATENCY_S
    local = _slots(_mixture(str(built), str(built_zstd), batching=batching))
    assert [len(s) for s in local] == [15, 15, 13] and local[2] == local[1][2:]
    assert sum(len(b) for s in local[:2] for b in s) == 300
    with caplog.at_level(logging.WARNING, logger="loader.io.readahead"):
        before = len(proxy.requests)
        ahead = _mixture(uploaded["tar"], uploaded["zstd"], _read(s3, proxy), batching=batching)
        assert _slots(ahead) == local
        middle = len(proxy.requests)
        direct = _mixture(
            uploaded["tar"], uploaded["zstd"], _read(s3, proxy, read_ahead_bytes=0),
            batching=batching,
        )  # fmt: skip
        assert _slots(direct) == local
    # every read was the planned next one (a plan that diverges is read directly, with a warning)
    assert not [r for r in caplog.records if "not the planned" in r.getMessage()]
    assert read_ahead_threads() == []
    # one slot reads adjacent pieces in turn: direct, one GET each; ahead, coalesced
    data = (".tar", ".tar.zst")
    assert gets(proxy, before, data, until=middle) < gets(proxy, middle, data)
    before = len(proxy.requests)
    assert _batches(ahead) == _batches(_mixture(str(built), str(built_zstd), batching=batching))
    middle = len(proxy.requests)
    assert _batches(direct) == _batches(_mixture(str(built), str(built_zstd), batching=batching))
    ahead_gets, direct_gets = gets(proxy, before, data, until=middle), gets(proxy, middle, data)
    assert direct_gets >= 3 * ahead_gets, (ahead_gets, direct_gets)


def test_a_remote_mixture_reads_through_the_cache(
    s3: S3Server,
    proxy: Proxy,
    uploaded: dict[str, str],
    built: Path,
    built_zstd: Path,
    tmp_path: Path,
) -> None:
    local = _slots(_mixture(str(built), str(built_zstd)))
    read = _read(s3, proxy, cache_dir=str(tmp_path / "cache"))
    assert _slots(_mixture(uploaded["tar"], uploaded["zstd"], read)) == local
    cached = {p.name for p in (tmp_path / "cache").rglob("shard-*") if p.is_file()}
    assert {n for n in cached if n.endswith((".tar", ".tar.zst"))}, cached
    before = len(proxy.requests)
    assert _slots(_mixture(uploaded["tar"], uploaded["zstd"], read)) == local
    assert gets(proxy, before) == 0  # shards and indexes all from the cache


def _damage(s3: S3Server, bucket: str, built: Path, key: str) -> tuple[str, str]:
    """``built`` uploaded to ``bucket/damaged`` with one byte of sample ``key``'s data flipped.

    Returns the damaged shard's URL and the output's URL.
    """
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
    fs.put(str(built), f"{bucket}/damaged", recursive=True)
    for entry in read_manifest(str(built)).shards:
        index = decode_index((built / entry.index_file).read_bytes())
        keys = [index.key(i) for i in range(index.num_samples)]
        if key in keys:
            at = int(index.sample_offset[keys.index(key)]) + 512 + 3  # past the first header
            data = bytearray((built / entry.file).read_bytes())
            data[at] ^= 0xFF
            fs.pipe(f"{bucket}/damaged/{entry.file}", bytes(data))
            return f"s3://{bucket}/damaged/{entry.file}", f"s3://{bucket}/damaged"
    raise AssertionError(f"no sample {key} in {built}")


def test_skip_in_a_remote_mixture_leaves_the_batch_short_and_warns_once(
    s3: S3Server,
    proxy: Proxy,
    bucket: str,
    uploaded: dict[str, str],
    built: Path,
    built_zstd: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy.latency = LATENCY_S

    def make(tar: str, zstd: str, read: ReadOptions | None = None) -> MixedStream:
        # 100 of tar's 103 (each once), 100 of zstd's 1001, batches of 10 mixing both
        sources = [ShardStream(tar, read=read), ShardStream(zstd, read=read)]
        return MixedStream(sources, [1, 1], batch_size=10, samples_per_epoch=200, seed=5)

    local = _batches(make(str(built), str(built_zstd)))
    assert len(local) == 20
    hit = 7  # damage a tar sample of batch 7
    key = next(k for k, s, _ in local[hit] if s == 0)
    shard_url, damaged = _damage(s3, bucket, built, key)

    with pytest.raises(CorruptShardError, match=rf"{shard_url}: sample '{key}'"):
        _batches(make(damaged, uploaded["zstd"], _read(s3, proxy)))

    with caplog.at_level(logging.WARNING):
        got = _batches(make(damaged, uploaded["zstd"], _read(s3, proxy, on_error="skip")))
    assert len(got) == 20
    assert [b for j, b in enumerate(got) if j != hit] == [
        b for j, b in enumerate(local) if j != hit
    ]
    assert len(got[hit]) == 9
    assert sorted(got[hit]) == sorted(s for s in local[hit] if s[0] != key)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(
        f"skipping 1 sample(s) (mixture source 0: batch {hit} comes out short by them): "
        f"{shard_url}: sample '{key}' at offset "
    ), warnings
    # the same again: deterministic
    assert _batches(make(damaged, uploaded["zstd"], _read(s3, proxy, on_error="skip"))) == got


def test_remote_rank_groups_read_ahead_and_give_the_local_batches(
    s3: S3Server,
    proxy: Proxy,
    uploaded: dict[str, str],
    built: Path,
    built_zstd: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from loader.compose.groups import GroupedStream

    def make(tar: str, zstd: str, read: ReadOptions | None = None) -> GroupedStream:
        sources = [ShardStream(tar, read=read), ShardStream(zstd, read=read)]
        return GroupedStream(list(zip(sources, [[0], [1, 2]], strict=True)), batch_size=8,
                             steps_per_epoch=30)  # fmt: skip

    def keys(grouped: GroupedStream) -> list[list[list[str]]]:
        return [[b["__key__"].tolist() for b in grouped.iterate(1, rank=r)] for r in range(3)]

    local = keys(make(str(built), str(built_zstd)))
    assert [len(r) for r in local] == [30, 30, 30]
    before = len(proxy.requests)
    with caplog.at_level(logging.WARNING, logger="loader.io.readahead"):
        assert keys(make(uploaded["tar"], uploaded["zstd"], _read(s3, proxy))) == local
    assert not [r for r in caplog.records if "not the planned" in r.getMessage()]
    middle = len(proxy.requests)
    assert (
        keys(make(uploaded["tar"], uploaded["zstd"], _read(s3, proxy, read_ahead_bytes=0))) == local
    )
    data = (".tar", ".tar.zst")
    assert 3 * gets(proxy, before, data, until=middle) <= gets(proxy, middle, data)
