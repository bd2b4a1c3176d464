"""--engine ray on a real local Ray instance: byte-identical to --engine local, retries, resume.

One Ray instance (2 CPUs) serves the whole module; the local reference builds
run before it starts (the local engine forks, which a process holding Ray's
threads should not). The killed-driver test runs its own driver process with
its own Ray instance, and checks that every process of that session is gone.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import shardprep
from shardprep.engine import ray_engine
from shardprep.format.errors import StalledError, WriteError
from shardprep.scan import listing
from tests.conftest import payload, write_class_folders
from tests.engine.faulty import faults_in

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a real Ray instance per module: seconds per test

SHARDS = 8
CLASSES = {"ant": 41, "bee": 23, "cat": 30, "dog": 9}
DEADLINE_S = 90.0
ROOT = Path(__file__).resolve().parents[2]


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def _write_listing(root: Path) -> Path:
    """A CSV listing of 90 files in two folders, with a label and an extra column."""
    rows = []
    for i in range(90):
        rel = f"{'ab'[i % 2]}/{i:04d}.bin"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(payload(i % 3, i))
        rows.append({"path": rel, "label": f"c{i % 3}", "note": f"row {i}"})
    listing = root / "list.csv"
    with open(listing, "w", newline="") as f:
        writer = csv.DictWriter(f, ["path", "label", "note"])
        writer.writeheader()
        writer.writerows(rows)
    return listing


class Data:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.class_folders = write_class_folders(base / "raw", CLASSES)
        self.listing = _write_listing(base / "listing")
        self.faults = base / "faults"
        self.faults.mkdir()
        self.reference: dict[str, dict[str, bytes]] = {}
        for name, raw, options in (
            ("folders", self.class_folders, {}),
            ("listing", self.listing, {"compression": "zstd"}),
            ("tar", base / "folders-local-1", {}),  # re-shard a shardprep output: tar input
        ):
            outputs = []
            for workers in (1, 2):
                out = base / f"{name}-local-{workers}"
                shardprep.build(
                    str(raw), str(out), shards=SHARDS, workers=workers, progress=False, **options
                )
                outputs.append(_files(out))
            assert outputs[0] == outputs[1]  # --workers does not change a byte
            self.reference[name] = outputs[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Data]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(listing, "CHUNK_ROWS", 16)  # the 90-row listing is scanned in 6 tasks
        yield Data(tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="module")
def cluster(data: Data) -> Iterator[str]:
    """The module's Ray instance (2 CPUs); the builds write through the test-only fault hooks."""
    with faults_in(data.faults):
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
            yield ray.get_runtime_context().gcs_address
        finally:
            ray.shutdown()


def test_class_folders_on_ray_are_byte_identical_to_local(data: Data, cluster: str) -> None:
    out = data.base / "folders-ray"
    summary = shardprep.build(
        str(data.class_folders), str(out), shards=SHARDS, engine="ray", progress=False
    )
    assert summary.num_samples == sum(CLASSES.values())
    assert _files(out) == data.reference["folders"]


def test_listing_on_ray_is_byte_identical_to_local(data: Data, cluster: str) -> None:
    out = data.base / "listing-ray"
    shardprep.build(
        str(data.listing),
        str(out),
        shards=SHARDS,
        engine="ray",
        compression="zstd",
        progress=False,
    )
    assert _files(out) == data.reference["listing"]


def test_tar_input_on_ray_is_byte_identical_to_local(data: Data, cluster: str) -> None:
    out = data.base / "tar-ray"
    shardprep.build(
        str(data.base / "folders-local-1"), str(out), shards=SHARDS, engine="ray", progress=False
    )
    assert _files(out) == data.reference["tar"]


def _attempts(data: Data) -> list[int]:
    log = data.faults / "attempts"
    attempts = [int(line) for line in log.read_text().split()]
    log.unlink()
    return attempts


def test_a_transient_task_failure_is_retried_by_ray(data: Data, cluster: str) -> None:
    (data.faults / "attempts").unlink(missing_ok=True)
    trigger = data.faults / "fail-3"
    trigger.touch()  # the first write of shard 3 fails with EIO (test-only hook)
    out = data.base / "folders-retried"
    shardprep.build(str(data.class_folders), str(out), shards=SHARDS, engine="ray", progress=False)
    assert not trigger.exists()  # the failure did happen
    assert sorted(_attempts(data)) == sorted([*range(SHARDS), 3])  # shard 3 twice, once each else
    assert _files(out) == data.reference["folders"]


def test_a_lasting_failure_is_not_retried_and_fails_the_build(data: Data, cluster: str) -> None:
    (data.faults / "attempts").unlink(missing_ok=True)
    deny = data.faults / "deny-6"
    deny.touch()  # every write of shard 6 fails with EACCES (test-only hook)
    out = data.base / "folders-denied"
    try:
        with pytest.raises(WriteError, match="shard 6: .*injected lasting failure") as caught:
            shardprep.build(
                str(data.class_folders), str(out), shards=SHARDS, engine="ray", progress=False
            )
    finally:
        deny.unlink()
    assert caught.value.shard_index == 6
    assert _attempts(data).count(6) == 1  # not retried
    assert not list(out.glob(".*.partial"))
    assert not (out / "manifest.json").exists()


