"""Issue 34 item 5: a build killed by its pid alone takes its workers with it; --resume works.

A scheduler or the out-of-memory killer signals the build's own process, not its group.
Its pool workers (scan workers, shard writers and the --map they run) must then exit within
``GONE_S`` (:mod:`shardprep.format.lifeline`), and a ``--resume`` started right after must
finish the build byte-identical to an uninterrupted one. A resume that starts while the
first build still writes is refused, naming its processes (:mod:`shardprep.out_lock`).

Every build runs as a CLI process in a session of its own (``tests.faults.held_map`` holds
its writers mid-shard); every process of a session is killed on failure or deadline.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import shardprep
from shardprep.format.errors import InputError
from shardprep.format.manifest import JOURNAL_NAME
from shardprep.out_lock import LOCK_WAIT_S, OutLock, hold_out, processes_with_open
from shardprep.scratch import LOCK_NAME
from shardprep.workers import worker_pool
from tests.faults.held_map import keep
from tests.faults.helpers import class_folders, tree_hashes
from tests.processes import kill_session, run_bounded, session_processes, wait_until_gone

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GONE_S = 5.0  # the lifeline takes well under a second; the rest is a busy 2-core machine
READY_S = 90.0
BUILD_S = 120.0
SHARDS = 6
PASSED = 25  # per writer before it holds: its first shard (20 samples) done, 5 into the next
MAP = "tests.faults.held_map:held"


def _command(raw: Path, out: Path, *more: str) -> list[str]:
    return [sys.executable, "-m", "shardprep", "build", str(raw), str(out), "-n", str(SHARDS),
            "-j", "2", "--map", MAP, "-q", *more]  # fmt: skip


def _env(hooks: Path | None, tmp: Path) -> dict[str, str]:
    env = {**os.environ, "TMPDIR": str(tmp)}
    env.pop("HELD_MAP_DIR", None)
    if hooks is not None:
        env["HELD_MAP_DIR"] = str(hooks)
    return env


@contextlib.contextmanager
def _session(
    command: list[str], env: dict[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` in a session of its own; every process of it is SIGKILLed at the end."""
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=sink,
            start_new_session=True,
        )
    try:
        yield process
    finally:
        kill_session(process.pid)
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait(timeout=30)


def _held(hooks: Path, process: subprocess.Popen[bytes], log: Path, count: int = 2) -> list[int]:
    """The pids of the ``count`` workers held by the hooks, once they are (bounded)."""
    deadline = time.monotonic() + READY_S
    while len(held := sorted(int(p.name[5:]) for p in hooks.glob("held-*"))) < count:
        assert process.poll() is None, f"it ended early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not held in {READY_S} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)  # polling for the hooks' marker files, bounded by the deadline
    return held


@contextlib.contextmanager
def _held_build(raw: Path, tmp: Path) -> Iterator[tuple[subprocess.Popen[bytes], list[int]]]:
    """A build of ``raw`` into ``tmp/out`` (hooks in ``tmp/hooks``) in a session of its own,
    once its two writers are held ``PASSED`` samples in: the build and the writers' pids."""
    hooks, log = tmp / "hooks", tmp / "build.log"
    hooks.mkdir()
    (hooks / "hold").write_text(str(PASSED))
    with _session(_command(raw, tmp / "out"), _env(hooks, tmp), log) as build:
        yield build, _held(hooks, build, log)


