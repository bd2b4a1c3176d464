"""Scaling: is peak memory flat when the dataset grows 10x? (docs/benchmarks.md "Scaling").

``small`` at 1x (200,000 samples, 16 shards) and 10x (2,000,000 samples, 160 shards: the
same shard size). Builders: shardprep w1, webdataset ``ShardWriter``, ``MDSWriter``, LitData
``optimize`` w1. Loaders (one epoch, batch 64, shuffled, DataLoader ``num_workers`` 0 and 2):
shardprep ``ShardDataset(batch_size=64)`` + ``DataLoader(batch_size=None)``, webdataset,
MDS ``StreamingDataset``, LitData ``StreamingDataset``.

What is measured: every build / epoch runs in a fresh interpreter (``--child``) that first
imports torch and the system's modules, then records its own PSS and anonymous PSS (the
*baseline*: interpreter + torch + the system's libraries), then runs the measured call. The
driver samples ``/proc/<pid>/smaps_rollup`` of that process and all its descendants every
20 ms and keeps the peak of the summed ``Pss`` and, separately, of the summed ``Pss_Anon``
(anonymous memory: heap, buffers, shared-memory excluded; file pages mapped by a reader
are in ``Pss`` but not in ``Pss_Anon``). Reported: peak minus baseline, per run, for both.

Interleaving: in each round the systems run in an order rotated by the round number, and
each system's 1x and 10x runs are back to back (factor order alternating per round). Files
are read into the page cache right before each run (raw tree before a build, the built
folder before an epoch). Results are appended to ``WORK/results.jsonl`` (one line per run),
so a long run can be stopped and resumed; ``--report`` prints the tables.

    /tmp/bench-venv/bin/python -m bench.scale_memory --work-dir /tmp/scaling \\
        --raw1x /tmp/smallpath/small-200000 --build-rounds 1 --load-rounds 3
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.memory import descendants

BATCH = 64
SHARDS_1X = 16
INTERVAL = 0.02


# ------------------------------------------------------------------ sampling
def _mem(pid: int | str) -> tuple[int, int]:
    """``(Pss, Pss_Anon)`` of one process in bytes; zeros if it has gone away."""
    pss = anon = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith(b"Pss_Anon:"):
                    anon = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0, 0
    return pss, anon


class TreePeak:
    """Background thread: peak of the summed Pss and of the summed Pss_Anon of a tree."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.pss = self.anon = self.samples = 0
        self.max_procs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = descendants(self.pid)
            mems = [_mem(p) for p in pids]
            self.pss = max(self.pss, sum(m[0] for m in mems))
            self.anon = max(self.anon, sum(m[1] for m in mems))
            self.max_procs = max(self.max_procs, len(pids))
            self.samples += 1
            self._stop.wait(INTERVAL)

    def __enter__(self) -> TreePeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ------------------------------------------------------------------ the child
