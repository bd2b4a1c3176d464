"""A trainer killed after a guard refused its DataLoader leaves no process behind.

``loader.torch.guards`` refuses a DataLoader ``batch_size`` over a batching ShardDataset and
accelerate's re-splitting wrapper inside each worker, in ``TorchLayer.__iter__``. The
refused workers stay alive, waiting for work; under ``forkserver`` their parent is the
fork server, so only the lifeline (``loader.torch.lifeline``) ends them, and with them the fork
server and the resource tracker, when the trainer dies. The lifeline is started before
the guards run (it once came after them: everything was still running 20 s and 90 s
after the kill). Same checks as ``tests/faults/test_orphans.py``, whose helpers these are.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.orphan_job import WORKERS
from tests.faults.test_orphans import GONE_S, _wait_for_report
from tests.processes import kill_session, session_processes, wait_until_gone

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("guard", ["rebatched", "resplit"])
def test_refused_workers_exit_when_the_trainer_is_killed(
    built: Path, tmp_path: Path, guard: str
) -> None:
    report_path, log = tmp_path / "report.json", tmp_path / "trainer.log"
    with log.open("wb") as sink:
        trainer = subprocess.Popen(
            [sys.executable, "-m", "tests.integrations.refused_job", str(built), guard,
             str(report_path)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=sink,
            start_new_session=True,
        )  # fmt: skip
    session = trainer.pid  # the leader of its own session
    try:
        report = _wait_for_report(report_path, trainer, log)
        workers = report["workers"]
        assert len(workers) == WORKERS, report
        # a refused worker waits for work; one whose refused generator then ran dry (resplit:
        # accelerate's wrapper raises at the first item, then ends) may have exited already
        assert set(workers) & set(session_processes(session, zombies=False)), report
        trainer.kill()  # SIGKILL: no handler, no finalizer runs
        trainer.wait(timeout=30)
        left = wait_until_gone(session, GONE_S)
        assert not left, (
            f"{len(left)} processes of the trainer's session still run {GONE_S} s after its "
            f"SIGKILL, once a guard had refused its DataLoader ({guard}): {left}\n"
            f"{log.read_text()[-3000:]}"
        )
    finally:
        kill_session(session)
        with contextlib.suppress(ProcessLookupError):
            trainer.kill()
        trainer.wait(timeout=30)
