"""The rank harness itself: a failed rank is reported with its log, a hung one is killed at the
deadline, and nothing of either run is left (tests/distributed/launch.py forks the ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import ranks
from tests.distributed.harness import run_ranks
from tests.processes import wait_until_gone

pytestmark = pytest.mark.distributed


def test_a_failed_rank_is_named_with_its_traceback(tmp_path: Path) -> None:
    with pytest.raises(AssertionError) as failed:
        run_ranks(ranks.rank_1_fails, 3, tmp_path, timeout=60, marker="MARK-41")
    message = str(failed.value)
    assert "rank exit codes [" in message and "1, " in message.split("rank exit codes")[1][:20]
    assert "RuntimeError: MARK-41: rank 1 failed on purpose" in message
    assert "--- rank1.log ---" in message


def test_a_hung_rank_is_killed_at_the_deadline_with_the_others(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    with pytest.raises(AssertionError, match=r"ranks \[.*1.*\] did not finish within 8 s"):
        run_ranks(ranks.rank_1_hangs, 2, tmp_path, timeout=8, pids=str(pids))
    sessions = {int(p.read_text()) for p in pids.iterdir()}
    assert len(list(pids.iterdir())) == 2 and len(sessions) == 1  # the launcher's session
    assert wait_until_gone(sessions.pop(), 10) == {}
