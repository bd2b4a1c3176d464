"""What an append costs next to a full build: ``python -m bench.append``.

    python -m bench.append [--n 200000] [--new 20000] [--rounds 3] [--shards 16]
        [--append-shards 2] [--workers 2] [--work DIR] [--md OUT.md]

Data: ``bench.generate``'s ``small`` set (~1 KiB random payloads, 10 imbalanced classes) of
``n + new`` samples, split by sample id into BASE (the first ``n``) and NEW (the rest), hard
links into two class-folder trees, so NEW's keys are new to the build. A *pristine* build of
BASE (``--shards``) is made once, untimed.

Each round times two variants, in an order rotated from round to round (full first in even
rounds, append first in odd ones), so a change in the machine's load hits both:

* ``full``: ``shardprep.build(BASE, OUT, shards=S)`` into a fresh folder;
* ``append``: ``shardprep.build(NEW, OUT, shards=K, append=True)`` onto a copy of the
  pristine build (copied before the timer; the append reads its indexes for the key check).

Before each run, outside the timer: the output folder is removed (and, for the append, the
pristine build copied), the raw tree the run reads is read once to the end (a warm page cache
for both), ``sync``. Every run is a fresh interpreter that imports shardprep's build modules
before the timer starts; the timer covers the ``shardprep.build`` call only. The markdown gives
per variant the median and min-max over rounds, and the ratio append / full per round (each
round's pair ran back to back).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = "--child"
MARK = "@@APPEND_BENCH@@"
PRELOAD = (
    "shardprep",
    "shardprep.builder",
    "shardprep.append",
    "shardprep.engine.local",
    "shardprep.engine.tasks",
    "shardprep.write",
    "shardprep.plan_store",
    "shardprep.scan",
    "shardprep.format.versions",
    "numpy",
    "multiprocessing.pool",
    "multiprocessing.popen_fork",
    "multiprocessing.synchronize",
)


def _child(mode: str, raw: str, out: str, shards: int, workers: int) -> None:
    """In a fresh interpreter: import, then time one build call; print its result."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import shardprep

    started = time.perf_counter()
    summary = shardprep.build(
        raw, out, shards=shards, workers=workers, progress=False, append=mode == "append"
    )
    elapsed = time.perf_counter() - started
    print(MARK + json.dumps({"elapsed_s": elapsed, "samples": summary.num_samples}))


def _split(data: Path, n: int, base: Path, new: Path) -> None:
    """Hard-link samples with id < n into ``base``, the others into ``new`` (class folders)."""
    for folder in (base, new):
        if folder.exists():
            shutil.rmtree(folder)
    for cls in sorted(os.listdir(data)):
        for target in (base / cls, new / cls):
            target.mkdir(parents=True)
        for name in os.listdir(data / cls):
            target = base if int(name.split(".")[0]) < n else new
            os.link(data / cls / name, target / cls / name)


def _warm(folder: Path) -> None:
    """Read every file under ``folder`` once (a warm page cache for the timed run)."""
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                while f.read(1 << 20):
                    pass


def _run(mode: str, raw: Path, out: Path, shards: int, workers: int) -> float:
    command = [sys.executable, "-m", "bench.append", CHILD, mode, str(raw), str(out)]
    result = subprocess.run(
        [*command, str(shards), str(workers)],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=Path(__file__).resolve().parents[1],
        check=False,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith(MARK)]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} run failed:\n{result.stdout}\n{result.stderr}")
    return float(json.loads(lines[0][len(MARK) :])["elapsed_s"])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == CHILD:
        _child(argv[1], argv[2], argv[3], int(argv[4]), int(argv[5]))
        return
    parser = argparse.ArgumentParser(prog="python -m bench.append", description=__doc__)
    parser.add_argument("--n", type=int, default=200_000, help="samples in the build")
    parser.add_argument("--new", type=int, default=20_000, help="samples appended")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--append-shards", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "bench-append"))
    parser.add_argument("--md", help="also write the markdown table here")
    args = parser.parse_args(argv)

    from bench.generate import Spec, generate

    work = Path(args.work)
    data = generate(Spec("small", args.n + args.new), work / "data")
    base, new = work / "base", work / "new"
    _split(data, args.n, base, new)
    pristine, full_out, append_out = work / "pristine", work / "full", work / "appended"
    for folder in (pristine, full_out, append_out):
        shutil.rmtree(folder, ignore_errors=True)
    _run("full", base, pristine, args.shards, args.workers)  # untimed: the build appended to
    times: dict[str, list[float]] = {"full": [], "append": []}
    loads: list[float] = []
    for r in range(args.rounds):
        for mode in ("full", "append") if r % 2 == 0 else ("append", "full"):
            out = full_out if mode == "full" else append_out
            shutil.rmtree(out, ignore_errors=True)
            if mode == "append":
                shutil.copytree(pristine, out)
                _warm(new)
                _warm(out)
            else:
                _warm(base)
            os.sync()
            loads.append(os.getloadavg()[0])
            times[mode].append(
                _run(mode, new if mode == "append" else base, out, *_shards(args, mode))
            )
            print(f"round {r}: {mode} {times[mode][-1]:.2f} s", file=sys.stderr)
    for folder in (full_out, append_out):
        shutil.rmtree(folder, ignore_errors=True)
    print(_markdown(args, times, loads))
    if args.md:
        Path(args.md).write_text(_markdown(args, times, loads) + "\n")


def _shards(args: argparse.Namespace, mode: str) -> tuple[int, int]:
    return (args.shards if mode == "full" else args.append_shards), args.workers


def _markdown(args: argparse.Namespace, times: dict[str, list[float]], loads: list[float]) -> str:
    ratios = [a / f for a, f in zip(times["append"], times["full"], strict=True)]
    rows = [
        f"| full build of {args.n:,} samples ({args.shards} shards) | "
        f"{statistics.median(times['full']):.2f} s | {min(times['full']):.2f}-"
        f"{max(times['full']):.2f} s | {', '.join(f'{t:.2f}' for t in times['full'])} |",
        f"| append of {args.new:,} samples ({args.append_shards} shards) | "
        f"{statistics.median(times['append']):.2f} s | {min(times['append']):.2f}-"
        f"{max(times['append']):.2f} s | {', '.join(f'{t:.2f}' for t in times['append'])} |",
        f"| append / full, per round | {statistics.median(ratios):.3f} | {min(ratios):.3f}-"
        f"{max(ratios):.3f} | {', '.join(f'{x:.3f}' for x in ratios)} |",
    ]
    command = (
        f"python -m bench.append --n {args.n} --new {args.new} --rounds {args.rounds} "
        f"--shards {args.shards} --append-shards {args.append_shards} --workers {args.workers}"
    )
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"1-min load average before the runs {min(loads):.1f}-{max(loads):.1f}"
    )
    return "\n".join(
        [
            f"`{command}` ({machine}; share appended {args.new / args.n:.0%})",
            "",
            "| variant | median | min-max | rounds (interleaved) |",
            "|---|---|---|---|",
            *rows,
        ]
    )


if __name__ == "__main__":
    main()