def _denied_while_held(data: Data, out: Path, caplog: pytest.LogCaptureFixture) -> list[str]:
    """A build whose shard 7 fails for good while shard 5's write is held: the failure
    cancels the tasks in flight, the held one among them. What the build logged."""
    (data.faults / "hold-5").touch()
    (data.faults / "deny-7").touch()
    try:
        with (
            caplog.at_level(logging.WARNING, logger="shardprep"),
            pytest.raises(WriteError, match="shard 7: .*injected lasting failure"),
        ):
            shardprep.build(
                str(data.class_folders), str(out), shards=SHARDS, engine="ray", progress=False
            )
    finally:
        (data.faults / "deny-7").unlink()
        (data.faults / "hold-5").unlink(missing_ok=True)
        (data.faults / "attempts").unlink(missing_ok=True)
    return [r.getMessage() for r in caplog.records if r.name == "shardprep"]


def test_a_long_wait_for_cancelled_tasks_names_them_and_ends_when_ray_stops_them(
    data: Data, cluster: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ray_engine, "CANCEL_NOTICE_S", 0.0)  # announce the wait at once
    said = _denied_while_held(data, data.base / "folders-cancel-notice", caplog)
    assert len(said) == 1, said  # the announcement only: Ray stopped every task in time
    assert said[0].startswith("waiting up to 60 s more for ")
    assert "shard 5" in said[0] and "Ctrl-C again to stop waiting" in said[0]
    assert not list((data.base / "folders-cancel-notice").glob(".*.partial"))


def test_cancelled_tasks_still_running_at_the_deadline_are_named(
    data: Data, cluster: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ray_engine, "CANCEL_WAIT_S", 0.0)  # the deadline passes at once
    said = _denied_while_held(data, data.base / "folders-cancel-deadline", caplog)
    assert len(said) == 1, said
    assert "cancelled Ray task(s) still running after 0 s: " in said[0]
    assert "shard 5" in said[0]  # held: it cannot have ended before Ray kills it
    assert "before running this build again" in said[0]


