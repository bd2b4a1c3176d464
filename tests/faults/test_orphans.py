"""A killed training process takes its DataLoader workers with it (loader.torch.lifeline).

Each case runs ``tests/faults/orphan_job.py`` in its own session: a trainer whose
2 DataLoader workers have each delivered a batch. The test SIGKILLs the trainer
alone, then every other process of that session (workers, fork server, resource
tracker) must be gone within ``GONE_S``, and every ``/dev/shm`` name the
session had open must be unlinked. Under ``forkserver`` torch's own parent check
never fires (the workers' parent is the fork server): without the lifeline those
cases leave everything running.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.faults.orphan_job import WORKERS
from tests.processes import kill_session, session_processes, wait_until_gone

ROOT = Path(__file__).resolve().parents[2]
READY_S = 120.0  # the trainer's start: spawned workers import torch on a busy 2-core machine
GONE_S = 5.0  # the lifeline takes 0.05-0.2 s here; torch's own check, 5 s plus the exit

CASES = [
    ("fork", "torch", "0"),
    ("fork", "stateful", "1"),
    ("forkserver", "torch", "1"),
    ("forkserver", "stateful", "0"),
    ("spawn", "torch", "0"),
    ("spawn", "stateful", "1"),
    ("forkserver", "lightning", "1"),
]


@pytest.mark.parametrize(
    ("start", "loader", "persistent"),
    CASES,
    ids=[f"{s}-{k}-{'persistent' if p == '1' else 'fresh'}" for s, k, p in CASES],
)
def test_workers_exit_when_the_trainer_is_killed(
    built: Path, tmp_path: Path, start: str, loader: str, persistent: str
) -> None:
    report_path, log = tmp_path / "report.json", tmp_path / "trainer.log"
    trainer = _start_job([str(built), start, loader, persistent, str(report_path)], log)
    session = trainer.pid  # the leader of its own session
    names: set[str] = set()
    try:
        report = _wait_for_report(report_path, trainer, log)
        workers = report["workers"]
        assert len(workers) == WORKERS, report
        assert set(workers) <= set(session_processes(session, zombies=False)), report
        names = _shm_names([trainer.pid, *session_processes(session)])
        if start != "fork":  # the queues' semaphores are named: the residue check bites
            assert any(n.startswith("sem.") for n in names), names
        _kill_and_check(trainer, names, log)
    finally:
        _clean(trainer, names)


def test_workers_of_a_wrapped_dataset_exit_with_a_trainer_killed_before_they_iterate(
    built: Path, tmp_path: Path
) -> None:
    """A user's IterableDataset around a ShardDataset, forkserver: the workers start, but the
    ShardDataset's ``__iter__`` never runs in them (the wrapper's code before it never ends;
    likewise a trainer killed before it sent the first index, or a slow worker_init_fn).
    They are tied to the trainer as they receive the dataset (``loader.torch.lifeline``)."""
    started, log = tmp_path / "workers.txt", tmp_path / "trainer.log"
    trainer = _start_job([str(built), "forkserver", "wrapped", "0", str(started)], log)
    session = trainer.pid
    names: set[str] = set()
    try:
        deadline = time.monotonic() + READY_S  # each worker_init_fn writes its pid: all up
        while len(started.read_text().split() if started.exists() else []) < WORKERS:
            assert trainer.poll() is None, f"the trainer exited early:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no workers in {READY_S} s:\n{log.read_text()}"
            time.sleep(0.02)  # polling for the workers' lines, bounded by the deadline
        workers = [int(pid) for pid in started.read_text().split()]
        assert set(workers) <= set(session_processes(session, zombies=False)), workers
        names = _shm_names([trainer.pid, *session_processes(session)])
        assert any(n.startswith("sem.") for n in names), names  # the residue check bites
        _kill_and_check(trainer, names, log)
    finally:
        _clean(trainer, names)


def _start_job(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """``tests.faults.orphan_job`` with ``args``, leader of a session of its own."""
    with log.open("wb") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.faults.orphan_job", *args],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=sink,
            start_new_session=True,
        )


def _kill_and_check(trainer: subprocess.Popen[bytes], names: set[str], log: Path) -> None:
    """SIGKILL the trainer alone: its session must empty within ``GONE_S`` and the /dev/shm
    ``names`` it had open must be unlinked."""
    trainer.send_signal(signal.SIGKILL)
    trainer.wait(timeout=30)
    left = wait_until_gone(trainer.pid, GONE_S)
    assert not left, (
        f"{len(left)} processes of the killed trainer's session still run {GONE_S} s after "
        f"its SIGKILL: {left}\n{log.read_text()[-3000:]}"
    )
    assert sorted(n for n in names if (Path("/dev/shm") / n).exists()) == []


def _clean(trainer: subprocess.Popen[bytes], names: set[str]) -> None:
    """Kill what is left of the trainer's session and unlink its /dev/shm names."""
    kill_session(trainer.pid)
    with contextlib.suppress(ProcessLookupError):
        trainer.kill()
    trainer.wait(timeout=30)
    for name in names:  # the session's own names only: mapped by its processes
        with contextlib.suppress(FileNotFoundError):
            (Path("/dev/shm") / name).unlink()


def _wait_for_report(path: Path, trainer: subprocess.Popen[bytes], log: Path) -> Any:
    deadline = time.monotonic() + READY_S
    while not path.exists():
        assert trainer.poll() is None, f"the trainer exited early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no report in {READY_S} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)
    return json.loads(path.read_text())


def _shm_names(pids: list[int]) -> set[str]:
    """The /dev/shm names (still linked) that processes ``pids`` have mapped."""
    names = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                    names.add(path.removeprefix("/dev/shm/"))
    return names
