"""``Source.io_counts()``: the requests, bytes, retries, cache hits and misses and read-ahead
waits of this process, against a real S3 server (moto on 127.0.0.1) through the counting proxy
of ``tests.s3``: the requests are the GETs the proxy forwarded, the bytes those of the ranges
asked for."""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import time
from pathlib import Path

import pytest

from loader import ReadOptions, RemoteOptions, ShardDataset
from loader.io.source import Source
from tests.s3 import Proxy, S3Server

PAYLOAD = bytes(range(256)) * 400  # 102,400 bytes
ZERO = {"requests": 0, "bytes": 0, "retries": 0, "cache_hits": 0, "cache_misses": 0, "wait_ns": 0}


def gets(proxy: Proxy, since: int = 0) -> int:
    return sum(1 for r in proxy.requests[since:] if r.startswith("GET "))


def _source(s3: S3Server, bucket: str, proxy: Proxy, backend: str) -> Source:
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
    fs.pipe(f"{bucket}/obj", PAYLOAD)
    options = RemoteOptions(storage_options=s3.storage_options(proxy.endpoint), backend=backend)
    return Source(f"s3://{bucket}", options)


@pytest.mark.parametrize("backend", ["obstore", "fsspec"])
def test_requests_bytes_and_retries_are_the_ones_sent(
    s3: S3Server, bucket: str, proxy: Proxy, backend: str
) -> None:
    if backend == "obstore":
        pytest.importorskip("obstore")
    source = _source(s3, bucket, proxy, backend)
    assert source.io_counts() == ZERO
    ranges = [(0, 1000), (1000, 5000), (30_000, 30_001)]
    source.fetch_ranges("obj", ranges)
    source.fetch("obj", 100_000, 200_000)  # 2,400 bytes: the object ends there
    assert source.fetch("obj", 200_000, 300_000) == b""  # past the end: a GET, no bytes
    proxy.cut_next(1, after=10_000)  # the next answer is cut mid-body: one retry
    assert source.fetch("obj", 0, 50_000) == PAYLOAD[:50_000]
    counts = source.io_counts()
    assert counts["requests"] == gets(proxy) == len(ranges) + 4
    assert counts["bytes"] == 5001 + 2400 + 50_000
    assert counts["retries"] == 1
    assert (counts["cache_hits"], counts["cache_misses"], counts["wait_ns"]) == (0, 0, 0)


def _child_counts(source: Source, out: multiprocessing.Queue[dict[str, int]]) -> None:
    before = source.io_counts()
    source.fetch("obj", 0, 10)
    out.put(before)
    out.put(source.io_counts())


def test_a_forked_child_and_an_unpickled_copy_count_their_own(
    s3: S3Server, bucket: str, proxy: Proxy
) -> None:
    source = _source(s3, bucket, proxy, "fsspec")
    source.fetch("obj", 0, 100)
    context = multiprocessing.get_context("fork")
    out: multiprocessing.Queue[dict[str, int]] = context.Queue()
    child = context.Process(target=_child_counts, args=(source, out))
    child.start()
    try:
        assert out.get(timeout=60) == ZERO
        assert out.get(timeout=60) == {**ZERO, "requests": 1, "bytes": 10}
        child.join(timeout=60)
        assert child.exitcode == 0
    except queue.Empty:
        raise AssertionError(
            f"the forked child said nothing within 60 s ({child.exitcode})"
        ) from None
    finally:
        child.kill()
        child.join(timeout=10)
    assert source.io_counts() == {**ZERO, "requests": 1, "bytes": 100}  # the parent's own
    assert pickle.loads(pickle.dumps(source)).io_counts() == ZERO


def test_an_epoch_counts_every_get_and_byte_and_the_cache(
    s3: S3Server, proxy: Proxy, uploaded: dict[str, str], tmp_path: Path
) -> None:
    pytest.importorskip("obstore")
    remote = RemoteOptions(
        storage_options=s3.storage_options(proxy.endpoint), cache_dir=str(tmp_path)
    )
    ds = ShardDataset(uploaded["tar"], shuffle=False, read=ReadOptions(remote=remote))
    source = ds.stream.source
    shards = ds.manifest.shards
    made = source.io_counts()  # the manifest, read when the dataset was made
    assert made["requests"] == gets(proxy) == 1
    began = time.perf_counter_ns()
    assert sum(1 for _ in ds) == ds.total
    took = time.perf_counter_ns() - began
    first = source.io_counts()
    # every shard and its index downloaded whole into the cache: one GET each (small files)
    assert first["requests"] == gets(proxy) == 1 + 2 * len(shards)
    assert first["bytes"] - made["bytes"] == sum(s.num_bytes + s.index_bytes for s in shards)
    assert first["cache_misses"] == 2 * len(shards)
    assert first["cache_hits"] == 0  # (each shard is one group here: asked for once)
    assert 0 < first["wait_ns"] < took
    assert sum(1 for _ in ds) == ds.total
    second = source.io_counts()
    assert second["requests"] == gets(proxy) == first["requests"]  # all from the cache
    assert second["cache_misses"] == first["cache_misses"]
    assert second["cache_hits"] == 2 * len(shards)  # every shard and index, from the cache
