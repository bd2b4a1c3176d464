"""Is a Parquet build's memory flat in the row count? (issue 21: "memory flat at 10x rows").

Builds N and 10*N rows of small binary payloads (2-6 KiB, so 10*N fits a laptop's disk:
the per-row metadata, not the payload, is what could grow), a string ``label`` and a
``key``, in 4 files of row groups of 1,000 rows, with ``shardprep build RAW OUT -n 16
--workers 2`` as a child process, sizes interleaved over rounds. Reports the peak PSS of
the process tree (bench.memory, sampled every 20 ms) and the driver's own VmHWM; with
``--scan-only``, the peak of ``scan_parquet`` alone in a child (RSS high-water mark and
pyarrow's pool peak). Run from the repository root::

    python -m bench.parquet_memory --work-dir /tmp/parquetmem [--rows 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from typing import Any

from bench import parquet_build
from bench.memory import run_measured

ROW_GROUP = 1000

_HWM = (
    "import atexit, sys\n"
    "def _hwm():\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith('VmHWM:'):\n"
    "            sys.stderr.write('VMHWM ' + line.split()[1] + '\\n')\n"
    "atexit.register(_hwm)\n"
    "from shardprep.cli import main\n"
    "sys.argv = ['shardprep', *sys.argv[1:]]\n"
    "sys.exit(main())\n"
)

_SCAN = (
    "import json, sys, tempfile\n"
    "import pyarrow as pa\n"
    "from shardprep.scan.parquet import scan_parquet\n"
    "with tempfile.TemporaryDirectory(dir=sys.argv[2]) as scratch:\n"
    "    inv = scan_parquet(sys.argv[1], lambda n: None, scratch)\n"
    "    pool = pa.default_memory_pool()\n"
    "    hwm = [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')]\n"
    "    print(json.dumps({'rows': len(inv), 'vmhwm_mib': round(hwm[0] / 1024, 1),\n"
    "        'pool_peak_mib': round(pool.max_memory() / 2**20, 1),\n"
    "        'pool_now_mib': round(pool.bytes_allocated() / 2**20, 1)}))\n"
)


def generate(folder: str, rows: int) -> int:
    """Write the Parquet files (once): 2-6 KiB payloads, row groups of 1,000; payload bytes."""
    return parquet_build.generate(folder, rows, (2 << 10, 6 << 10), ROW_GROUP)


def build_once(raw: str, out: str) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-c", _HWM, "build", raw, out, "-n", "16", "--workers", "2"]
    child = run_measured(command, timeout=3600)
    if child.returncode != 0:
        raise SystemExit(f"build failed:\n{child.stderr[-3000:]}")
    hwm = [int(x.split()[1]) for x in child.stderr.splitlines() if x.startswith("VMHWM ")]
    shutil.rmtree(out, ignore_errors=True)
    return {
        "peak_pss_mib": round(child.peak_pss / 2**20, 1),
        "driver_vmhwm_mib": round(hwm[-1] / 1024, 1),
        "seconds": round(child.wall_s, 1),
    }


def scan_once(raw: str, work: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _SCAN, raw, work], capture_output=True, text=True, timeout=3600
    )
    if proc.returncode != 0:
        raise SystemExit(f"scan failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", default="/tmp/parquetmem")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--factor", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scan-only", action="store_true")
    args = parser.parse_args()
    sizes = [args.rows, args.rows * args.factor]
    raws = {}
    for rows in sizes:
        raws[rows] = os.path.join(args.work_dir, f"raw-{rows}")
        payload = generate(raws[rows], rows)
        print(f"{rows} rows: {payload / 1e9:.2f} GB of payload", flush=True)
    results: dict[int, list[dict[str, Any]]] = {r: [] for r in sizes}
    for round_ in range(args.rounds):
        for rows in sizes if round_ % 2 == 0 else sizes[::-1]:  # interleaved
            if args.scan_only:
                figures = scan_once(raws[rows], args.work_dir)
            else:
                figures = build_once(raws[rows], os.path.join(args.work_dir, "out"))
            results[rows].append(figures)
            print(json.dumps({"rows": rows, **figures}), flush=True)
    for rows, runs in results.items():
        for name in runs[0]:
            values = [r[name] for r in runs]
            if name != "rows":
                print(
                    f"{rows:>9} rows  {name:18} median {statistics.median(values):8.1f}"
                    f"  ({min(values)}-{max(values)})"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
