"""Driver-side plumbing: configuration, datasets, one-run-per-subprocess
execution with PSS sampling, medians, and the results store."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.generate import Spec, generate, load_meta
from bench.memory import Measured, run_measured
from bench.runner import MARK

REPO = Path(__file__).resolve().parent.parent
STUBS = Path(__file__).resolve().parent / "_stubs"
DEFAULT_WORK = Path("/tmp/shardprep-bench")


@dataclass
class Config:
    """Sizes and repetition counts of one benchmark invocation."""

    quick: bool = False
    work: Path = DEFAULT_WORK
    repeats: int = 3
    warmup: int = 1
    sizes: dict[str, int] = field(default_factory=dict)
    scale: tuple[int, int] = (200_000, 2_000_000)
    shards: dict[str, int] = field(default_factory=lambda: {"small": 16, "images": 16, "text": 8})
    timeout: float = 900.0
    command: str = ""
    # how often a measured process's PSS is read (bench.memory): each read of a process that
    # imported torch takes its memory-map lock for ~10 ms, which a reader that maps and unmaps
    # buffers waits on (bench.remote reads it every 1 s: see docs/benchmarks-remote.md)
    pss_interval: float = 0.02

    @classmethod
    def make(cls, quick: bool, work: Path | None, repeats: int | None, command: str) -> Config:
        """Defaults for ``--quick`` (a few minutes) or the full run."""
        if quick:
            c = cls(
                quick=True,
                repeats=1,
                warmup=0,
                sizes={"small": 20_000, "images": 2_000, "text": 5_000},
                scale=(20_000, 200_000),
                timeout=300.0,
            )
        else:
            c = cls(sizes={"small": 200_000, "images": 20_000, "text": 50_000})
        c.work = Path(work) if work else DEFAULT_WORK
        if repeats is not None:
            c.repeats = max(1, repeats)
        c.command = command
        return c


# --------------------------------------------------------------------- data
def dataset(cfg: Config, kind: str, n: int | None = None) -> tuple[Path, dict[str, Any]]:
    """Generate (or reuse) a raw tree; returns ``(dataset_root, meta)``."""
    n = n if n is not None else cfg.sizes[kind]
    root = cfg.work / "data" / f"{kind}-{n}"
    t = time.perf_counter()
    fresh = not (root / "meta.json").exists()
    generate(Spec(kind, n), root)
    if fresh:
        log(f"generated {kind} n={n} in {time.perf_counter() - t:.1f}s")
    return root, load_meta(root)


def dir_size(path: Path) -> int:
    """Total size in bytes of regular files under ``path``."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dp, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dp, f)).st_size
    return total