def _await_file(path: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def test_a_task_ending_as_the_build_stops_is_left_to_end_not_cancelled(
    cluster: str, tmp_path: Path
) -> None:
    """What stops a build (a task's error, a Ctrl-C just after a shard appears) often comes
    as another task ends; cancelling that one can abort the driver inside Ray 2.60 (a cancel
    racing the task's reply). A task that ends within the grace is left alone; one still
    running after it is cancelled."""

    @ray.remote(max_retries=0)
    def ends_on(go: str, started: str) -> str:
        open(started, "w").close()
        while not os.path.exists(go):
            time.sleep(0.005)
        time.sleep(0.05)  # ends 50 ms after the go: inside the grace, after a cancel
        return "ended"

    engine = ray_engine.RayEngine(ray)
    go, held = tmp_path / "go", tmp_path / "never"
    soon = ends_on.remote(str(go), str(tmp_path / "soon-started"))
    stuck = ends_on.remote(str(held), str(tmp_path / "stuck-started"))
    _await_file(tmp_path / "soon-started")
    _await_file(tmp_path / "stuck-started")
    go.touch()  # the first task ends now, as the build stops
    engine._cancel({soon: "shard 0", stuck: "shard 5"})
    assert ray.get(soon, timeout=DEADLINE_S) == "ended"
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(stuck, timeout=DEADLINE_S)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for_first_shard(driver: subprocess.Popen[bytes], out: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not (out / "shard-00000.tar").exists():  # a shard written: mid-build
        assert driver.poll() is None, driver.communicate()
        assert time.monotonic() < deadline, "the driver wrote no shard in time"
        time.sleep(0.05)


def test_ctrl_c_cancels_the_ray_tasks_and_resume_finishes(data: Data, cluster: str) -> None:
    out = data.base / "folders-ctrl-c"
    (data.faults / "hold-5").touch()  # shard 5 waits: the build cannot finish before Ctrl-C
    # the CLI, its writes through the fault hooks (tests/engine/faulty.py)
    command = [sys.executable, "-m", "tests.engine.faulty", str(data.faults), "build"]
    command += [str(data.class_folders), str(out)]
    command += ["-n", str(SHARDS), "--engine", "ray", "--ray-address", cluster]
    driver = subprocess.Popen(
        command,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        # Ctrl-C as in a terminal, even when pytest itself started with SIGINT ignored (a
        # background job of a non-interactive shell does, and the child would inherit it)
        preexec_fn=_default_sigint,
    )
    try:
        _wait_for_first_shard(driver, out)
        driver.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends
        _, stderr = driver.communicate(timeout=DEADLINE_S)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.communicate(timeout=30)  # reaps it and closes its pipes
        (data.faults / "hold-5").unlink(missing_ok=True)
    assert driver.returncode == 130, stderr.decode()
    assert "run the same command with --resume" in stderr.decode()
    assert not list(out.glob(".*.partial"))  # the held task was cancelled, its file removed
    assert not (out / "shard-00005.tar").exists()
    summary = shardprep.build(
        str(data.class_folders), str(out), shards=SHARDS, engine="ray", resume=True, progress=False
    )
    assert 1 <= summary.reused_shards < SHARDS
    assert _files(out) == data.reference["folders"]


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def _kill_session(sid: int) -> None:
    for pid in _session_pids(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_killed_ray_driver_is_finished_with_resume(data: Data, cluster: str) -> None:
    out = data.base / "folders-killed"
    (data.faults / "hold-5").touch()  # shard 5 waits: the build cannot finish before the kill
    ray_tmp = tempfile.mkdtemp(prefix="sp-ray-", dir="/tmp")  # short: Ray's socket paths
    # TMPDIR: the killed driver's scratch folder stays in the test's tmp
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_ADDRESS": "", "TMPDIR": str(data.base)}
    # the CLI, its writes through the fault hooks (tests/engine/faulty.py)
    command = [sys.executable, "-m", "tests.engine.faulty", str(data.faults), "build"]
    command += [str(data.class_folders), str(out)]
    command += ["-n", str(SHARDS), "--engine", "ray", "--workers", "2", "-q"]
    driver = subprocess.Popen(
        command,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        _wait_for_first_shard(driver, out)
        deadline = time.monotonic() + DEADLINE_S
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and its process group
        driver.communicate(timeout=30)
        # Ray's own processes of that session die with their driver (fate sharing).
        while _session_pids(driver.pid):
            assert time.monotonic() < deadline, f"left over: {_session_pids(driver.pid)}"
            time.sleep(0.1)
    finally:
        _kill_session(driver.pid)
        if driver.poll() is None:
            driver.kill()
        driver.wait(timeout=30)
        (data.faults / "hold-5").unlink(missing_ok=True)
    assert not (out / "manifest.json").exists()
    assert not (out / "shard-00005.tar").exists()
    summary = shardprep.build(
        str(data.class_folders), str(out), shards=SHARDS, engine="ray", resume=True, progress=False
    )
    assert 1 <= summary.reused_shards < SHARDS
    assert _files(out) == data.reference["folders"]


def test_a_hung_task_stops_the_build_after_the_stall_timeout(data: Data, cluster: str) -> None:
    """A write that never returns (held by the test hook) is cancelled; --resume finishes."""
    hold = data.faults / "hold-4"
    hold.touch()
    out = data.base / "folders-stalled"
    try:
        with pytest.raises(
            StalledError, match=r"shard 4: no progress for 2 s \(the stall timeout\)"
        ):
            shardprep.build(
                str(data.class_folders),
                str(out),
                shards=SHARDS,
                engine="ray",
                stall_timeout=2.0,
                progress=False,
            )
    finally:
        hold.unlink()
    assert not (out / "manifest.json").exists()
    assert not list(out.glob(".*.partial"))
    shardprep.build(
        str(data.class_folders), str(out), shards=SHARDS, engine="ray", resume=True, progress=False
    )
    assert _files(out) == data.reference["folders"]


def test_workers_that_keep_dying_fail_the_build_with_its_own_error(
    data: Data, cluster: str
) -> None:
    """Issue 23 item 7.2: every attempt at shard 2 kills its own worker process (os._exit)."""
    from tests.faults.helpers import error_lines, invoke

    (data.faults / "attempts").unlink(missing_ok=True)
    crash = data.faults / "crash-2"
    crash.touch()
    out = data.base / "folders-crashed"
    try:
        args = [str(data.class_folders), str(out), "-n", str(SHARDS), "--engine", "ray", "-q"]
        result = invoke("build", *args)  # no traceback, one message
    finally:
        crash.unlink()
    assert result.exit_code == 1, result.output
    kept = len(list(out.glob("shard-*.tar")))  # was: "the finished shards are kept", uncounted
    assert error_lines(result) == [
        "Error: shard 2: the Ray worker process running it died on each of its 4 attempts "
        "(WorkerCrashedError): Ray kills a worker whose node runs out of memory (free memory "
        "or give Ray fewer CPUs with --workers), and a crash in native code ends one too (see "
        "the worker logs under /tmp/ray/session_latest/logs); "
        + (f"the {kept} finished shard(s) are kept" if kept else "no shard was finished")
        + ": fix the cause, then run the same command with --resume"
    ]
    assert _attempts(data).count(2) == 4  # Ray's own retries (max_retries=3), then ours
    assert not (out / "manifest.json").exists()
    assert not list(out.glob(".*.partial"))
    result = invoke("build", *args, "--resume")
    assert result.exit_code == 0, result.output
    assert _files(out) == data.reference["folders"]
