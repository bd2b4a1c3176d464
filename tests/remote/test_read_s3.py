"""Reading from a real S3 server (moto on 127.0.0.1): read-ahead, the local cache, storage_options.

Requests are counted by the proxy in front of the server (``Proxy.requests``),
so "no request" and "one download" are observed on the wire.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch.utils.data

from loader import CorruptShardError, ReadOptions, RemoteOptions, ShardDataset
from loader.io import cache as cache_module
from loader.io import source as source_module
from loader.io.cache import ShardCache
from loader.io.cachedir import cache_bytes
from loader.io.readahead import THREAD_NAME
from loader.io.source import Source
from tests.distributed.harness import run_ranks
from tests.distributed.ranks import OPTIONS
from tests.processes import run_bounded
from tests.remote.ranks import read_s3
from tests.s3 import Proxy, S3Server

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_module, "BACKOFF_S", 0.01)


def remote(s3: S3Server, proxy: Proxy, **kw: Any) -> ReadOptions:
    return ReadOptions(
        remote=RemoteOptions(storage_options=s3.storage_options(proxy.endpoint), **kw)
    )


def samples(ds: ShardDataset) -> list[tuple[str, bytes]]:
    return [(s["__key__"], s["bin"]) for s in ds]


def batches(ds: ShardDataset, stop: int | None = None) -> list[list[tuple[str, bytes]]]:
    out = []
    for i, b in enumerate(ds):
        out.append(list(zip(b["__key__"].tolist(), b["bin"].tolist(), strict=True)))
        if i == stop:
            break
    return out


def read_ahead_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]


def gets(
    proxy: Proxy,
    since: int = 0,
    suffix: tuple[str, ...] = (".tar", ".tar.zst", ".idx"),
    until: int | None = None,
) -> int:
    """GET requests for files ending in ``suffix`` among ``proxy.requests[since:until]``."""
    lines = [r.split("?")[0] for r in proxy.requests[since:until]]
    return sum(1 for r in lines if r.startswith("GET ") and r.endswith(suffix))


# --- read-ahead ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tar", "zstd"])
def test_read_ahead_gives_the_local_order_and_bytes_and_resumes_exactly(
    s3: S3Server,
    proxy: Proxy,
    uploaded: dict[str, str],
    built: Path,
    built_zstd: Path,
    kind: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    local_out = built if kind == "tar" else built_zstd
    opts = {"batch_size": 8, **OPTIONS}
    local = batches(ShardDataset(str(local_out), **opts))
    # small requests and budget: many groups, coalescing and the byte bound all exercised
    ahead = ShardDataset(
        uploaded[kind], read=remote(s3, proxy, request_bytes=3000, read_ahead_bytes=20_000), **opts
    )
    direct = ShardDataset(uploaded[kind], read=remote(s3, proxy, read_ahead_bytes=0), **opts)
    with caplog.at_level(logging.WARNING, logger="loader.io.readahead"):
        assert batches(ahead) == local
        assert batches(direct) == local
        # resume mid-epoch (epoch 1): the schedule starts at the resume point
        full = batches(ahead)  # epoch 1
        again = ShardDataset(uploaded[kind], read=remote(s3, proxy, request_bytes=3000), **opts)
        again.set_epoch(1)
        for i, batch in enumerate(again):
            if i == 4:
                state = again.state_after(batch)
                break
        resumed = ShardDataset(uploaded[kind], read=remote(s3, proxy, request_bytes=3000), **opts)
        resumed.resume(state)
        assert batches(resumed) == full[5:]
    assert not [r for r in caplog.records if "not the planned" in r.getMessage()]
    assert read_ahead_threads() == []


def test_read_ahead_in_forked_workers(
    s3: S3Server, proxy: Proxy, uploaded: dict[str, str], built_zstd: Path
) -> None:
    local = sorted(samples(ShardDataset(str(built_zstd), shuffle=False)))
    ds = ShardDataset(uploaded["zstd"], shuffle=False, read=remote(s3, proxy))
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    got = [(s["__key__"], s["bin"]) for s in loader]
    assert sorted(got) == local and len(got) == 1001


def test_adjacent_reads_are_coalesced(
    s3: S3Server, proxy: Proxy, uploaded: dict[str, str], built_zstd: Path
) -> None:
    local = samples(ShardDataset(str(built_zstd), shuffle=False, shuffle_buffer=16))
    before = len(proxy.requests)
    ahead = ShardDataset(uploaded["zstd"], shuffle=False, shuffle_buffer=16, read=remote(s3, proxy))
    assert samples(ahead) == local
    middle = len(proxy.requests)
    direct = ShardDataset(
        uploaded["zstd"],
        shuffle=False,
        shuffle_buffer=16,
        read=remote(s3, proxy, read_ahead_bytes=0),
    )
    assert samples(direct) == local
    # 63 windows of 16 samples, 73 reads: coalesced into one GET per shard
    assert gets(proxy, before, (".tar.zst",), until=middle) == 10


def test_threads_stop_when_the_iteration_stops_or_fails(
    s3: S3Server, proxy: Proxy, uploaded: dict[str, str], built_zstd: Path
) -> None:
    ds = ShardDataset(uploaded["zstd"], read=remote(s3, proxy, request_bytes=4096))
    it = iter(ds)
    next(it)
    assert read_ahead_threads()  # running, inside the iterating process
    it._items.close()  # type: ignore[attr-defined]  # what a DataLoader does at the end
    assert read_ahead_threads() == []
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
    bucket = uploaded["zstd"][len("s3://") :]
    fs.rm(f"{bucket}/shard-00004.tar.zst")
    with pytest.raises(CorruptShardError, match=r"shard-00004\.tar\.zst.*shard file is missing"):
        samples(ShardDataset(uploaded["zstd"], read=remote(s3, proxy)))
    assert read_ahead_threads() == []


def test_connections_cut_mid_body_are_retried_with_exact_bytes(
    s3: S3Server, proxy: Proxy, uploaded: dict[str, str], built_zstd: Path
) -> None:
    local = samples(ShardDataset(str(built_zstd)))
    ds = ShardDataset(uploaded["zstd"], read=remote(s3, proxy, request_bytes=20_000))
    proxy.cut_next(3, after=5000)
    assert samples(ds) == local
    assert proxy.cuts == 3


# --- two ranks x two workers ----------------------------------------------------------


@pytest.mark.distributed
def test_two_ranks_two_workers_read_s3_like_local(
    s3: S3Server, proxy: Proxy, uploaded: dict[str, str], built_zstd: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    results = run_ranks(
        read_s3,
        2,
        tmp_path,
        url=uploaded["zstd"],
        storage_options=s3.storage_options(proxy.endpoint),
        cache_dir=str(cache),
    )
    seen = []
    for rank, r in enumerate(results):
        ds = ShardDataset(str(built_zstd), batch_size=16, rank=rank, world_size=2, **OPTIONS)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        for epoch in range(2):
            local = [
                [
                    [str(k), hashlib.sha1(p).hexdigest()]
                    for k, p in zip(b["__key__"], b["bin"].tolist(), strict=True)
                ]
                for b in loader
            ]
            assert r["epochs"][epoch] == local, f"rank {rank} epoch {epoch}"
            assert sum(map(len, local)) == 500  # 1001 // 2
            seen += [k for b in local for k, _ in b] if epoch == 0 else []
        assert len(r["synced"]) == r["len"] == 32
    assert len(set(seen)) == 1000  # disjoint ranks, one sample dropped
    # both ranks and their workers shared one cache: each file was downloaded once
    names = [r.split("?")[0].rsplit("/", 1)[-1] for r in proxy.requests if r.startswith("GET ")]
    data = [n for n in names if n.endswith((".tar.zst", ".idx"))]
    assert sorted(data) == sorted(set(data)) and len(data) == 20


# --- cache --------------------------------------------------------------------------


def test_second_epoch_from_the_cache_makes_no_request(
    s3: S3Server, proxy: Proxy, uploaded: dict[str, str], built: Path, tmp_path: Path
) -> None:
    ds = ShardDataset(uploaded["tar"], read=remote(s3, proxy, cache_dir=str(tmp_path)), **OPTIONS)
    local = ShardDataset(str(built), **OPTIONS)
    before = len(proxy.requests)
    assert samples(ds) == samples(local)
    assert gets(proxy, before, (".tar",)) == 8 and gets(proxy, before, (".idx",)) == 8
    before = len(proxy.requests)
    assert samples(ds) == samples(local)  # epoch 1, a new order
    assert proxy.requests[before:] == []
    assert cache_bytes(str(tmp_path)) == sum(p.stat().st_size for p in built.glob("shard-*"))


def test_eviction_keeps_the_folder_under_its_limit(
    s3: S3Server,
    proxy: Proxy,
    uploaded: dict[str, str],
    built_zstd: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    files = sorted(built_zstd.glob("shard-*"))
    largest = max(p.stat().st_size for p in files if p.suffix != ".idx")
    limit = 3 * largest  # the dataset is 10 shards
    sizes: list[int] = []
    acquire = ShardCache._acquire

    def checked(self: ShardCache, *args: Any) -> Any:
        result = acquire(self, *args)
        # measured under the lock that evicting, reserving and renaming take: a scan beside them
        # could count a file just evicted and the download that replaced it (one shard too many)
        with cache_module._locked(self._evict_lock, self.lock_timeout_s):
            sizes.append(cache_bytes(str(tmp_path)))
        return result

    monkeypatch.setattr(ShardCache, "_acquire", checked)
    read = remote(s3, proxy, cache_dir=str(tmp_path), cache_limit=limit, request_bytes=8192)
    for epoch in range(2):
        ds = ShardDataset(uploaded["zstd"], read=read, **OPTIONS)
        ds.set_epoch(epoch)
        local = ShardDataset(str(built_zstd), **OPTIONS)
        local.set_epoch(epoch)
        assert samples(ds) == samples(local)
    assert len(sizes) >= 20 and max(sizes) <= limit
    assert sum(p.stat().st_size for p in files) > 2 * limit  # eviction had to happen


def test_a_limit_smaller_than_a_shard_streams_without_caching(
    s3: S3Server, proxy: Proxy, uploaded: dict[str, str], built: Path, tmp_path: Path
) -> None:
    read = remote(s3, proxy, cache_dir=str(tmp_path), cache_limit=100)
    with pytest.warns(UserWarning, match="smaller than the largest shard.*streaming without"):
        got = samples(ShardDataset(uploaded["tar"], read=read))
    assert got == samples(ShardDataset(str(built)))
    assert cache_bytes(str(tmp_path)) == 0


def _open_in_process(url: str, options: dict[str, Any], cache: str, barrier: Any, out: str) -> None:
    source = Source(url, RemoteOptions(storage_options=options, cache_dir=cache))
    manifest = source.manifest()
    shard_cache = ShardCache.for_output(source, manifest)
    assert shard_cache is not None
    barrier.wait(30)
    with shard_cache.open(manifest.shards[2]) as f:  # type: ignore[union-attr]
        Path(out).write_bytes(f.read())


def test_two_processes_racing_for_a_shard_download_it_once(
    s3: S3Server, uploaded: dict[str, str], built: Path, tmp_path: Path
) -> None:
    with Proxy(s3.port, latency=0.05, bandwidth=200_000) as slow:  # a download takes a while
        options = s3.storage_options(slow.endpoint)
        context = multiprocessing.get_context("spawn")
        barrier = context.Barrier(2)
        outs = [tmp_path / f"out{i}" for i in range(2)]
        processes = [
            context.Process(
                target=_open_in_process,
                args=(uploaded["tar"], options, str(tmp_path / "cache"), barrier, str(out)),
            )
            for out in outs
        ]
        try:
            for p in processes:
                p.start()
            for p in processes:
                p.join(60)
            assert [p.exitcode for p in processes] == [0, 0]
        finally:
            for p in processes:
                if p.is_alive():
                    p.kill()
                    p.join(10)
        shard = (built / "shard-00002.tar").read_bytes()
        assert [o.read_bytes() for o in outs] == [shard, shard]
        downloads = [r.split("?")[0] for r in slow.requests if "shard-00002.tar" in r]
        assert downloads == [f"GET /{uploaded['tar'][5:]}/shard-00002.tar"]


def test_half_written_and_truncated_cache_files_are_never_read(
    s3: S3Server, proxy: Proxy, uploaded: dict[str, str], built: Path, tmp_path: Path
) -> None:
    read = remote(s3, proxy, cache_dir=str(tmp_path), cache_limit=10 << 20)
    ds = ShardDataset(uploaded["tar"], read=read)
    expected = samples(ShardDataset(str(built)))
    assert samples(ds) == expected
    [folder] = [p for p in (tmp_path / "shardprep-cache").iterdir() if p.is_dir()]
    # a downloader killed mid-file left its .part; another file was cut short in place
    part = folder / f".shard-00001.tar.{os.getpid() + 100000}.0.part"
    part.write_bytes(b"\0" * 1000)
    victim = folder / "shard-00003.tar"
    victim.write_bytes(victim.read_bytes()[:500])
    before = len(proxy.requests)
    ds.set_epoch(0)
    assert samples(ds) == expected
    assert [r.split("?")[0].rsplit("/", 1)[-1] for r in proxy.requests[before:]] == [
        "shard-00003.tar"
    ]
    assert not part.exists()  # a dead writer's leftover is removed when room is made


def test_a_cached_file_that_differs_from_the_manifest_is_refused(
    s3: S3Server, proxy: Proxy, uploaded: dict[str, str], tmp_path: Path
) -> None:
    import fsspec

    from shardprep.format.errors import ChecksumMismatchError

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
    bucket = uploaded["tar"][len("s3://") :]
    data = bytearray(fs.cat(f"{bucket}/shard-00005.tar"))
    data[600] ^= 0xFF  # same size, other bytes
    fs.pipe(f"{bucket}/shard-00005.tar", bytes(data))
    ds = ShardDataset(uploaded["tar"], read=remote(s3, proxy, cache_dir=str(tmp_path)))
    with pytest.raises(ChecksumMismatchError, match=r"shard-00005\.tar: sha256"):
        samples(ds)
    assert not list(tmp_path.rglob("shard-00005.tar")) and not list(tmp_path.rglob("*.part"))


# --- storage_options and the environment ------------------------------------------------

ENV_READ = """
import sys
from loader import ShardDataset
print(sum(len(s["bin"]) for s in ShardDataset(sys.argv[1])))
"""


def test_credentials_and_endpoint_from_the_environment(
    s3: S3Server, proxy: Proxy, uploaded: dict[str, str], built: Path
) -> None:
    """No storage_options: s3fs/botocore read AWS_* variables (AWS_ENDPOINT_URL) themselves."""
    env = {**os.environ, **s3.environment(proxy.endpoint), "PYTHONPATH": str(ROOT)}
    result = run_bounded([sys.executable, "-c", ENV_READ, uploaded["tar"]], timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == sum(len(b) for _, b in samples(ShardDataset(str(built))))
    assert any(r.endswith("/manifest.json") for r in proxy.requests)


def test_storage_options_reach_s3fs(s3: S3Server, proxy: Proxy, uploaded: dict[str, str]) -> None:
    """The endpoint in storage_options is the one used: every request goes through the proxy."""
    ds = ShardDataset(uploaded["tar"], read=remote(s3, proxy, read_ahead_bytes=0))
    assert [r.split("?")[0] for r in proxy.requests] == [
        f"GET /{uploaded['tar'][5:]}/manifest.json"
    ]
    assert len(samples(ds)) == 103
    assert gets(proxy, 1, (".tar",)) == 8
