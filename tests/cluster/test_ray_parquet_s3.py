"""Issue 37 item 3: a Parquet export on object storage built on a multi-node Ray cluster into
object storage, with no shared disk, byte-identical to a local build.

The cluster is a real ``ray.cluster_utils.Cluster`` (a head without CPUs, two 1-CPU worker
nodes with a TMPDIR each, tests/cluster/test_ray_s3.py's fixture), the storage moto's S3
server. RAW is an ``s3://`` prefix holding a Hugging Face-shaped export (image structs of real
PNGs, string labels, several files and row groups); the driver is a CLI process with a TMPDIR
of its own. Before this, such a build was refused ("cannot build from Parquet yet": the
payloads went to the driver's scratch folder, which the nodes cannot read).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import shardprep
from tests.integration.test_parquet_input import write_parquet
from tests.processes import run_bounded

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a real Ray cluster per module: seconds
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pytest.importorskip("pyarrow")

from tests.cluster.test_ray_s3 import (  # noqa: E402 (after the skips)
    DEADLINE_S,
    ROOT,
    Nodes,
    _driver_env,
    _fs,
    _objects,
    bucket,
    nodes,
    s3,
)
from tests.s3 import S3Server  # noqa: E402

__all__ = ["bucket", "nodes", "s3"]  # the fixtures, used by name

SHARDS = 4
ROWS = (30, 21)  # two files of row groups of 8 rows: 51 samples


def _command(s3: S3Server, raw: str, out: str, address: str, hooks: Path, *more: str) -> list[str]:
    endpoint = {"endpoint_url": s3.endpoint, "region_name": "us-east-1"}
    return [
        *(sys.executable, "-m", "tests.cluster.hooks", str(hooks), "build", raw, out),
        *("--shards", str(SHARDS), "--engine", "ray", "--ray-address", address),
        *("--stall-timeout", "90", "--json"),
        *("--storage-option", "key=testing", "--storage-option", "secret=testing"),
        *("--storage-option", f"client_kwargs={json.dumps(endpoint)}"),
        *more,
    ]


def _reads(hooks: Path) -> set[str]:
    """Every path a write task read a part from."""
    return {line for p in hooks.glob("read-*") for line in p.read_text().splitlines()}


def test_a_parquet_export_on_s3_builds_on_a_cluster_into_s3_like_a_local_build(
    s3: S3Server, bucket: str, nodes: Nodes, tmp_path: Path
) -> None:
    local_raw = tmp_path / "export"
    write_parquet(local_raw, rows=ROWS, key=False)
    fs = _fs(s3)
    for path in sorted(local_raw.iterdir()):
        fs.put(str(path), f"{bucket}/export/{path.name}")
    raw = f"s3://{bucket}/export/"
    options = s3.storage_options()
    reference = tmp_path / "local"
    shardprep.build(raw, str(reference), shards=SHARDS, workers=1, storage_options=options,
                    progress=False)  # fmt: skip
    expected = {p.name: p.read_bytes() for p in sorted(reference.iterdir())}
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    out = f"s3://{bucket}/out"
    command = _command(s3, raw, out, nodes.cluster.address, hooks)
    driver_tmp = tmp_path / "driver"
    result = run_bounded(command, DEADLINE_S, cwd=ROOT, env=_driver_env(driver_tmp))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout[result.stdout.index("{\n") :])["num_samples"] == sum(ROWS)
    assert _objects(s3, f"{bucket}/out") == expected  # no spill left in OUT either
    # the write tasks read every payload from OUT's storage (ranged GETs), nothing from the
    # driver's disk: one spill object per Parquet file, below OUT/.shardprep-spill/<id>/
    reads = _reads(hooks)
    assert len(reads) == len(ROWS), reads
    prefix = f"s3://{bucket}/out/.shardprep-spill/"
    assert all(r.startswith(prefix) for r in reads), reads
    assert {r.rsplit("/", 1)[-1] for r in reads} == {
        "train-00000-of-00002.parquet",
        "train-00001-of-00002.parquet",
    }
    assert list(driver_tmp.iterdir()) == []
    # what a build killed outright leaves: a plain build is refused (OUT is not empty), one
    # with --overwrite removes it first and writes the same objects
    fs.pipe_file(f"{bucket}/out2/.shardprep-spill/0123/train-00000-of-00002.parquet", b"left")
    refused = _command(s3, raw, f"s3://{bucket}/out2", nodes.cluster.address, hooks)
    result = run_bounded(refused, DEADLINE_S, cwd=ROOT, env=_driver_env(tmp_path / "d2"))
    assert result.returncode == 1 and ".shardprep-spill" in result.stderr, result.stderr
    again = [*refused, "--overwrite"]
    result = run_bounded(again, DEADLINE_S, cwd=ROOT, env=_driver_env(tmp_path / "d3"))
    assert result.returncode == 0, result.stderr
    assert _objects(s3, f"{bucket}/out2") == expected
    # a build that fails after spilling a file (the second one is damaged) leaves no copy
    fs.put(str(local_raw / "train-00000-of-00002.parquet"), f"{bucket}/bad/a.parquet")
    fs.pipe_file(f"{bucket}/bad/b.parquet", b"PAR1 cut short")
    failed = _command(
        s3, f"s3://{bucket}/bad/", f"s3://{bucket}/out3", nodes.cluster.address, hooks
    )
    result = run_bounded(failed, DEADLINE_S, cwd=ROOT, env=_driver_env(tmp_path / "d4"))
    assert result.returncode == 1 and "b.parquet: not a Parquet file" in result.stderr, (
        result.stderr
    )
    assert _objects(s3, f"{bucket}/out3") == {}


def test_a_local_out_every_node_shares_holds_the_copy_too(
    s3: S3Server, bucket: str, nodes: Nodes, tmp_path: Path
) -> None:
    """A local OUT on a cluster is a folder every node shares (the tasks write their shards
    there): the payloads are copied into it, not into the driver's TMPDIR."""
    local_raw = tmp_path / "export"
    write_parquet(local_raw, rows=ROWS, key=False)
    reference = tmp_path / "local"
    shardprep.build(str(local_raw), str(reference), shards=SHARDS, workers=1, progress=False)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    out = tmp_path / "out"
    command = _command(s3, str(local_raw), str(out), nodes.cluster.address, hooks)
    result = run_bounded(command, DEADLINE_S, cwd=ROOT, env=_driver_env(tmp_path / "driver"))
    assert result.returncode == 0, result.stderr
    assert {p.name: p.read_bytes() for p in sorted(out.iterdir())} == {
        p.name: p.read_bytes() for p in sorted(reference.iterdir())
    }  # (.shardprep-spill removed: iterdir lists hidden names too)
    reads = _reads(hooks)
    assert len(reads) == len(ROWS) and all(
        r.startswith(f"{out}/.shardprep-spill/") for r in reads
    ), reads