def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One measured build or epoch (runs in a fresh interpreter)."""
    from bench.peers import PEERS

    t = time.perf_counter()
    import torch  # noqa: F401  (every run's baseline includes torch)

    mod = importlib.import_module(PEERS[spec["system"]])
    for name in mod.BUILD_IMPORTS if spec["task"] == "build" else mod.LOAD_IMPORTS:
        importlib.import_module(name)
    import_s = time.perf_counter() - t
    base_pss, base_anon = _mem("self")
    t0 = time.perf_counter()
    if spec["task"] == "build":
        meta = json.loads(Path(spec["meta"]).read_text())
        info = mod.build(spec["raw"], spec["out"], meta, spec["params"])
        res: dict[str, Any] = {"files": info.get("files")}
    else:
        from bench.peers.common import collate
        from bench.runner import _epoch

        make = mod.batch_loader if spec["params"].get("batches") else mod.loader
        dl = make(spec["out"], BATCH, spec["num_workers"], collate, spec["params"])
        res = _epoch(dl, t0)
        res = {"samples": res["samples"], "bytes": res["bytes"]}
    res.update(
        elapsed_s=time.perf_counter() - t0,
        import_s=import_s,
        base_pss=base_pss,
        base_anon=base_anon,
    )
    return res


# ------------------------------------------------------------------ systems
@dataclass(frozen=True)
class Build:
    name: str
    system: str
    params: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Load:
    name: str
    system: str
    built: str  # Build.name whose output is read
    workers: int
    params: tuple[tuple[str, Any], ...] = ()


BUILDS = (
    Build("shardprep w1", "shardprep", (("workers", 1),)),
    Build("webdataset ShardWriter", "webdataset"),
    Build("MDSWriter", "mds"),
    Build("LitData optimize w1", "litdata", (("workers", 1),)),
)
LOADS = tuple(
    Load(name, system, built, w, params)
    for name, system, built, params in (
        ("shardprep ShardDataset", "shardprep", "shardprep w1", (("batches", True),)),
        ("webdataset", "webdataset", "webdataset ShardWriter", ()),
        ("MDS StreamingDataset", "mds", "MDSWriter", ()),
        ("LitData StreamingDataset", "litdata", "LitData optimize w1", ()),
    )
    for w in (0, 2)
)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower())


# ------------------------------------------------------------------ driver
def run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run ``spec`` in a fresh interpreter under the tree sampler."""
    from bench.harness import env_for

    cmd = [sys.executable, "-m", "bench.scale_memory", "--child", json.dumps(spec)]
    t = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        env=env_for(spec["system"]),
        cwd=str(Path(__file__).resolve().parent.parent),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    with TreePeak(proc.pid) as peak:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            err += f"\nkilled after {timeout}s"
    wall = time.perf_counter() - t
    lines = [x for x in out.splitlines() if x.startswith("@@SCALE@@ ")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {err.strip()[-400:]}"}
    res: dict[str, Any] = json.loads(lines[-1].split(" ", 1)[1])
    res.update(
        peak_pss=peak.pss,
        peak_anon=peak.anon,
        max_procs=peak.max_procs,
        sampler_samples=peak.samples,
        wall_s=wall,
    )
    return res


def warm(path: Path) -> float:
    """Read every file under ``path`` once (into the page cache); seconds taken."""
    t = time.perf_counter()
    subprocess.run(
        f"find '{path}' -type f -print0 | xargs -0 -r -n 2000 cat > /dev/null",
        shell=True,
        check=True,
    )
    return time.perf_counter() - t


def log(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Driver:
    def __init__(self, work: Path, roots: dict[str, Path], timeout: float) -> None:
        self.work = work
        self.roots = roots
        self.timeout = timeout
        self.results = work / "results.jsonl"

    def out(self, factor: str, build: str) -> Path:
        return self.work / "built" / factor / slug(build)

    def record(self, row: dict[str, Any]) -> None:
        row["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
        row["loadavg"] = os.getloadavg()[0]
        with open(self.results, "a") as f:
            f.write(json.dumps(row) + "\n")

    def build(self, rnd: int, factor: str, b: Build) -> None:
        import shutil

        root = self.roots[factor]
        out = self.out(factor, b.name)
        if out.exists():  # only ever a folder this driver created under WORK/built
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        warm_s = warm(root / "raw")
        shards = SHARDS_1X * (10 if factor == "10x" else 1)
        spec = {
            "task": "build",
            "system": b.system,
            "raw": str(root / "raw"),
            "meta": str(root / "meta.json"),
            "out": str(out),
            "params": {"shards": shards, **dict(b.params)},
        }
        res = run_child(spec, self.timeout)
        self._log("build", rnd, factor, b.name, res)
        self.record(
            {
                "task": "build",
                "round": rnd,
                "factor": factor,
                "name": b.name,
                "warm_s": warm_s,
                **res,
            }
        )

    def load(self, rnd: int, factor: str, lv: Load) -> None:
        out = self.out(factor, lv.built)
        n = sum(json.loads((self.roots[factor] / "meta.json").read_text())["counts"])
        warm_s = warm(out)
        spec = {
            "task": "load",
            "system": lv.system,
            "out": str(out),
            "num_workers": lv.workers,
            "params": {"shuffle": True, **dict(lv.params)},
        }
        res = run_child(spec, self.timeout)
        if "error" not in res and res["samples"] != n:
            res["error"] = f"epoch yielded {res['samples']} samples, expected {n}"
        self._log("load", rnd, factor, f"{lv.name} w{lv.workers}", res)
        self.record(
            {
                "task": "load",
                "round": rnd,
                "factor": factor,
                "name": lv.name,
                "workers": lv.workers,
                "warm_s": warm_s,
                **res,
            }
        )

    @staticmethod
    def _log(task: str, rnd: int, factor: str, name: str, res: dict[str, Any]) -> None:
        if "error" in res:
            log(f"r{rnd} {task} {factor} {name}: ERROR {res['error']}")
            return
        log(
            f"r{rnd} {task} {factor} {name}: +PSS {(res['peak_pss'] - res['base_pss']) / 2**20:.0f}"
            f" MiB, +anon {(res['peak_anon'] - res['base_anon']) / 2**20:.0f} MiB,"
            f" {res['elapsed_s']:.1f}s"
        )


def rotate(items: tuple[Any, ...], k: int) -> tuple[Any, ...]:
    k %= len(items)
    return items[k:] + items[:k]


def factors_for(rnd: int, factors: tuple[str, ...]) -> tuple[str, ...]:
    return factors if rnd % 2 == 0 else tuple(reversed(factors))


# ------------------------------------------------------------------ report
def _mib(x: float) -> str:
    return f"{x / 2**20:,.0f}"


def report(results: Path) -> str:
    """Markdown tables: per system and factor, median (min-max) of peak-minus-baseline."""
    rows = [json.loads(x) for x in results.read_text().splitlines() if x.strip()]
    out: list[str] = []
    for task, keys in (
        ("load", [(lv.name, lv.workers) for lv in LOADS]),
        ("build", [(b.name, None) for b in BUILDS]),
    ):
        out.append(f"\n{task}:\n")
        out.append(
            "| system | workers | runs 1x/10x | +PSS 1x | +PSS 10x | PSS 10x/1x | +anon 1x"
            " | +anon 10x | anon 10x/1x | baseline PSS | peak PSS 1x | peak PSS 10x"
            " | elapsed s 1x | elapsed s 10x |"
        )
        out.append("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, w in keys:
            sel = {
                f: [
                    r
                    for r in rows
                    if r["task"] == task
                    and r["name"] == name
                    and r.get("workers") == w
                    and r["factor"] == f
                    and "error" not in r
                ]
                for f in ("1x", "10x")
            }
            errs = [
                r["error"]
                for r in rows
                if r["task"] == task
                and r["name"] == name
                and r.get("workers") == w
                and "error" in r
            ]

            def med(f: str, key: str, sel: dict[str, list[Any]] = sel) -> float:
                vals = [_val(r, key) for r in sel[f]]
                return statistics.median(vals) if vals else float("nan")

            def cell(f: str, key: str, sel: dict[str, list[Any]] = sel) -> str:
                vals = [_val(r, key) for r in sel[f]]
                if not vals:
                    return "-"
                m = _mib(statistics.median(vals))
                return m if len(vals) == 1 else f"{m} ({_mib(min(vals))}-{_mib(max(vals))})"

            def ratio(key: str) -> str:
                a, b = med("1x", key), med("10x", key)
                return f"{b / a:.2f}" if a == a and b == b and a > 0 else "-"

            out.append(
                f"| {name} | {'' if w is None else w} | {len(sel['1x'])}/{len(sel['10x'])}"
                f" | {cell('1x', 'dpss')} | {cell('10x', 'dpss')} | {ratio('dpss')}"
                f" | {cell('1x', 'danon')} | {cell('10x', 'danon')} | {ratio('danon')}"
                f" | {cell('1x', 'base_pss')} | {cell('1x', 'peak_pss')} | {cell('10x', 'peak_pss')}"
                f" | {med('1x', 'elapsed_s'):.1f} | {med('10x', 'elapsed_s'):.1f} |"
                + (f" errors: {errs}" if errs else "")
            )
    return "\n".join(out)


def _val(r: dict[str, Any], key: str) -> float:
    if key == "dpss":
        return float(r["peak_pss"] - r["base_pss"])
    if key == "danon":
        return float(r["peak_anon"] - r["base_anon"])
    return float(r[key])


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print("@@SCALE@@ " + json.dumps(child(json.loads(sys.argv[2]))), flush=True)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/scaling"))
    p.add_argument("--raw1x", type=Path, default=None, help="existing 1x dataset root")
    p.add_argument("--raw10x", type=Path, default=None, help="existing 10x dataset root")
    p.add_argument("--n", type=int, default=200_000, help="1x sample count")
    p.add_argument("--build-rounds", type=int, default=1)
    p.add_argument(
        "--build-rounds-1x",
        type=int,
        default=None,
        help="extra build rounds at 1x only (default: --build-rounds)",
    )
    p.add_argument("--load-rounds", type=int, default=3)
    p.add_argument("--skip-builds", action="store_true", help="reuse WORK/built")
    p.add_argument("--first-build-round", type=int, default=0)
    p.add_argument("--first-load-round", type=int, default=0)
    p.add_argument(
        "--skip-10x-loads",
        default="",
        help="comma-separated loader names run at 1x only in these rounds (slow 10x epochs)",
    )
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--report", action="store_true")
    a = p.parse_args()
    work = a.work_dir.resolve()
    if a.report:
        print(report(work / "results.jsonl"))
        return 0
    from bench.generate import Spec, generate

    roots = {
        "1x": a.raw1x or work / f"small-{a.n}",
        "10x": a.raw10x or work / f"small-{a.n * 10}",
    }
    for f, n in (("1x", a.n), ("10x", a.n * 10)):
        generate(Spec("small", n), roots[f])  # reused when complete
    d = Driver(work, roots, a.timeout)
    if not a.skip_builds:
        rounds_1x = a.build_rounds if a.build_rounds_1x is None else a.build_rounds_1x
        for rnd in range(a.first_build_round, max(a.build_rounds, rounds_1x)):
            for b in rotate(BUILDS, rnd):
                for f in factors_for(rnd, ("1x", "10x")):
                    if f == "10x" and rnd >= a.build_rounds:
                        continue
                    if f == "1x" and rnd >= rounds_1x:
                        continue
                    d.build(rnd, f, b)
    for rnd in range(a.first_load_round, a.load_rounds):
        for lv in rotate(LOADS, rnd * 2):
            for f in factors_for(rnd, ("1x", "10x")):
                if f == "10x" and lv.name in a.skip_10x_loads.split(","):
                    continue
                d.load(rnd, f, lv)
    print(report(d.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