def rm(path: Path) -> None:
    """Remove a file or folder if present."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


# ------------------------------------------------------------ build cache
_PACKAGES = {"webdataset": "webdataset", "mds": "mosaicml-streaming", "litdata": "litdata"}


def system_stamp(system: str) -> str:
    """Identifies the code that wrote a cached build output.

    Peers: their installed version. shardprep: a hash of the ``shardprep`` and
    ``loader`` sources, so outputs written by an older checkout (format in
    flux) are rebuilt.
    """
    if system in _PACKAGES:
        from importlib import metadata

        try:
            return f"{system}-{metadata.version(_PACKAGES[system])}"
        except metadata.PackageNotFoundError:
            return f"{system}-?"
    if system == "shardprep":
        h = hashlib.sha1()
        files = [*(REPO / "shardprep").rglob("*.py"), *(REPO / "loader").rglob("*.py")]
        for f in sorted(files):
            h.update(str(f.relative_to(REPO)).encode())
            h.update(f.read_bytes())
        return f"shardprep-{h.hexdigest()[:12]}"
    return system


def mark_built(out: Path, system: str) -> None:
    """Record that ``out`` is a complete build by the current ``system`` code."""
    Path(str(out) + ".ok").write_text(system_stamp(system))


def is_built(out: Path, system: str) -> bool:
    """True when ``out`` is complete and was written by the current code."""
    ok = Path(str(out) + ".ok")
    return ok.exists() and ok.read_text() == system_stamp(system)


# ----------------------------------------------------------------- running
def env_for(system: str) -> dict[str, str]:
    """Environment of a measured subprocess: repo importable, MDS gets the
    torchvision stub (see bench/peers/mds.py), nothing else changes."""
    env = dict(os.environ)
    paths = [str(REPO)]
    if system.startswith("mds"):
        paths.insert(0, str(STUBS))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("OMP_NUM_THREADS", "1")
    # peers drop lock files and caches in TMPDIR (MDS: /tmp/000000_*_filelock)
    tmp = Path(os.environ.get("BENCH_TMPDIR", "/tmp/shardprep-bench/tmp"))
    tmp.mkdir(parents=True, exist_ok=True)
    env["TMPDIR"] = str(tmp)
    env["TQDM_DISABLE"] = "1"
    return env


def run_task(
    spec: dict[str, Any], timeout: float, interval: float = 0.02
) -> tuple[dict[str, Any], Measured]:
    """Run ``bench.runner`` with ``spec`` in a fresh process whose PSS is read every
    ``interval`` seconds."""
    cmd = [sys.executable, "-m", "bench.runner", json.dumps(spec)]
    m = run_measured(
        cmd, env=env_for(spec["system"]), cwd=str(REPO), timeout=timeout, interval=interval
    )
    res: dict[str, Any] = {}
    for line in reversed(m.stdout.splitlines()):
        if line.startswith(MARK):
            res = json.loads(line[len(MARK) :])
            break
    if not res:
        tail = (m.stderr.strip().splitlines() or ["no output"])[-1]
        res = {"error": f"exit {m.returncode}: {tail}"[:300]}
    if "error" in res:
        log(f"  ! {spec['system']}: {res['error']}")
    res["peak_pss"] = m.peak_pss
    res["wall_s"] = m.wall_s
    return res, m


def run_shell(cmd: str, timeout: float) -> dict[str, Any]:
    """Run a reference shell command (tar, cat) under the same PSS sampler."""
    m = run_measured(cmd, shell=True, timeout=timeout)
    res: dict[str, Any] = {"wall_s": m.wall_s, "peak_pss": m.peak_pss}
    if m.returncode != 0:
        res["error"] = f"exit {m.returncode}: {m.stderr.strip()[-200:]}"
        log(f"  ! {cmd}: {res['error']}")
    return res


def repeat(cfg: Config, once: Callable[[], dict[str, Any]], label: str) -> dict[str, Any]:
    """Warm-up runs, then ``cfg.repeats`` runs; numeric fields -> median.

    An error in any run makes the whole figure ``n/a`` with that error.
    """
    runs: list[dict[str, Any]] = []
    for i in range(cfg.warmup + cfg.repeats):
        r = once()
        if "error" in r:
            return {"error": r["error"], "runs": len(runs)}
        if i >= cfg.warmup:
            runs.append(r)
    med = median_dict(runs)
    med["runs"] = len(runs)
    log(f"  {label}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in med.items() if k in _LOG_KEYS))
    return med


_LOG_KEYS = ("files_s", "samples_s", "mb_s", "peak_pss", "ttfb_s", "out_bytes")


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def median_dict(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-key median of numeric fields; other fields from the last run."""
    out: dict[str, Any] = {}
    for k in runs[-1]:
        vals = [r[k] for r in runs if k in r]
        if vals and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[k] = statistics.median(vals)
        else:
            out[k] = runs[-1][k]
    return out


# ----------------------------------------------------------------- results
def results_path(cfg: Config) -> Path:
    """``results.json`` in the work dir (sections merge across commands)."""
    return cfg.work / ("results-quick.json" if cfg.quick else "results.json")


def load_results(cfg: Config) -> dict[str, Any]:
    """Previously stored sections (empty when none)."""
    p = results_path(cfg)
    return json.loads(p.read_text()) if p.exists() else {}


def save_section(cfg: Config, name: str, data: Any, started: float, load_before: float) -> None:
    """Store one section's results, keeping the others.

    Also records when it ran, how long it took and the 1-minute load average
    before/after: on a shared 2-core machine, other jobs skew every figure.
    """
    res = load_results(cfg)
    res[name] = data
    res.setdefault("meta", {})
    res["meta"][name] = {
        "command": cfg.command,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "minutes": (time.time() - started) / 60,
        "loadavg": [load_before, os.getloadavg()[0]],
        "repeats": cfg.repeats,
        "warmup": cfg.warmup,
    }
    results_path(cfg).parent.mkdir(parents=True, exist_ok=True)
    results_path(cfg).write_text(json.dumps(res, indent=1))


def log(msg: str) -> None:
    """Progress line on stderr."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
