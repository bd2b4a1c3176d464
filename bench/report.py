"""Render ``results.json`` into ``docs/benchmarks.md`` and a PNG plot."""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.harness import Config, load_results, log

MiB = 2**20
PACKAGES = (
    "torch",
    "webdataset",
    "mosaicml-streaming",
    "litdata",
    "numpy",
    "zstandard",
    "shardprep",
)


def machine() -> list[str]:
    """One line per machine fact (CPU, memory, OS, Python, package versions)."""
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        )
        mem_s = f"{mem / 2**20:.1f} GiB"
    except (OSError, StopIteration):
        mem_s = "?"
    vers = []
    for p in PACKAGES:
        try:
            vers.append(f"{p} {metadata.version(p)}")
        except metadata.PackageNotFoundError:
            vers.append(f"{p} (not installed)")
    try:
        tar = subprocess.run(["tar", "--version"], capture_output=True, text=True).stdout
        tar = tar.splitlines()[0]
    except OSError:
        tar = "tar ?"
    return [
        f"CPU: {cpu}, {os.cpu_count()} cores; memory {mem_s}; no GPU",
        f"OS: {platform.platform()}; Python {platform.python_version()}; {tar}",
        "Packages: " + ", ".join(vers),
    ]


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v >= 100:
            return f"{v:,.0f}"
        return f"{v:.{digits}g}"
    return str(v)


def _mib(v: Any) -> str:
    return f"{v / MiB:,.0f}" if isinstance(v, (int, float)) and v else "-"


def _err(r: dict[str, Any]) -> str:
    return "n/a: " + str(r["error"]).replace("|", "/").replace("\n", " ")[:120]


