"""Peak-memory measurement of a whole process tree via PSS.

Why PSS: DataLoader workers and LitData/shardprep build workers are forked, so
their copy-on-write pages are shared with the parent. Summing RSS would count
those pages once per process; PSS splits every shared page between its users,
so the sum over the tree counts each page once.

The sampler runs in the *benchmark driver* (a different process from the one
measured), reads ``/proc/<pid>/smaps_rollup`` of the root process and all its
descendants every ``interval`` seconds and keeps the maximum of the sum.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def _children_map() -> dict[int, list[int]]:
    """Return ``ppid -> [pid, ...]`` for every process visible in /proc."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # comm may contain spaces/parens: fields after the last ')' are fixed
        rest = stat[stat.rfind(b")") + 2 :].split()
        try:
            ppid = int(rest[1])
        except (IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(name))
    return out


def descendants(root: int) -> list[int]:
    """Return ``root`` and all its (transitive) child processes."""
    children = _children_map()
    todo, seen = [root], []
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo.extend(children.get(pid, ()))
    return seen


def pss_bytes(pid: int) -> int:
    """PSS of one process in bytes (0 if it has gone away)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def tree_pss(root: int) -> int:
    """Sum of PSS over ``root`` and its descendants, in bytes."""
    return sum(pss_bytes(p) for p in descendants(root))


class PeakSampler:
    """Background thread keeping the max PSS of a process tree."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid = pid
        self.interval = interval
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss(self.pid))
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Measured:
    """Outcome of one measured subprocess."""

    returncode: int
    wall_s: float
    peak_pss: int
    stdout: str
    stderr: str


def run_measured(
    cmd: Sequence[str] | str,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    timeout: float | None = None,
    shell: bool = False,
    interval: float = 0.02,
) -> Measured:
    """Run ``cmd`` in a fresh process, sampling its tree's PSS until it exits.

    ``wall_s`` is measured around the whole child (interpreter start included);
    Python runners also report their own in-process timings on stdout.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        shell=shell,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so a timeout can kill the whole group
    )
    with PeakSampler(proc.pid, interval) as sampler:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            err += f"\n[bench] killed after {timeout}s timeout"
    wall = time.perf_counter() - t0
    return Measured(proc.returncode, wall, sampler.peak, out, err)
