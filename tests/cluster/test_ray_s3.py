"""--engine ray on a multi-node local Ray cluster into S3 (moto), with no shared staging.

The module starts a real ``ray.cluster_utils.Cluster`` (its tests share it): a head with no CPUs (the drivers join
it; no task runs there) and two worker nodes of 1 CPU, each with a TMPDIR of its own, so a
shard staged on a node is visibly not on the driver's disk. Builds run as CLI driver
processes in their own session (``tests.cluster.hooks`` records where each write task ran,
and can hold a task between its shard's local write and its upload). RAW is a local folder,
a path every "node" sees since they share this machine. Every object is compared with a
``--engine local --workers 1`` build of the same input and seed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import shardprep
from shardprep.format.manifest import JOURNAL_NAME
from tests.conftest import write_class_folders
from tests.processes import run_bounded

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a real Ray instance per module: seconds per test
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from ray.cluster_utils import Cluster  # noqa: E402

from tests.s3 import S3Server  # noqa: E402

SHARDS = 6
CLASSES = {"ant": 110, "bee": 60, "cat": 85, "dog": 25}  # 280 tiny samples
DEADLINE_S = 120.0
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with S3Server() as server:
        yield server


@dataclass
class Data:
    raw: Path
    reference: dict[str, bytes]  # the local --workers 1 build: file name -> bytes


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    base = tmp_path_factory.mktemp("cluster-data")
    raw = write_class_folders(base / "raw", CLASSES)
    out = base / "local-1"
    shardprep.build(str(raw), str(out), shards=SHARDS, workers=1, progress=False)
    return Data(raw, {p.name: p.read_bytes() for p in sorted(out.iterdir())})


@dataclass
class Nodes:
    cluster: Any
    workers: dict[str, Any]  # node id -> ray._private.node.Node
    tmp: dict[str, Path]  # node id -> that node's TMPDIR


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    """A head (0 CPUs) and two 1-CPU worker nodes, shut down whatever happens.

    One cluster per module (starting one costs 5-10 s on 2 cores): each test's driver is a new
    Ray job, each build writes under its own bucket or folder, and a test that takes a node
    away (``test_a_node_removed_mid_write_gives_the_same_objects``) comes last in its module.
    """
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    try:
        workers, tmps = {}, {}
        base = tmp_path_factory.mktemp("nodes")
        for name in ("node-a", "node-b"):
            tmp = base / f"{name}-tmp"
            tmp.mkdir()
            node = cluster.add_node(num_cpus=1, env_vars={"TMPDIR": str(tmp)})
            workers[node.node_id] = node
            tmps[node.node_id] = tmp
        cluster.wait_for_nodes(timeout=60)
        yield Nodes(cluster, workers, tmps)
    finally:
        cluster.shutdown()


@pytest.fixture
def bucket(s3: S3Server, request: pytest.FixtureRequest) -> str:
    name = f"cluster-{request.node.name.split('[')[0].replace('_', '-')[-40:]}".lower()
    s3.create_bucket(name)
    return name


def _fs(s3: S3Server) -> Any:
    import fsspec

    return fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())


def _objects(s3: S3Server, prefix: str) -> dict[str, bytes]:
    fs = _fs(s3)
    names = sorted(fs.find(prefix))
    return {name.rsplit("/", 1)[-1]: fs.cat_file(name) for name in names}


def _build_command(
    data: Data, s3: S3Server, url: str, address: str, hooks: Path | None, *more: str
) -> list[str]:
    endpoint = {"endpoint_url": s3.endpoint, "region_name": "us-east-1"}
    head = ["-m", "tests.cluster.hooks", str(hooks)] if hooks else ["-m", "shardprep"]
    return [
        sys.executable,
        *head,
        "build",
        str(data.raw),
        url,
        "--shards",
        str(SHARDS),
        "--engine",
        "ray",
        "--ray-address",
        address,
        "--stall-timeout",
        "90",
        "--json",
        "--storage-option",
        "key=testing",
        "--storage-option",
        "secret=testing",
        "--out-storage-option",
        f"client_kwargs={json.dumps(endpoint)}",
        # RAW's options only: this endpoint answers nothing, so OUT must not get it
        "--raw-storage-option",
        'client_kwargs={"endpoint_url": "http://127.0.0.1:1"}',
        *more,
    ]


def _driver_env(tmp: Path) -> dict[str, str]:
    """The driver's environment: a TMPDIR of its own, no AWS settings (options carry them)."""
    tmp.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["TMPDIR"] = str(tmp)
    env.pop("RAY_ADDRESS", None)
    return env