def build_tables(sec: dict[str, Any]) -> list[str]:
    """Markdown tables of the build section."""
    out: list[str] = []
    for kind, d in sec.items():
        out += [
            f"### Build: `{kind}` ({d['n']:,} samples, {d['raw_bytes'] / 1e6:,.1f} MB raw, "
            f"{d['shards']} shards requested)",
            "",
            "| system | files/s | MB/s | x tar cf | peak PSS MiB | PSS after imports MiB "
            "| output MB | import s | runs |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, r in d["rows"].items():
            if "error" in r:
                out.append(f"| {name} | {_err(r)} | | | | | | | |")
                continue
            out.append(
                f"| {name} | {_f(r['files_s'])} | {_f(r['mb_s'])} | {_f(r.get('vs_tar'))} "
                f"| {_mib(r['peak_pss'])} | {_mib(r.get('pss_after_import'))} "
                f"| {r['out_bytes'] / 1e6:,.1f} "
                f"| {_f(r.get('import_s'))} | {r['runs']} |"
            )
        out.append("")
    return out


def load_tables(sec: dict[str, Any]) -> list[str]:
    """Markdown tables of the load section."""
    out: list[str] = []
    for kind, d in sec.items():
        out += [
            f"### Load: `{kind}` ({d['n']:,} samples, batch 64, one epoch)",
            "",
            "| system | workers | samples/s | MB/s | x cat (MB/s) | x tarfile loop | "
            "peak PSS MiB | PSS after imports MiB | TTFB s | import s | all samples | runs |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|---:|",
        ]
        for key, r in d["rows"].items():
            name, w = key.split(" | ")
            w = w[1:] if not name.startswith(("cat", "tarfile")) else "-"
            if "error" in r:
                out.append(f"| {name} | {w} | {_err(r)} | | | | | | | | | |")
                continue
            out.append(
                f"| {name} | {w} | {_f(r['samples_s'])} | {_f(r['mb_s'])} | {_f(r.get('vs_cat'))} "
                f"| {_f(r.get('vs_tarfile'))} | {_mib(r['peak_pss'])} "
                f"| {_mib(r.get('pss_after_import'))} | {_f(r.get('ttfb_s'))} "
                f"| {_f(r.get('import_s'))} | {'yes' if r.get('complete') else 'NO'} "
                f"| {r['runs']} |"
            )
        out.append("")
    return out


def scale_tables(sec: dict[str, Any]) -> list[str]:
    """Markdown tables of the scale section (1x vs 10x)."""
    pts = sec["points"]
    if "1x" not in pts or "10x" not in pts:
        return ["(incomplete)"]
    a, b = pts["1x"], pts["10x"]
    out = [
        f"1x = {a['n']:,} `small` samples in {a['shards']} shards; "
        f"10x = {b['n']:,} in {b['shards']} shards (same shard size).",
        "",
        "**Load** (one epoch, batch 64):",
        "",
        "| system | workers | samples/s 1x | samples/s 10x | peak PSS MiB 1x | "
        "peak PSS MiB 10x | PSS 10x/1x |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key in a["load"]:
        ra, rb = a["load"][key], b["load"].get(key, {"error": "missing"})
        name, w = key.split(" | ")
        if "error" in ra or "error" in rb:
            out.append(f"| {name} | {w[1:]} | {_err(ra if 'error' in ra else rb)} | | | | |")
            continue
        out.append(
            f"| {name} | {w[1:]} | {_f(ra['samples_s'])} | {_f(rb['samples_s'])} "
            f"| {_mib(ra['peak_pss'])} | {_mib(rb['peak_pss'])} "
            f"| {rb['peak_pss'] / ra['peak_pss']:.2f} |"
        )
    out += [
        "",
        "**Build** (1 worker):",
        "",
        "| system | files/s 1x | files/s 10x | peak PSS MiB 1x | peak PSS MiB 10x | PSS 10x/1x |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in a["build"]:
        ra, rb = a["build"][name], b["build"].get(name, {"error": "missing"})
        if "error" in ra or "error" in rb:
            out.append(f"| {name} | {_err(ra if 'error' in ra else rb)} | | | | |")
            continue
        out.append(
            f"| {name} | {_f(ra['files_s'])} | {_f(rb['files_s'])} | {_mib(ra['peak_pss'])} "
            f"| {_mib(rb['peak_pss'])} | {rb['peak_pss'] / ra['peak_pss']:.2f} |"
        )
    return [*out, ""]


def ddp_table(sec: dict[str, Any]) -> list[str]:
    """Markdown table of the DDP exactness section."""
    out = [
        f"{sec['n']} samples in {sec['shards']} shards; gloo on CPU, each rank a separate "
        f"process with {sec['workers']} DataLoader workers; one epoch; every system with its "
        "default remainder handling unless named.",
        "",
        "| system | ranks x workers | batch | samples per rank | steps per rank | len(ds) "
        "| duplicates | drops | padded | equal steps |",
        "|---|---|---:|---|---|---|---:|---:|---:|:-:|",
    ]
    for key, r in sec["rows"].items():
        name, rw, bs = key.split(" | ")
        if "error" in r:
            out.append(f"| {name} | {rw} | {bs[2:]} | {_err(r)} | | | | | | |")
            continue
        lens = "-" if all(x is None for x in r["len"]) else " ".join(map(str, r["len"]))
        out.append(
            f"| {name} | {rw} | {bs[2:]} | {' '.join(map(str, r['samples']))} "
            f"| {' '.join(map(str, r['steps']))} | {lens} | {r['duplicates']} "
            f"| {r['drops']} | {r['padded']} | {'yes' if r['steps_equal'] else 'NO'} |"
        )
    return [*out, ""]


def plot(sec: dict[str, Any], path: Path) -> bool:
    """Load samples/s per system (log scale): one panel per dataset, bars
    from a common floor so lengths compare; shardprep red, references grey."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return False
    kinds = list(sec)
    nrows = max(len(sec[k]["rows"]) for k in kinds)
    fig, axes = plt.subplots(
        1, len(kinds), figsize=(5.2 * len(kinds), 1.2 + 0.32 * nrows), squeeze=False
    )
    for ax, kind in zip(axes[0], kinds, strict=False):
        rows = [
            (k.replace(" | w", " w").replace("StreamingDataset", "SD"), r.get("samples_s"))
            for k, r in sec[kind]["rows"].items()
        ][::-1]
        labels = [k for k, _ in rows]
        vals = [v or 0.0 for _, v in rows]
        positive = [v for v in vals if v > 0] or [1.0]
        floor = 10.0 ** math.floor(math.log10(min(positive)))
        colors = [
            "#d62728"
            if k.startswith("shardprep")
            else "#9a9a9a"
            if k.startswith(("cat", "tarfile"))
            else "#1f77b4"
            for k in labels
        ]
        ax.barh(labels, [max(v, floor) - floor for v in vals], left=floor, color=colors)
        ax.set_xscale("log")
        ax.set_xlim(left=floor, right=max(vals) * 4)
        ax.set_title(f"load `{kind}`, {sec[kind]['n']:,} samples", fontsize=9)
        ax.set_xlabel("samples/s (log); w = DataLoader workers", fontsize=8)
        for y, v in enumerate(vals):
            ax.text(max(v, floor), y, f" {v:,.0f}" if v else " n/a", va="center", fontsize=7)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def render(cfg: Config, out: Path) -> None:
    """Write the markdown report (and plot) from the stored results."""
    res = load_results(cfg)
    meta = res.get("meta", {})
    reps = {(m.get("repeats"), m.get("warmup")) for m in meta.values() if "repeats" in m}
    rw = ", ".join(f"median of {r} run(s) after {w} warm-up" for r, w in sorted(reps))
    mode = ("quick (`--quick`: small sizes)" if cfg.quick else "full") + (f"; {rw}" if rw else "")
    mode += "; the scaling section is a single run per point"
    cmds = sorted({m["command"] for m in meta.values() if m.get("command")})
    runs = [
        f"{k} {m['when']} ({m.get('minutes', 0):.1f} min, load avg "
        f"{m['loadavg'][0]:.1f} -> {m['loadavg'][1]:.1f})"
        for k, m in meta.items()
        if "loadavg" in m
    ]
    lines = [
        "# Benchmarks",
        "",
        "Generated by `bench/` (see `bench/README.md`); do not edit by hand.",
        "",
        f"Mode: {mode}. Command(s): " + ", ".join(f"`{c}`" for c in cmds) + ".",
        "",
        "## Machine",
        "",
        *[f"- {m}" for m in machine()],
        "- Sections run: " + "; ".join(runs) + ". The 1-minute load average is "
        "recorded because other jobs on this 2-core machine skew the figures.",
        "",
        "More scenarios, each on its own page with its command: "
        "[benchmarks-feeding.md](benchmarks-feeding.md) (the batch path and the worker "
        "hand-off), [benchmarks-remote.md](benchmarks-remote.md) (object storage), "
        "[benchmarks-build.md](benchmarks-build.md) (build engines and build memory).",
        "",
        "## Method",
        "",
        "- Every measured run is a fresh Python subprocess (`python -m bench.runner`), so peak "
        "memory is per system and each system pays its own imports. Import time (torch "
        "included) is reported separately as *import s* and excluded from throughput.",
        "- *Peak PSS*: the driver samples `/proc/<pid>/smaps_rollup` of the run's process and "
        "all its descendants every 20 ms and keeps the max of the sum (PSS counts pages "
        "shared by forked workers once). It covers the whole subprocess, imports included.",
        "- Build: files/s and MB/s are raw payload over the build call; `tar cf` and `cat` of "
        "the raw tree are the floors (whole command timed). Raw data is in the page cache.",
        "- Load: one epoch, batch 64, DataLoader workers 0 and 2, shuffling on (each system's "
        "own mechanism; webdataset: shard shuffle + 1000-sample buffer). The same collate for "
        "every system turns each sample into its payload `bytes` (LitData yields memoryviews). "
        "MB/s is payload bytes. *TTFB*: dataset + loader construction to first batch. "
        "References: `cat` of the webdataset shards to /dev/null, and a bare `tarfile` loop "
        "(no torch) over the same shards.",
        "- Datasets are synthetic and deterministic (seed 0), 10 classes, largest ~20x the "
        "smallest: `small` ~1 KiB random, `images` 30-100 KiB random (JPEG-like, "
        "incompressible), `text` 2-6 KiB JSON (~3.5x with zstd).",
        "- LitData `optimize()` runs with its default start method (spawn): its workers "
        "re-import torch + litdata inside the timed build call. LitData zstd uses "
        '`compression_level="chunk"` (the default in-file framing needs pyarrow to read '
        "back); compressed LitData/MDS shards are read through a separate cache folder, "
        "emptied before each run, so decompression is inside the timed epoch.",
        "- webdataset's `ShardWriter` writes a PAX header on every member, which is why "
        "its shards of ~1 KiB samples are several times the raw size.",
        "- MosaicML streaming runs with a stub `torchvision` on `sys.path` (its eager "
        "`streaming.vision` import fails against the CPU torch); nothing measured uses it.",
        "",
    ]
    if "build" in res:
        lines += ["## Build", "", *build_tables(res["build"])]
    if "load" in res:
        png = out.parent / "benchmarks_load.png"
        lines += ["## Load", ""]
        if plot(res["load"], png):
            lines += [f"![load samples/s per system]({png.name})", ""]
        lines += load_tables(res["load"])
    if "scale" in res:
        lines += ["## Scaling (memory must stay flat)", "", *scale_tables(res["scale"])]
    if "ddp" in res:
        lines += ["## DDP exactness", "", *ddp_table(res["ddp"])]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    log(f"wrote {out}")


if __name__ == "__main__":
    sys.exit("use: python -m bench report")
