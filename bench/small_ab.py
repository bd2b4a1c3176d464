"""shardprep against LitData on ``small`` (or any dataset), side by side, one fresh process per epoch.

    python -m bench.small_ab --shardprep OUT --litdata LITOUT [--rounds 3] [--workers 0,2]
                             [--python PY] [--batch 64] [--baseline TREE]

Each round runs every (system, workers) cell once, in an order rotated from round to
round (round-robin), each in a fresh interpreter (``--python``: one interpreter for every
system, e.g. a venv that holds litdata). In that interpreter torch, the loader and litdata
are imported, and ``gc.collect()`` run (the collection the imports owe: not inside any
system's epoch), before the timer starts; the timer covers the dataset's construction, the
DataLoader's workers (started inside it) and one whole epoch, shuffled, seed 0, batches
of ``--batch``. Before every run the files of the system about to run are read once
(``cat`` to /dev/null), so each system starts from a warm page cache.

Reported per cell: samples/s per round (the median, then every round, so the spread
shows), and CPU-seconds per million samples of the process tree (user + system of the
process and of its reaped DataLoader workers, ``os.times()``), which a loaded machine
moves far less than the wall clock. The load average is printed before and after.

shardprep reads through ``ShardDataset(batch_size=B)`` with ``DataLoader(batch_size=None)``
(whole batches: ``Packed`` payloads and a key array); LitData through its
``StreamingDataset``/``StreamingDataLoader`` with the bench's shared collate (each
sample's payload as ``bytes``: ``bench.peers.common.collate``), as ``python -m bench load``
reads it. ``--baseline TREE`` adds a third system, "base": the same shardprep read with the
loader of another checkout (e.g. ``git worktree add /tmp/base COMMIT``) first on
``PYTHONPATH``, for a before/after in the same interleaved run.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

CHILD = "--child"


def _child(system: str, out: str, workers: int, batch: int) -> None:
    """One epoch in this process; prints one JSON line."""
    import torch  # noqa: F401  (imported before the timer, as every library)
    import torch.utils.data

    if os.environ.get("SMALL_AB_WHERE"):
        import loader as where

        print(where.__file__, file=sys.stderr)

    if system == "shardprep":
        from loader import ShardDataset  # (lazy in ``loader``: imported here, untimed)
    else:
        import cloudpickle  # noqa: F401  (LitData imports these two inside its first epoch)
        import pyarrow  # noqa: F401
        from litdata import StreamingDataLoader, StreamingDataset  # noqa: F401

        from bench.peers import litdata_
        from bench.peers.common import collate

    gc.collect()  # the imports' garbage, before the timer, for every system (docs/benchmarks.md)
    t0, c0, i0 = time.perf_counter(), os.times(), _inblock()
    n = 0
    if system == "shardprep":
        ds = ShardDataset(out, seed=0, batch_size=batch)
        dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        for b in dl:
            n += len(b["__key__"])
    else:
        dl = litdata_.loader(out, batch, workers, collate, {})
        for b in dl:
            n += len(b)
    wall = time.perf_counter() - t0
    c1 = os.times()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    cpu += (c1.children_user - c0.children_user) + (c1.children_system - c0.children_system)
    # blocks read from storage, not the page cache: nonzero means the warm-up did not hold
    disk = _inblock() - i0
    print(json.dumps({"samples": n, "wall": wall, "cpu": cpu, "disk_mb": disk * 512 / 1e6}))


def _inblock() -> int:
    import resource

    return sum(
        resource.getrusage(w).ru_inblock for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )


def _warm(out: str) -> None:
    """Read every file of a build once, so that the run starts from the page cache."""
    files = [f for f in glob.glob(os.path.join(out, "**"), recursive=True) if os.path.isfile(f)]
    for name in files:
        with open(name, "rb") as f:
            while f.read(8 << 20):
                pass


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.small_ab", description=__doc__)
    parser.add_argument("--shardprep", required=True, help="a shardprep build")
    parser.add_argument("--litdata", help="a LitData optimize() output of the same samples")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--python", default=sys.executable, help="the interpreter of every run")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--baseline", help="another checkout's loader, as a third system")
    args = parser.parse_args()
    systems = {"shardprep": args.shardprep}
    if args.baseline:
        systems["base"] = args.shardprep
    if args.litdata:
        systems["litdata"] = args.litdata
    cells = [(s, int(w)) for w in args.workers.split(",") for s in systems]
    print(f"command: {' '.join([sys.executable, '-m', 'bench.small_ab', *sys.argv[1:]])}")
    print(f"interpreter: {args.python}; load average before: {_loadavg()}")
    results: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in cells}
    for r in range(args.rounds):
        k = r % len(cells)
        for system, workers in cells[k:] + cells[:k]:
            _warm(systems[system])
            # this script by its path; the repository (or first the baseline) on the path
            first = [args.baseline] if system == "base" else []
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([*first, os.getcwd()]))
            kind = "shardprep" if system == "base" else system
            cmd = [args.python, os.path.abspath(__file__), CHILD, kind, systems[system]]
            cmd += [str(workers), str(args.batch)]
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=args.timeout, check=False, env=env
            )
            if done.returncode:
                sys.exit(f"{system} workers {workers} failed:\n{done.stderr[-3000:]}")
            got = json.loads(done.stdout.strip().splitlines()[-1])
            results[(system, workers)].append(got)
            rate = got["samples"] / got["wall"]
            print(
                f"round {r}: {system:9} workers {workers}: {rate:>9,.0f} samples/s, "
                f"{got['cpu'] / got['samples'] * 1e6:6.2f} CPU-s per M samples, "
                f"{got['disk_mb']:.0f} MB from disk "
                f"(load {_loadavg()})",
                flush=True,
            )
    print(f"load average after: {_loadavg()}")
    print("| system | workers | samples/s median (rounds) | CPU-s per M samples median (rounds) |")
    print("|---|---|---|---|")
    medians: dict[tuple[str, int], float] = {}
    for (system, workers), runs in results.items():
        rates = [g["samples"] / g["wall"] for g in runs]
        cpus = [g["cpu"] / g["samples"] * 1e6 for g in runs]
        medians[(system, workers)] = statistics.median(rates)
        print(
            f"| {system} | {workers} | {statistics.median(rates):,.0f} "
            f"({', '.join(f'{x:,.0f}' for x in rates)}) | {statistics.median(cpus):.2f} "
            f"({', '.join(f'{x:.2f}' for x in cpus)}) |"
        )
    for w in sorted({w for _, w in cells}):
        for other in ("litdata", "base"):
            if (other, w) in medians:
                ratio = medians[("shardprep", w)] / medians[(other, w)]
                print(f"workers {w}: shardprep / {other} = {ratio:.2f}x (medians)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        _child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
