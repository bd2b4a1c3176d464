"""Epoch telemetry of a URL (loader.read.telemetry, ``Source.io_counts``): the requests an
epoch's counters report are the GETs the moto server's proxy forwarded in that epoch, and the
bytes those of the files it downloaded, with 0 and 2 DataLoader workers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.utils.data

from loader import ReadOptions, RemoteOptions, ShardDataset
from tests.processes import dataloader_iterator
from tests.s3 import Proxy, S3Server


def gets(proxy: Proxy, since: int = 0) -> int:
    return sum(1 for r in proxy.requests[since:] if r.startswith("GET "))


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epochs_requests_and_bytes_are_what_the_server_saw(
    s3: S3Server, proxy: Proxy, uploaded: dict[str, str], tmp_path: Path, workers: int
) -> None:
    remote = RemoteOptions(
        storage_options=s3.storage_options(proxy.endpoint), cache_dir=str(tmp_path)
    )
    ds = ShardDataset(uploaded["tar"], batch_size=8, read=ReadOptions(remote=remote))
    shards = ds.manifest.shards
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    for epoch in range(2):
        before = len(proxy.requests)
        with dataloader_iterator(ds.timed(loader)) as batches:
            assert sum(len(b["__key__"]) for b in batches) == 103
        stats = ds.epoch_stats()
        assert (stats.epoch, stats.samples, stats.io is not None) == (epoch, 103, True)
        assert stats.io is not None
        assert stats.io["requests"] == gets(proxy, before)
        assert stats.io["retries"] == 0
        if epoch == 0:  # every shard and index downloaded once into the cache, whole
            assert stats.io["requests"] == stats.io["cache_misses"] == 2 * len(shards)
            assert stats.io["bytes"] == sum(s.num_bytes + s.index_bytes for s in shards)
            assert stats.stages["network"] > 0
        else:  # all from the cache
            assert (stats.io["requests"], stats.io["bytes"], stats.io["cache_misses"]) == (0, 0, 0)
            assert stats.io["cache_hits"] >= len(shards)
        assert stats.as_dict()["io_requests"] == stats.io["requests"]


def test_bench_of_a_url_reports_the_requests_the_server_saw(
    s3: S3Server, proxy: Proxy, uploaded: dict[str, str], tmp_path: Path
) -> None:
    import json

    from click.testing import CliRunner

    from shardprep.cli import cli

    options = s3.storage_options(proxy.endpoint)
    args = ["bench", uploaded["tar"], "--workers", "0", "--epochs", "2", "--batch-size", "8"]
    for key, value in options.items():
        args += ["--storage-option", f"{key}={json.dumps(value)}"]
    read = ReadOptions(remote=RemoteOptions(storage_options=options))
    shards = ShardDataset(uploaded["tar"], read=read).manifest.shards
    before = len(proxy.requests)
    result = CliRunner().invoke(cli, [*args, "--cache-dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    (r,) = json.loads(result.stdout)
    epochs = 2 * len(shards)  # epoch 1: every shard and index into the cache; epoch 2: none
    assert r["samples_per_epoch"] == 103
    assert r["requests_per_epoch"] == epochs / 2
    assert gets(proxy, before) == 1 + epochs  # the bench's manifest, then its epochs
    assert r["bytes_per_epoch"] == sum(s.num_bytes + s.index_bytes for s in shards) / 2
    assert r["retries_per_epoch"] == 0
    assert r["cache_hit_rate"] > 0  # the second epoch's files all came from the cache
    assert r["stages"]["network"] > 0