def _ran(hooks: Path) -> list[tuple[int, str, str]]:
    """(shard, node id, staging folder) per write that reached its upload, in order."""
    return [(shard, node, staging) for shard, node, _, staging in _ran_by(hooks)]


def _ran_by(hooks: Path) -> list[tuple[int, str, int, str]]:
    """(shard, node id, worker pid, staging folder) per write that reached its upload."""
    path = hooks / "ran"
    if not path.exists():
        return []
    rows = [line.split(" ", 3) for line in path.read_text().splitlines()]
    return [(int(shard), node, int(pid), staging) for shard, node, pid, staging in rows]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")


def _until_gone(pid: int) -> None:
    """Wait (bounded) until process ``pid`` has exited."""
    deadline = time.monotonic() + DEADLINE_S
    while not _gone(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs after {DEADLINE_S} s"
        time.sleep(0.1)  # polling /proc, bounded by the deadline


def _until(check: Callable[[], bool], what: str, driver: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        if driver.poll() is not None:
            out, err = driver.communicate()
            raise AssertionError(f"the driver ended ({driver.returncode}) before {what}:\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {DEADLINE_S} s")
        time.sleep(0.1)  # polling the cluster's progress, bounded by the deadline


@contextlib.contextmanager
def _driver(command: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """A driver process in a session of its own, SIGKILLed with its session at the end."""
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=30)


def _check_complete_objects(s3: S3Server, prefix: str, data: Data) -> set[str]:
    """Every object under a final name is whole: the reference's bytes, and a shard's index
    is there too. Returns the shard names present."""
    found = _objects(s3, prefix)
    for name, content in found.items():
        if name != JOURNAL_NAME:
            assert content == data.reference[name], f"{name} is not the local build's"
    shards = {n for n in found if n.endswith(".tar")}
    assert all(n.replace(".tar", ".idx") in found for n in shards)
    assert "manifest.json" not in found
    return shards


def test_cluster_build_into_s3_is_byte_identical(
    data: Data, s3: S3Server, bucket: str, nodes: Nodes, tmp_path: Path
) -> None:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    url = f"s3://{bucket}/out"
    command = _build_command(data, s3, url, nodes.cluster.address, hooks)
    result = run_bounded(command, DEADLINE_S, cwd=ROOT, env=_driver_env(tmp_path / "driver"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["num_shards"] == SHARDS
    assert _objects(s3, f"{bucket}/out") == data.reference
    ran = _ran(hooks)
    assert sorted(shard for shard, _, _ in ran) == list(range(SHARDS))
    assert {node for _, node, _ in ran} == set(nodes.workers)  # both worker nodes wrote
    for _, node, staging in ran:  # each shard was staged on its own node, then removed
        assert Path(staging).parent == nodes.tmp[node]
        assert not Path(staging).exists()
    assert list((tmp_path / "driver").iterdir()) == []


def test_killed_driver_then_resume_from_what_is_in_out(
    data: Data, s3: S3Server, bucket: str, nodes: Nodes, tmp_path: Path
) -> None:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "hold-3").touch()
    url, prefix = f"s3://{bucket}/out", f"{bucket}/out"
    command = _build_command(data, s3, url, nodes.cluster.address, hooks)
    driver_tmp = tmp_path / "driver"
    with _driver(command, _driver_env(driver_tmp)) as driver:
        # shard 3 is written on its node and held before its upload; the other node does the rest
        _until(
            lambda: (
                any(s == 3 for s, _, _ in _ran(hooks))
                and len(_check_complete_objects(s3, prefix, data)) == SHARDS - 1
            ),
            "5 shards uploaded while shard 3 is held",
            driver,
        )
        assert "shard-00003.tar" not in _check_complete_objects(s3, prefix, data)
        (_, node, worker, staging) = next(r for r in _ran_by(hooks) if r[0] == 3)
        assert (Path(staging) / "shard-00003.tar").exists()  # staged on its node
        assert Path(staging).parent == nodes.tmp[node]
        assert not [p for p in driver_tmp.iterdir() if "staging" in p.name]  # not on the driver
        # Ray ends a dead driver's tasks gracefully (their staging folders go with them); one
        # killed outright (the node's out-of-memory killer, Ray's kill after its grace
        # period) leaves its folder on the node. The worker is stopped first: killed after the
        # driver, it could have been ended gracefully in between (and its folder removed)
        os.kill(worker, signal.SIGSTOP)
        os.killpg(driver.pid, signal.SIGKILL)
        os.kill(worker, signal.SIGKILL)
        driver.wait(timeout=30)
    _until_gone(worker)
    assert (Path(staging) / "shard-00003.tar").exists()
    (hooks / "hold-3").unlink()
    assert _check_complete_objects(s3, prefix, data) == {
        f"shard-{s:05d}.tar" for s in range(SHARDS) if s != 3
    }
    # damage one finished shard (same size): --resume checks it and writes it again
    fs = _fs(s3)
    damaged = bytearray(fs.cat_file(f"{prefix}/shard-00001.tar"))
    damaged[700] ^= 0xFF
    fs.pipe_file(f"{prefix}/shard-00001.tar", bytes(damaged))
    resume = _build_command(data, s3, url, nodes.cluster.address, None, "--resume")
    result = run_bounded(resume, DEADLINE_S, cwd=ROOT, env=_driver_env(tmp_path / "driver-2"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["reused_shards"] == SHARDS - 2
    assert "shard-00001.tar: damaged since the interrupted build" in result.stderr
    assert _objects(s3, prefix) == data.reference
    # the resumed build swept the killed build's staging folder off its node (issue 34 item 7)
    for tmp in nodes.tmp.values():
        assert [p.name for p in tmp.iterdir() if p.name.startswith("shardprep-")] == []


def test_a_node_removed_mid_write_gives_the_same_objects(
    data: Data, s3: S3Server, bucket: str, nodes: Nodes, tmp_path: Path
) -> None:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "hold-2").touch()
    url, prefix = f"s3://{bucket}/out", f"{bucket}/out"
    command = _build_command(data, s3, url, nodes.cluster.address, hooks)
    with _driver(command, _driver_env(tmp_path / "driver")) as driver:
        _until(lambda: any(s == 2 for s, _, _ in _ran(hooks)), "shard 2 written", driver)
        (_, node, pid, staging) = next(r for r in _ran_by(hooks) if r[0] == 2)
        assert (Path(staging) / "shard-00002.tar").exists()
        assert "shard-00002.tar" not in _check_complete_objects(s3, prefix, data)
        nodes.cluster.remove_node(nodes.workers[node], allow_graceful=False)
        _until(lambda: _gone(pid), "end of the removed node's worker", driver)
        assert "shard-00002.tar" not in _check_complete_objects(s3, prefix, data)
        (hooks / "hold-2").unlink()  # the retry, on the other node, goes through
        stdout, stderr = driver.communicate(timeout=DEADLINE_S)
        assert driver.returncode == 0, stderr
    # Ray prints the node's death on the driver's stdout, before the summary
    assert json.loads(stdout[stdout.index("{\n") :])["num_shards"] == SHARDS, stdout
    assert _objects(s3, prefix) == data.reference
    nodes_of_2 = [n for s, n, _ in _ran(hooks) if s == 2]
    assert len(nodes_of_2) == 2 and nodes_of_2[0] == node and nodes_of_2[1] != node
