"""loader.torch.lifeline in isolation: start times, the main process, a trainer gone before the watch."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from loader.torch.lifeline import started_before, watch_trainer
from tests.faults.orphan_job import session_processes

# A "trainer" forks a worker that waits for the test's go (on an inherited pipe) before
# calling watch_trainer(); the test kills the trainer first.
LATE_WORKER = """
import multiprocessing, os, sys, threading
from loader.torch.lifeline import watch_trainer

def worker(go: int) -> None:
    os.read(go, 1)
    watch_trainer()
    threading.Event().wait()

if __name__ == "__main__":
    child = multiprocessing.get_context("fork").Process(target=worker, args=(int(sys.argv[1]),))
    child.start()
    print(child.pid, flush=True)
    threading.Event().wait()
"""


def test_started_before_orders_processes_by_start_time() -> None:
    later = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    with later:
        try:
            assert started_before(os.getppid(), os.getpid())
            assert started_before(os.getpid(), later.pid)
            assert not started_before(later.pid, os.getpid())
        finally:
            later.kill()


def test_the_main_process_starts_no_watcher() -> None:
    before = threading.active_count()
    watch_trainer()  # pytest's process was not started by multiprocessing
    assert threading.active_count() == before


def test_a_worker_whose_trainer_is_already_gone_exits_at_once() -> None:
    go_read, go_write = os.pipe()
    trainer = subprocess.Popen(
        [sys.executable, "-c", LATE_WORKER, str(go_read)],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        pass_fds=(go_read,),
        start_new_session=True,
        text=True,
    )
    os.close(go_read)
    with trainer:
        _kill_the_trainer_then_let_the_worker_go(trainer, go_write)


def _kill_the_trainer_then_let_the_worker_go(trainer: subprocess.Popen[str], go: int) -> None:
    try:
        assert trainer.stdout is not None
        worker = int(trainer.stdout.readline())  # bounded by pytest-timeout
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        assert worker in session_processes(trainer.pid, zombies=False)
        os.write(go, b"!")
        deadline = time.monotonic() + 5
        while worker in session_processes(trainer.pid, zombies=False):
            assert time.monotonic() < deadline, "the orphaned worker did not exit"
            time.sleep(0.02)
    finally:
        os.close(go)
        for pid in session_processes(trainer.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            trainer.kill()
        trainer.wait(timeout=30)