def _children(pid: int) -> set[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                found.add(int(entry))
    return found


def _kill_alone(process: subprocess.Popen[bytes], how: signal.Signals) -> None:
    """Signal the process by its pid only (not its group), then check its workers go."""
    os.kill(process.pid, how)
    assert process.wait(timeout=30) == -how
    left = wait_until_gone(process.pid, GONE_S)
    assert not left, f"{len(left)} processes outlived the killed process by {GONE_S} s: {left}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """RAW (3 classes x 40 files) and the hashes of its uninterrupted build (same map)."""
    base = tmp_path_factory.mktemp("killed-driver")
    raw = class_folders(base / "raw", seed=34, per_class=40)
    out = base / "reference"
    result = run_bounded(_command(raw, out), BUILD_S, cwd=ROOT, env=_env(None, base))
    assert result.returncode == 0, result.stderr
    return raw, tree_hashes(out)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_writers_end_with_their_killed_build_and_resume_at_once_is_byte_identical(
    reference: tuple[Path, dict[str, str]], tmp_path: Path, how: signal.Signals
) -> None:
    raw, expected = reference
    hooks, out = tmp_path / "hooks", tmp_path / "out"
    with _held_build(raw, tmp_path) as (build, writers):
        assert set(writers) <= _children(build.pid), (writers, _children(build.pid))
        assert [n for n in os.listdir(out) if n.endswith(".partial")]  # shards in progress
        _kill_alone(build, how)
    # no --map process is left to hold anything: the hooks' file goes only to be safe
    (hooks / "hold").unlink()
    result = run_bounded(
        _command(raw, out, "--resume"), BUILD_S, cwd=ROOT, env=_env(hooks, tmp_path)
    )
    assert result.returncode == 0, result.stderr
    assert tree_hashes(out) == expected
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("shardprep-")] == []


def test_a_resume_while_the_build_still_writes_is_refused_naming_it(
    reference: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    raw, expected = reference
    out = tmp_path / "out"
    with _held_build(raw, tmp_path) as (build, writers):
        # the second build's map does not hold: without the lock it would write beside them
        started = time.monotonic()
        second = run_bounded(
            _command(raw, out, "--resume"), BUILD_S, cwd=ROOT, env=_env(None, tmp_path)
        )
        assert time.monotonic() - started >= LOCK_WAIT_S
        assert second.returncode != 0, second.stderr
        assert f"{out}: another shardprep build is still writing into this folder" in second.stderr
        for pid in (build.pid, *writers):
            assert f"{pid} (" in second.stderr, (pid, second.stderr)
        assert build.poll() is None  # the first build was left alone
    result = run_bounded(
        _command(raw, out, "--resume"), BUILD_S, cwd=ROOT, env=_env(None, tmp_path)
    )
    assert result.returncode == 0, result.stderr
    assert tree_hashes(out) == expected


@pytest.mark.parametrize("start", ["fork", "spawn"])
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_pool_workers_end_with_the_process_that_started_them(
    tmp_path: Path, start: str, how: signal.Signals
) -> None:
    """Every worker_pool (the scan's, the writers', fork or spawn) is tied to its process."""
    hooks, log = tmp_path / "hooks", tmp_path / "pool.log"
    hooks.mkdir()
    (hooks / "hold").touch()
    command = [sys.executable, "-m", "tests.faults.held_map", "pool", start, str(hooks)]
    with _session(command, _env(None, tmp_path), log) as process:
        workers = _held(hooks, process, log)
        assert set(workers) <= _children(process.pid)
        assert set(workers) <= set(session_processes(process.pid))
        _kill_alone(process, how)


def test_a_spawned_writer_holds_its_builds_lock_on_out(tmp_path: Path) -> None:
    """Writers spawned (inputs read by URL) get the lock passed, as forked ones inherit it."""
    lock = hold_out(str(tmp_path))
    assert lock is not None
    with worker_pool(1, keep, (lock,), context=multiprocessing.get_context("spawn")) as pool:
        worker = pool.executor.submit(os.getpid).result(timeout=BUILD_S)  # started, lock kept
        lock.close()  # the build's own descriptor goes: the writer's still holds the lock
        with pytest.raises(InputError, match=f"processes with it open: {worker} ") as refused:
            hold_out(str(tmp_path), wait_s=0.2)
        assert str(tmp_path) in str(refused.value)
    again = hold_out(str(tmp_path), wait_s=0)  # the writer is gone: free
    assert again is not None
    again.close()


def _waiting_for(out: Path, process: subprocess.Popen[bytes], log: Path) -> None:
    """Return once ``process`` has OUT open (it waits for OUT's lock, which the test holds)."""
    deadline = time.monotonic() + READY_S
    while process.pid not in {pid for pid, _ in processes_with_open(str(out))}:
        assert process.poll() is None, f"it ended early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not on the lock in {READY_S} s:\n{log.read_text()}"
        time.sleep(0.02)  # polling /proc, bounded by the deadline


def _finish_into(out: Path, reference: Path, lock: OutLock) -> None:
    """Play the first build finishing while the second waits: its output lands in OUT (the
    journal goes last, as ``publish`` removes it), then its lock goes."""
    for name in os.listdir(reference):
        shutil.copyfile(reference / name, out / name)
    with contextlib.suppress(FileNotFoundError):
        (out / JOURNAL_NAME).unlink()
    lock.close()


def test_a_plain_build_that_waited_while_another_finished_is_refused_and_leaves_it(
    reference: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """Two plain builds into one fresh OUT: the second checks OUT once it holds the lock, so a
    first build that finished meanwhile is neither built over nor mixed with other shards."""
    raw, expected = reference
    out, log = tmp_path / "out", tmp_path / "second.log"
    lock = hold_out(str(out))  # the first build: it made OUT and holds it
    assert lock is not None
    with _session(_command(raw, out, "--seed", "1"), _env(None, tmp_path), log) as second:
        _waiting_for(out, second, log)
        _finish_into(out, raw.parent / "reference", lock)
        assert second.wait(timeout=BUILD_S) == 1, log.read_text()
    assert f"Error: {out}: the output folder is not empty" in log.read_text()
    assert tree_hashes(out) == expected  # the first build's files, byte for byte, and no more


def test_a_resume_that_waited_while_the_build_finished_finds_it_complete(
    reference: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """A --resume that waits out the build it would resume, which then finishes: exit 0 and
    ``already_complete``, as the same --resume on a finished OUT (not 'nothing to resume',
    exit 1)."""
    raw, expected = reference
    out, log = tmp_path / "out", tmp_path / "resume.log"
    lock = hold_out(str(out))
    assert lock is not None
    manifest = json.loads((raw.parent / "reference" / "manifest.json").read_text())
    journal = {"input_fingerprint": manifest["input_fingerprint"], "options": manifest["options"]}
    (out / JOURNAL_NAME).write_text(json.dumps(journal, sort_keys=True))
    command = _command(raw, out, "--resume", "--json")
    with _session(command, _env(None, tmp_path), log) as second:
        _waiting_for(out, second, log)
        _finish_into(out, raw.parent / "reference", lock)
        assert second.wait(timeout=BUILD_S) == 0, log.read_text()
    text = log.read_text()
    assert json.loads(text[text.index("{") :])["already_complete"] is True, text
    assert tree_hashes(out) == expected


def test_a_refused_build_removes_killed_builds_scratch_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build killed before OUT existed leaves its scratch folder; the next build command
    removes it even when OUT then refuses it (a --resume with nothing to resume)."""
    scratch = tmp_path / "tmp"
    left = scratch / "shardprep-build-killed01"  # as a killed build leaves it: lock file free
    left.mkdir(parents=True)
    (left / LOCK_NAME).touch()
    (left / "inventory").write_bytes(b"x" * 100)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    raw = class_folders(tmp_path / "raw", seed=3, per_class=2)
    with pytest.raises(InputError, match="no interrupted build to resume here"):
        shardprep.build(raw, str(tmp_path / "out"), shards=2, resume=True)
    assert list(scratch.iterdir()) == []
    assert not (tmp_path / "out").exists()


def test_a_build_waiting_on_an_out_whose_maker_removed_it_makes_and_locks_it_anew(
    tmp_path: Path,
) -> None:
    """A build that made OUT and wrote nothing removes it as it ends (still locked); a build
    that waited on that folder then locks the folder at OUT's path, not the removed one."""
    out, log = tmp_path / "new" / "out", tmp_path / "waiter.log"
    first = hold_out(str(out))
    assert first is not None and first.made == (str(out), str(out.parent))
    waiter = (
        "import os, sys; from shardprep.out_lock import hold_out; "
        "lock = hold_out(sys.argv[1]); "
        "print(lock.made, os.path.samestat(os.fstat(lock.fd), os.stat(sys.argv[1])))"
    )
    command = [sys.executable, "-c", waiter, str(out)]
    with _session(command, _env(None, tmp_path), log) as second:
        _waiting_for(out, second, log)
        first.remove_if_made()  # as LocalDestination.close does, lock held
        assert not out.parent.exists()
        first.close()
        assert second.wait(timeout=BUILD_S) == 0, log.read_text()
    assert log.read_text().split() == [f"('{out}',", f"'{out.parent}')", "True"]
    assert out.is_dir()


def test_a_resume_into_the_empty_out_a_killed_build_made_is_refused_before_the_scan(
    tmp_path: Path,
) -> None:
    """A build killed during its scan leaves OUT empty (it makes OUT as it locks it, before
    the scan): --resume is refused at once, not after a scan (the input here is gone)."""
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(InputError, match=f"{out}: no interrupted build to resume here"):
        shardprep.build(tmp_path / "gone", str(out), shards=2, resume=True)
    assert out.is_dir() and list(out.iterdir()) == []  # OUT it did not make stays
