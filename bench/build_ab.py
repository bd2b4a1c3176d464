"""Build benchmark with every system interleaved round-robin: ``python -m bench.build_ab``.

    python -m bench.build_ab --raw ROOT --dataset small --rounds 3 \\
        [--variants shardprep-w1,mdswriter,...] [--python PY] [--md OUT.md] [--json OUT.json]

``ROOT`` is a generated dataset (``ROOT/meta.json`` + ``ROOT/raw/<class>/<file>``, see
``bench/generate.py``); ``--variants`` takes the slugs or names of ``bench.build.VARIANTS``
(``--list`` prints them). Method, for every run:

* Each round runs every variant once; the order is rotated from round to round by
  ``len(variants) / rounds`` places (:func:`round_order`), so a variant runs early in one
  round and late in another and a change in the machine's load hits every system alike.
* Before the timer, outside it: the run's output folder is removed; every file of the raw
  tree is read once (``read()`` to the end, 1 MiB at a time), so every system starts from a
  warm page cache; ``sync``; the 1-minute load average is recorded.
* Python systems run in a fresh interpreter (``--python``, the same one for every system),
  which imports torch, the system's library and the modules its build call would import
  lazily (:data:`PRELOAD`) before the timer starts. The timer covers the build call only.
  Modules first imported inside the timer are listed per run (``late imports``; LitData's
  spawned workers re-import torch + litdata inside the build: that is LitData's design).
* Floors are shell commands timed whole: ``tar cf OUT/raw.tar -C RAW .`` and
  ``find RAW -type f -print0 | xargs -0 cat > OUT/raw.cat`` (they write their output like the
  builders do; GNU tar writing to ``/dev/null`` skips reading the files).
* Per run: elapsed, files/s, MB/s (raw payload bytes), CPU-s of the process tree over the
  timed part (user + system of the process and its reaped children, ``os.times()``), peak PSS
  of the whole tree (sampled every 20 ms, imports included), output size, blocks read from
  disk during the timed part (``ru_inblock``: nonzero means the warm-up did not hold).
* After the run, outside the timer: the output is measured and removed (its pages leave the
  page cache with it, dirty ones included) and ``sync`` runs, so no run inherits the
  previous one's output or its write-back.

The markdown gives per variant the median and min-max over rounds, and the ratios
shardprep / peer computed round by round (each round's pair ran minutes apart), with the
command and the machine line. Everything the run creates lives in one fresh folder under
``--work``, removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHILD = "--child"
MARK = "@@BUILD_AB@@"
SHARDS = {"small": 16, "images": 16, "text": 8}

# Modules each system's build call would otherwise import inside the timer (checked with the
# ``late imports`` column of a run), imported untimed after torch and the peer's BUILD_IMPORTS.
COMMON_PRELOAD = (
    "numpy",
    "numpy.random",
    "secrets",
    "multiprocessing.pool",
    "multiprocessing.popen_fork",
    "multiprocessing.popen_spawn_posix",
    "multiprocessing.synchronize",
    "multiprocessing.sharedctypes",
)
PRELOAD: dict[str, tuple[str, ...]] = {
    "shardprep": (
        "shardprep.builder",
        "shardprep.engine.local",
        "shardprep.engine.tasks",
        "shardprep.write",
        "shardprep.scan",
        "shardprep.workers",
        "zstandard",
    ),
    "webdataset": ("webdataset.writer",),
    "mds": ("streaming.base.format.mds.writer", "zstd"),
    "litdata": ("litdata.processing.functions", "litdata.processing.data_processor"),
}

# shardprep / peer pairs compared round by round (both must be among the chosen variants)
PAIRS: tuple[tuple[str, str], ...] = (
    ("shardprep w1", "webdataset ShardWriter"),
    ("shardprep w1", "MDSWriter"),
    ("shardprep zstd w1", "MDSWriter zstd"),
    ("shardprep w1", "LitData optimize w1"),
    ("shardprep w2", "LitData optimize w2"),
    ("shardprep zstd w2", "LitData optimize zstd w2"),
    ("shardprep w2", "shardprep ray w2"),  # the local engine against Ray on this machine
)
FLOOR = "tar cf (floor)"


def _engine_variants() -> tuple[Any, ...]:
    """Variants outside ``bench.build.VARIANTS``, run only when named: shardprep's Ray engine
    on this machine (``ray.init`` inside the timer, as a user pays it; the Ray workers' CPU is
    not in the process tree's ``os.times``)."""
    from bench.build import Variant

    return (Variant("shardprep ray w2", "shardprep", {"workers": 2, "engine": "ray"}),)


# ------------------------------------------------------------------ pure logic
def round_order(items: Sequence[str], r: int, rounds: int) -> list[str]:
    """The order of round ``r`` (0-based): ``items`` rotated by ``r * len(items) // rounds``."""
    if not items:
        return []
    k = (r * len(items) // max(1, rounds)) % len(items)
    return [*items[k:], *items[:k]]


@dataclass(frozen=True)
class Spread:
    """Median and range of one figure over the rounds."""

    median: float
    lo: float
    hi: float
    n: int


def spread(values: Sequence[float]) -> Spread | None:
    """Median, min and max of ``values``; None when there are none."""
    if not values:
        return None
    return Spread(statistics.median(values), min(values), max(values), len(values))


def figures(runs: Sequence[dict[str, Any]], variant: str, key: str) -> list[float]:
    """``key`` of every successful run of ``variant``, in round order."""
    ok = [r for r in runs if r["variant"] == variant and "error" not in r and key in r]
    return [float(r[key]) for r in sorted(ok, key=lambda r: int(r["round"]))]


def paired_ratios(runs: Sequence[dict[str, Any]], a: str, b: str, key: str) -> list[float]:
    """``a[key] / b[key]`` for every round in which both ran without error."""
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        if "error" not in r and r["variant"] in (a, b) and r.get(key):
            by_round.setdefault(int(r["round"]), {})[r["variant"]] = float(r[key])
    return [v[a] / v[b] for _, v in sorted(by_round.items()) if a in v and b in v]


# ------------------------------------------------------------------ markdown
def _num(x: float) -> str:
    """3 significant figures, thousands separated."""
    if x == 0:
        return "0"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _cell(s: Spread | None, scale: float = 1.0, suffix: str = "") -> str:
    if s is None:
        return "-"
    m, lo, hi = s.median * scale, s.lo * scale, s.hi * scale
    if s.n == 1 or _num(lo) == _num(hi):
        return f"{_num(m)}{suffix}"
    return f"{_num(m)}{suffix} ({_num(lo)}–{_num(hi)})"


def render(result: dict[str, Any]) -> str:
    """Markdown section for one ``result`` (what :func:`main` stores with ``--json``)."""
    runs: list[dict[str, Any]] = result["runs"]
    meta, mach = result["meta"], result["machine"]
    variants: list[str] = result["variants"]
    loads = [r["load1"] for r in runs]
    lines = [
        f"### Build: `{result['dataset']}` ({meta['n']:,} files, "
        f"{meta['total_bytes'] / 1e6:,.1f} MB raw, {result['shards']} shards requested)",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {mach['cpu']}, {mach['cores']} cores, {mach['ram_gib']:.1f} GiB RAM; "
        f"1-min load average before each run {min(loads):.2f}–{max(loads):.2f}; "
        f"{result['started']} to {result['finished']}; Python {mach['python']} "
        f"(`{result['python']}`, every system); {mach['packages']}; shardprep {mach['commit']}.",
        "",
        f"{result['rounds']} rounds, every variant once per round, order rotated each round "
        f"(round starts: {', '.join(o[0] for o in result['orders'])}). Each Python build runs "
        "in a fresh interpreter that imports torch, the system's library and its build "
        "modules before the timer; the raw tree is read once (every file, to the end) right "
        "before every run, so each run starts from a warm page cache; the output folder is "
        "removed before and after every run (outside the timer), and `sync` runs between "
        "runs. Figures: median (min–max) over the rounds.",
        "",
        "| variant | files/s | MB/s | elapsed s | CPU-s | × tar cf | peak PSS MiB "
        "| PSS after imports MiB | output MB | disk reads MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in variants:
        errs = [r["error"] for r in runs if r["variant"] == v and "error" in r]
        if errs:
            lines.append(f"| {v} | n/a: {errs[0][:120]} |" + " - |" * 8)
            continue
        f = partial_figures(runs, v)
        vs_tar = (
            "1"
            if v == FLOOR
            else _cell(spread(paired_ratios(runs, v, FLOOR, "files_s")), suffix="×")
        )
        lines.append(
            f"| {v} | {_cell(f['files_s'])} | {_cell(f['mb_s'])} | {_cell(f['elapsed_s'])} "
            f"| {_cell(f['cpu_s'])} | {vs_tar} "
            f"| {_cell(f['peak_pss'], 2**-20)} | {_cell(f['pss_after_import'], 2**-20)} "
            f"| {_cell(f['out_bytes'], 1e-6)} | {_cell(f['disk_bytes'], 1e-6)} |"
        )
    moved = [v for v in variants if (m := spread(figures(runs, v, "files_s"))) and m.hi >= 2 * m.lo]
    if moved:
        lines += [
            "",
            f"files/s moved by 2× or more between rounds: {', '.join(moved)}. Compare them "
            "only with the loads of their runs in view (every run, below).",
        ]
    pairs = [(a, b) for a, b in PAIRS if a in variants and b in variants]
    if pairs:
        lines += [
            "",
            "shardprep / peer, files/s, computed within each round (median, min–max):",
            "",
            "| shardprep | peer | ratio |",
            "|---|---|---:|",
        ]
        for a, b in pairs:
            s = spread(paired_ratios(runs, a, b, "files_s"))
            lines.append(f"| {a} | {b} | {_cell(s, suffix='×')} |")
    lines += [
        "",
        "<details><summary>Every run</summary>",
        "",
        "| round | # | variant | elapsed s | files/s | CPU-s | peak PSS MiB | load before "
        "| late imports |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        if "error" in r:
            lines.append(
                f"| {r['round'] + 1} | {r['pos'] + 1} | {r['variant']} | error |" + " - |" * 5
            )
            continue
        late = r.get("late_imports")
        lines.append(
            f"| {r['round'] + 1} | {r['pos'] + 1} | {r['variant']} | {r['elapsed_s']:.2f} "
            f"| {r['files_s']:,.0f} | {r['cpu_s']:.2f} | {r['peak_pss'] / 2**20:,.0f} "
            f"| {r['load1']:.2f} | {', '.join(late) if late else '-'} |"
        )
    lines += ["", "</details>", ""]
    return "\n".join(lines)


def partial_figures(runs: Sequence[dict[str, Any]], variant: str) -> dict[str, Spread | None]:
    """Spread of every tabulated figure of ``variant``."""
    keys = (
        "files_s", "mb_s", "elapsed_s", "cpu_s", "peak_pss", "pss_after_import",
        "out_bytes", "disk_bytes",
    )  # fmt: skip
    return {k: spread(figures(runs, variant, k)) for k in keys}


# ------------------------------------------------------------------ child (timed build)
def _inblock() -> int:
    return sum(
        resource.getrusage(w).ru_inblock for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One build in this fresh interpreter: imports untimed, then the timed build call."""
    t = time.perf_counter()
    import torch  # noqa: F401  (every system pays it outside the timer)

    from bench.peers import PEERS
    from bench.runner import _own_pss

    mod = importlib.import_module(PEERS[spec["system"]])
    engine = ("ray", "shardprep.engine.ray_engine") if spec["params"].get("engine") else ()
    for name in (*mod.BUILD_IMPORTS, *COMMON_PRELOAD, *PRELOAD.get(spec["system"], ()), *engine):
        importlib.import_module(name)
    import_s = time.perf_counter() - t
    meta = json.loads(Path(spec["meta"]).read_text())
    before = set(sys.modules)
    pss0 = _own_pss()
    c0, i0, t0 = os.times(), _inblock(), time.perf_counter()
    info = mod.build(spec["raw"], spec["out"], meta, spec["params"])
    elapsed = time.perf_counter() - t0
    c1, i1 = os.times(), _inblock()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    cpu += (c1.children_user - c0.children_user) + (c1.children_system - c0.children_system)
    new = sorted(set(sys.modules) - before)
    late = sorted({m.split(".")[0] for m in new})
    return {
        "elapsed_s": elapsed,
        "cpu_s": cpu,
        "disk_bytes": (i1 - i0) * 512,
        "import_s": import_s,
        "pss_after_import": pss0,
        "late_imports": late,
        "late_modules": new[:200],
        **info,
    }


def child_main(arg: str) -> int:
    spec = json.loads(arg)
    res = child(spec)
    print(MARK, json.dumps(res), flush=True)
    return 0


# ------------------------------------------------------------------ driver
def warm(raw: Path) -> tuple[float, int]:
    """Read every file under ``raw`` to the end; returns (seconds, bytes)."""
    t, total = time.perf_counter(), 0
    buf = bytearray(1 << 20)
    for dirpath, _, files in os.walk(raw):
        for name in files:
            with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
    return time.perf_counter() - t, total


def _children_usage() -> tuple[float, int]:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime, ru.ru_inblock


def run_one(
    variant: Any, raw: Path, meta_path: Path, out: Path, python: str, shards: int, timeout: float
) -> dict[str, Any]:
    """One measured run of ``variant`` into ``out`` (which must not exist)."""
    from bench.harness import REPO, dir_size, env_for
    from bench.memory import run_measured

    res: dict[str, Any] = {}
    cpu0, blk0 = _children_usage()
    if variant.system in ("tar", "cat"):
        out.mkdir()
        cmd = (
            f"tar cf {shlex.quote(str(out / 'raw.tar'))} -C {shlex.quote(str(raw))} ."
            if variant.system == "tar"
            else f"find {shlex.quote(str(raw))} -type f -print0 | xargs -0 cat > "
            f"{shlex.quote(str(out / 'raw.cat'))}"
        )
        m = run_measured(cmd, shell=True, timeout=timeout)
        cpu1, blk1 = _children_usage()
        res = {"elapsed_s": m.wall_s, "cpu_s": cpu1 - cpu0, "disk_bytes": (blk1 - blk0) * 512}
    else:
        spec = {
            "system": variant.system,
            "raw": str(raw),
            "meta": str(meta_path),
            "out": str(out),
            "params": {"shards": shards, **variant.params},
        }
        cmd_py = [python, "-m", "bench.build_ab", CHILD, json.dumps(spec)]
        m = run_measured(cmd_py, env=env_for(variant.system), cwd=str(REPO), timeout=timeout)
        for line in reversed(m.stdout.splitlines()):
            if line.startswith(MARK):
                res = json.loads(line[len(MARK) :])
                break
    if m.returncode != 0 or not res:
        tail = (m.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {m.returncode}: {tail}"[:300]}
    res["peak_pss"] = m.peak_pss
    res["wall_s"] = m.wall_s
    res["out_bytes"] = dir_size(out)
    return res


def machine(python: str) -> dict[str, Any]:
    """CPU, cores, RAM, interpreter and package versions of ``python``, shardprep commit."""
    from bench.harness import REPO

    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    probe = (
        "import sys, importlib.metadata as m\n"
        "print(sys.version.split()[0])\n"
        "out = []\n"
        "for p in ('torch', 'webdataset', 'mosaicml-streaming', 'litdata', 'zstandard', 'numpy'):\n"
        "    try: out.append(f'{p} {m.version(p)}')\n"
        "    except m.PackageNotFoundError: out.append(f'{p} -')\n"
        "print(', '.join(out))\n"
    )
    done = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    pyver, packages = done.stdout.strip().splitlines()[:2]
    commit = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
        capture_output=True, text=True, timeout=30, check=False,
    ).stdout.strip() or "?"  # fmt: skip
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": ram,
        "python": pyver,
        "packages": packages,
        "commit": commit,
    }


def pick_variants(spec: str | None) -> list[Any]:
    """The chosen ``bench.build.VARIANTS`` (comma-separated slugs or names), in table order."""
    from bench.build import VARIANTS

    if not spec:
        return list(VARIANTS)
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    every = (*VARIANTS, *_engine_variants())
    known = {v.slug: v for v in every} | {v.name: v for v in every}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        slugs = ", ".join(v.slug for v in every)
        raise SystemExit(f"build_ab: unknown variant(s) {unknown}; known: {slugs}")
    chosen = {known[w].name for w in wanted}
    return [v for v in every if v.name in chosen]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(
        prog="python -m bench.build_ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--raw", type=Path, help="dataset root: meta.json + raw/")
    p.add_argument("--dataset", help="small | images | text (labels, default --shards)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", help="comma-separated slugs or names (default: all)")
    p.add_argument("--python", default=sys.executable, help="interpreter of every system")
    p.add_argument("--shards", type=int, help="shards requested (default: 16, text 8)")
    p.add_argument("--md", type=Path, help="write the markdown section here")
    p.add_argument("--json", type=Path, help="write every run's figures here")
    p.add_argument("--work", type=Path, default=Path("/tmp/build-ab"), help="scratch parent")
    p.add_argument("--timeout", type=float, default=1800, help="per run, seconds")
    p.add_argument("--list", action="store_true", help="print the variant slugs and exit")
    a = p.parse_args(argv)
    from bench.build import VARIANTS
    from bench.harness import log

    if a.list:
        print("\n".join(f"{v.slug:28} {v.name}" for v in VARIANTS))
        print("\n".join(f"{v.slug:28} {v.name} (only when named)" for v in _engine_variants()))
        return 0
    if a.raw is None or a.dataset is None:
        p.error("--raw and --dataset are required")
    root = a.raw.resolve()
    if not (root / "meta.json").exists() and (root.parent / "meta.json").exists():
        root = root.parent  # given the raw/ folder itself
    raw, meta_path = root / "raw", root / "meta.json"
    if not meta_path.exists() or not raw.is_dir():
        raise SystemExit(f"build_ab: {root} has no meta.json + raw/ (see bench/generate.py)")
    meta = json.loads(meta_path.read_text())
    n, total = sum(meta["counts"]), meta["total_bytes"]
    shards = a.shards or SHARDS.get(a.dataset, 16)
    variants = pick_variants(a.variants)
    rounds = max(1, a.rounds)
    from bench.__main__ import compile_code_under_test

    compile_code_under_test()  # .pyc for shardprep/loader, as the peers have theirs
    mach = machine(a.python)
    command = shlex.join(["python", "-m", "bench.build_ab", *argv])
    a.work.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{a.dataset}-", dir=a.work))  # ours alone
    started = time.strftime("%Y-%m-%d %H:%M")
    names = [v.name for v in variants]
    by_name = {v.name: v for v in variants}
    runs: list[dict[str, Any]] = []
    orders: list[list[str]] = []
    try:
        for r in range(rounds):
            order = round_order(names, r, rounds)
            orders.append(order)
            for pos, name in enumerate(order):
                v = by_name[name]
                out = scratch / v.slug
                shutil.rmtree(out, ignore_errors=True)
                warm_s, warm_bytes = warm(raw)
                os.sync()
                load1 = os.getloadavg()[0]
                res = run_one(v, raw, meta_path, out, a.python, shards, a.timeout)
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                res.update(round=r, pos=pos, variant=name, load1=load1, warm_s=warm_s)
                res["warm_bytes"] = warm_bytes
                if "error" not in res:
                    res["files_s"] = n / res["elapsed_s"]
                    res["mb_s"] = total / res["elapsed_s"] / 1e6
                    log(
                        f"round {r + 1}/{rounds} #{pos + 1} {name}: {res['elapsed_s']:.2f}s "
                        f"{res['files_s']:,.0f} files/s cpu {res['cpu_s']:.1f}s "
                        f"peak {res['peak_pss'] / 2**20:.0f} MiB load {load1:.2f} "
                        f"warm {warm_s:.1f}s late {res.get('late_imports') or '-'}"
                    )
                else:
                    log(f"round {r + 1}/{rounds} #{pos + 1} {name}: ERROR {res['error']}")
                runs.append(res)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = {
        "dataset": a.dataset,
        "shards": shards,
        "rounds": rounds,
        "variants": names,
        "orders": orders,
        "runs": runs,
        "meta": {"n": n, "total_bytes": total},
        "machine": mach,
        "python": a.python,
        "command": command,
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M"),
    }
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    md = render(result)
    if a.md:
        a.md.write_text(md)
    print(md)
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == CHILD:
        sys.exit(child_main(sys.argv[2]))
    sys.exit(main())
