"""``shardprep bench OUT`` (shardprep/cli_bench.py) run through click: its JSON fields, exact
sample counts per worker count, its own timings consistent, and bad input refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from loader.read.telemetry import STAGES
from shardprep.cli import cli
from shardprep.cli_bench import parse_workers, pick
from tests.faults.shard_surgery import copy_output, index_of


def test_bench_json_per_worker_count(built: Path) -> None:
    args = ["bench", str(built), "--workers", "0,2", "--epochs", "2", "--batch-size", "8"]
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    results = json.loads(result.stdout)
    assert [r["workers"] for r in results] == [0, 2]
    for r in results:
        assert r["samples_per_epoch"] == 103 and r["epochs"] == 2
        assert set(r["stages"]) == set(STAGES)
        assert all(s >= 0 for s in r["stages"].values()) and r["stages"]["read"] > 0
        assert r["samples_per_s"] == pytest.approx(2 * 103 / sum(r["epoch_s"]))
        assert r["mb_per_s"] > 0 and 0 < r["first_batch_s"] <= r["epoch_s"][0]
        # the loop's wait and compute (the counters) fit in the epoch's own perf_counter time
        assert r["wait_s"] > 0 and r["compute_s"] > 0
        assert r["wait_s"] + r["compute_s"] <= sum(r["epoch_s"]) / 2
        assert "requests_per_epoch" not in r  # a local output
    assert [r["picked"] for r in results].count(True) == 1
    assert "workers 2, epoch 2/2: 103 samples" in result.stderr  # progress on stderr
    assert "pick: " in result.stderr
    text = CliRunner().invoke(cli, [*args, "--epochs", "1"])
    assert text.exit_code == 0, text.output
    assert [
        line.split(":")[0] for line in text.stdout.splitlines() if line.startswith("workers")
    ] == [
        "workers 0",
        "workers 2",
    ]
    assert "pick: " in text.stdout


def test_bench_refuses_bad_input(built: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    bad = runner.invoke(cli, ["bench", str(built), "--workers", "0,two"])
    assert bad.exit_code == 2 and "'two' is not a non-negative integer" in bad.stderr
    missing = runner.invoke(cli, ["bench", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "does not exist" in missing.stderr
    not_out = runner.invoke(cli, ["bench", str(tmp_path), "--workers", "0"])
    assert not_out.exit_code == 1 and "no manifest" in not_out.stderr
    cache = runner.invoke(cli, ["bench", str(built), "--cache-dir", str(tmp_path / "c")])
    assert cache.exit_code == 2 and "only for a URL OUT" in cache.stderr


def test_bench_names_a_damaged_sample_first_also_from_workers(built: Path, tmp_path: Path) -> None:
    out = copy_output(built, tmp_path / "out")
    index = index_of(out, 3)
    member = int(index.member_start[2])
    data = bytearray((out / "shard-00003.tar").read_bytes())
    data[int(index.member_offset[member]) + 3] ^= 0x55
    (out / "shard-00003.tar").write_bytes(bytes(data))
    first = f"Error: {out / 'shard-00003.tar'}: sample {index.key(2)!r} at offset "
    for workers, where in (("0", ""), ("1", " (in a DataLoader worker, 1 workers)")):
        result = CliRunner().invoke(cli, ["bench", str(out), "--workers", workers])
        assert result.exit_code == 1, result.output
        assert result.stderr.splitlines()[-1].startswith(first), result.stderr
        advice = "; run `shardprep verify` on the output folder and rebuild or restore the shard"
        assert result.stderr.splitlines()[-1].endswith(f"damaged{where}{advice}"), result.stderr
        assert "Caught CorruptShardError" not in result.stderr


def test_parse_workers_and_pick() -> None:
    assert parse_workers("0, 2,4,2") == (0, 2, 4)
    with pytest.raises(ValueError, match="-1"):
        parse_workers("0,-1")
    fast = [{"workers": 0, "samples_per_s": 100.0}, {"workers": 4, "samples_per_s": 300.0}]
    assert pick(fast)[0] == 4
    close = [{"workers": 2, "samples_per_s": 290.0}, {"workers": 4, "samples_per_s": 300.0}]
    assert pick(close) == (2, pick(close)[1]) and "fewer workers" in pick(close)[1]
