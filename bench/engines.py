"""Build throughput and memory per engine: ``python -m bench.engines RAW [RAW ...]``.

For each RAW (a cached bench dataset such as ``/tmp/shardprep-bench/data/small-200000``)
and each variant, one ``shardprep build`` in a fresh process tree: files/s
from the build's own timer (``elapsed_s`` in ``--json``; Ray's start-up is
outside it, and given as ``wall_s``), and the peak PSS and peak anonymous
memory of the whole tree (driver, workers, and for a local Ray instance its
raylet, GCS and workers), sampled every 20 ms from ``/proc/<pid>/smaps_rollup``.

Variant ``ray-nice0`` is ``ray`` with ``RAY_worker_niceness=0``: Ray runs its
workers at nice 15 by default, which on a machine shared with other jobs
starves them (on a dedicated node it changes nothing).

``--base DIR``: also run the shardprep found in DIR (an unpacked older
commit, e.g. ``git archive <commit> | tar -x -C DIR``) as variant ``base``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from bench.memory import descendants


def _rollup(pid: int) -> tuple[int, int]:
    """(PSS, Anonymous) of one process in bytes; zeros if it has gone away."""
    pss = anon = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith(b"Anonymous:"):
                    anon = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0, 0
    return pss, anon


def measure(cmd: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run ``cmd``; its result JSON plus wall time and peak tree PSS / anonymous memory."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, cwd=tempfile.gettempdir(),  # not the checkout: PYTHONPATH decides
    )  # fmt: skip
    peaks = [0, 0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            totals = [_rollup(p) for p in descendants(proc.pid)]
            peaks[0] = max(peaks[0], sum(t[0] for t in totals))
            peaks[1] = max(peaks[1], sum(t[1] for t in totals))
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        stop.set()
        sampler.join()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    result: dict[str, Any] = json.loads(out)
    result.update(
        wall_s=round(time.perf_counter() - started, 2),
        peak_pss_mib=round(peaks[0] / 2**20, 1),
        peak_anon_mib=round(peaks[1] / 2**20, 1),
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("raw", nargs="+")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--variants", default="local,ray")
    parser.add_argument("--base", default=None)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    variants = args.variants.split(",") + (["base"] if args.base else [])
    rows = []
    for raw in args.raw:
        for _ in range(args.repeats):  # variants interleaved: a load change hits them alike
            for variant in variants:
                out = tempfile.mkdtemp(prefix="sp-engine-bench-")
                env = dict(os.environ)
                cmd = [sys.executable, "-m", "shardprep", "build", raw, out, "--overwrite"]
                cmd += ["-n", str(args.shards), "--workers", str(args.workers), "--json"]
                if variant == "base":
                    env["PYTHONPATH"] = args.base
                elif variant == "ray-nice0":  # Ray's workers at the driver's priority
                    env["RAY_worker_niceness"] = "0"
                    cmd += ["--engine", "ray"]
                else:
                    cmd += ["--engine", variant]
                try:
                    r = measure(cmd, env, args.timeout)
                finally:
                    shutil.rmtree(out, ignore_errors=True)
                row = {
                    "raw": os.path.basename(raw.rstrip("/")),
                    "variant": variant,
                    "files": r["num_samples"],
                    "files_per_s": r["files_per_s"],
                    "mb_per_s": r["mb_per_s"],
                    "elapsed_s": r["elapsed_s"],
                    "wall_s": r["wall_s"],
                    "peak_pss_mib": r["peak_pss_mib"],
                    "peak_anon_mib": r["peak_anon_mib"],
                }
                rows.append(row)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
