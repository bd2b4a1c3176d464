"""A real build that stalls (as on a hung disk) once its workers have read ``stall_after``
samples each, killed with SIGKILL once the output shows the wanted state: finished shards and
half-written ones at once, for resume and recovery tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# argv: RAW OUT STALL_AFTER OPTIONS_JSON (shardprep.build keyword arguments)
STALLING_BUILD = """
import json, sys, time
import shardprep, shardprep.write as write

raw, out, stall_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
read_members, count = write._read_members, 0

def stalling(sample, reader):
    global count
    count += 1
    while count > stall_after:
        time.sleep(3600)
    return read_members(sample, reader)

write._read_members = stalling
shardprep.build(raw, out, progress=False, **json.loads(sys.argv[4]))
"""


def names_in(folder: Path) -> list[str]:
    """The names in ``folder`` (none while it does not exist)."""
    return os.listdir(folder) if folder.exists() else []


def kill_stalled_build(
    raw: Path,
    out: Path | str,
    stall_after: int,
    options: dict[str, Any],
    stuck: Callable[[], bool],
    tmpdir: Path,
    env: dict[str, str] | None = None,
    timeout: float = 90,
) -> None:
    """Start the stalling build of ``raw`` into ``out`` with ``options``, wait (bounded) until
    ``stuck()``, then SIGKILL its whole session (its worker processes too). The build's TMPDIR
    is ``tmpdir`` (``env`` adds to the environment), so the scratch folder a killed build cannot
    remove stays in the test's tmp."""
    command = [sys.executable, "-c", STALLING_BUILD, str(raw), str(out), str(stall_after)]
    with tempfile.TemporaryFile() as stderr:  # not in ``tmpdir``: tests list what is there
        proc = subprocess.Popen(
            [*command, json.dumps(options)],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
            env={**os.environ, **(env or {}), "TMPDIR": str(tmpdir)},
        )

        def said() -> str:
            stderr.seek(0)
            return stderr.read().decode(errors="replace")

        try:
            deadline = time.monotonic() + timeout
            while not stuck():
                assert proc.poll() is None, f"the build exited early: {said()}"
                assert time.monotonic() < deadline, f"the build never stalled: {said()}"
                time.sleep(0.01)  # polling interval only
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
