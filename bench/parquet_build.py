"""Parquet → shards: shardprep against LitData ``optimize()`` and MosaicML ``MDSWriter``.

The data is ``images``-like: ROWS rows of a binary ``jpg`` column of 30-100 KiB
(random, incompressible bytes), a string ``label`` (10 classes) and a ``key``, in 4
Parquet files of row groups of 500 rows, written by pyarrow. Each system builds
SHARDS shards of it, in its own process, in interleaved rounds:

* shardprep: ``shardprep.build(folder, out, shards=SHARDS, workers=WORKERS)``;
* LitData: ``optimize(fn, inputs)`` with one input per (file, row group) and ``fn``
  yielding that row group's rows read with pyarrow, ``num_workers=WORKERS``,
  ``chunk_bytes`` = input bytes / SHARDS;
* MDS: one ``MDSWriter`` fed row by row from ``ParquetFile.iter_batches`` (MDSWriter
  is a single writer), ``size_limit`` = input bytes / SHARDS.

Figures: rows/s and MB/s (payload bytes / wall seconds of the build call, imports
excluded), and the peak PSS of the system's process tree (bench.memory: sampled every
20 ms from this driver, imports included).
Peers that cannot be imported are skipped. Run from the repository root::

    python -m bench.parquet_build --work-dir /tmp/parquet-bench [--rows 20000] [--rounds 3]

(peers: a venv with ``--system-site-packages`` and ``pip install -e ".[bench]" -c
constraints.txt``, see bench/README.md, then that venv's python.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.memory import run_measured

SHARDS = 16
WORKERS = 2
FILES = 4
ROW_GROUP = 500
CLASSES = [f"class{c}" for c in range(10)]
SYSTEMS = ("shardprep", "litdata", "mds")
STUBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_stubs")


def generate(
    folder: str,
    rows: int,
    sizes_between: tuple[int, int] = (30 << 10, 100 << 10),
    row_group: int = ROW_GROUP,
) -> int:
    """Write the Parquet files (if not there yet): ``FILES`` files of ``row_group``-row groups,
    a key, a string label and a random binary ``jpg`` of ``sizes_between`` bytes; returns the
    payload bytes."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    stamp = os.path.join(folder, "_SUCCESS")
    rng = np.random.default_rng(0)
    sizes = rng.integers(sizes_between[0], sizes_between[1], rows)
    if not os.path.exists(stamp):
        os.makedirs(folder, exist_ok=True)
        per_file = -(-rows // FILES)
        for f in range(FILES):
            lo, hi = f * per_file, min(rows, (f + 1) * per_file)
            blob = rng.bytes(int(sizes[lo:hi].sum()))
            offsets = np.concatenate([[0], np.cumsum(sizes[lo:hi])]).astype(np.int32)
            jpg = pa.BinaryArray.from_buffers(
                pa.binary(), hi - lo, [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(blob)]
            )
            table = pa.table(
                {
                    "key": [f"img{i:08d}" for i in range(lo, hi)],
                    "label": [CLASSES[i % 7 % len(CLASSES)] for i in range(lo, hi)],
                    "jpg": jpg,
                }
            )
            pq.write_table(
                table, os.path.join(folder, f"part-{f:05d}.parquet"), row_group_size=row_group
            )
        open(stamp, "wb").close()
    return int(sizes.sum())


def _parquet_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".parquet"))


def _litdata_rows(item: tuple[str, int]) -> Any:
    """optimize() callback: the rows of one row group."""
    import pyarrow.parquet as pq

    path, group = item
    table = pq.ParquetFile(path).read_row_group(group)
    labels = table.column("label").to_pylist()
    for key, label, jpg in zip(
        table.column("key").to_pylist(), labels, table.column("jpg").to_pylist(), strict=True
    ):
        yield {"key": key, "jpg": jpg, "cls": CLASSES.index(label)}


def run_system(system: str, raw: str, out: str, payload: int) -> dict[str, Any]:
    """Build with one system, in this process; returns its figures."""
    import pyarrow.parquet as pq

    files = _parquet_files(raw)
    limit = payload // SHARDS
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    if system == "shardprep":
        import shardprep

        summary = shardprep.build(raw, out, shards=SHARDS, workers=WORKERS, progress=False)
        rows = summary.num_samples
    elif system == "litdata":
        from litdata import optimize

        inputs = [(p, g) for p in files for g in range(pq.ParquetFile(p).num_row_groups)]
        optimize(
            fn=_litdata_rows,
            inputs=inputs,
            output_dir=out,
            num_workers=WORKERS,
            chunk_bytes=limit,
            mode="overwrite",
            verbose=False,
        )
        rows = sum(pq.ParquetFile(p).metadata.num_rows for p in files)
    else:
        from streaming import MDSWriter

        rows = 0
        columns = {"key": "str", "jpg": "bytes", "cls": "int"}
        with MDSWriter(out=out, columns=columns, size_limit=limit) as writer:
            for path in files:
                for batch in pq.ParquetFile(path).iter_batches(batch_size=ROW_GROUP):
                    for key, label, jpg in zip(
                        *(batch.column(c).to_pylist() for c in ("key", "label", "jpg")),
                        strict=True,
                    ):
                        writer.write({"key": key, "jpg": jpg, "cls": CLASSES.index(label)})
                        rows += 1
    seconds = time.perf_counter() - t0
    return {
        "system": system,
        "rows": rows,
        "seconds": round(seconds, 3),
        "rows_per_s": round(rows / seconds, 1),
        "mb_per_s": round(payload / seconds / 1e6, 1),
    }


def _importable(system: str) -> bool:
    module = {"shardprep": "shardprep", "litdata": "litdata", "mds": "streaming"}[system]
    env = _env(system)
    probe = subprocess.run(
        [sys.executable, "-c", f"import {module}"], env=env, capture_output=True, timeout=300
    )
    return probe.returncode == 0


def _env(system: str) -> dict[str, str]:
    env = dict(os.environ)
    if system == "mds":  # streaming imports torchvision eagerly (see bench/peers/mds.py)
        env["PYTHONPATH"] = os.pathsep.join([STUBS, env.get("PYTHONPATH", "")])
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", default="/tmp/parquet-bench")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--one", nargs=4, metavar=("SYSTEM", "RAW", "OUT", "PAYLOAD"))
    args = parser.parse_args()
    if args.one:  # a child: one build, figures as JSON on stdout
        system, raw, out, payload = args.one
        print(json.dumps(run_system(system, raw, out, int(payload))))
        return 0
    raw = os.path.join(args.work_dir, f"raw-{args.rows}")
    payload = generate(raw, args.rows)
    systems = [s for s in args.systems.split(",") if _importable(s)]
    print(f"{args.rows} rows, {payload / 1e6:.0f} MB of payload; systems: {', '.join(systems)}")
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for round_ in range(args.rounds):
        for system in systems if round_ % 2 == 0 else systems[::-1]:  # interleaved
            out = os.path.join(args.work_dir, f"out-{system}")
            command = [sys.executable, "-m", "bench.parquet_build", "--one", system, raw, out]
            child = run_measured([*command, str(payload)], env=_env(system), timeout=3600)
            if child.returncode != 0:
                print(f"{system}: failed\n{child.stderr[-2000:]}")
                continue
            figures = json.loads(child.stdout.strip().splitlines()[-1])
            figures["peak_pss_mib"] = round(child.peak_pss / 2**20, 1)
            results[system].append(figures)
            print(json.dumps(figures))
            shutil.rmtree(out, ignore_errors=True)
    print("\nsystem      rows/s (median, min-max)      MB/s (median, min-max)   peak PSS MiB (max)")
    for system, runs in results.items():
        if not runs:
            continue
        rps = [r["rows_per_s"] for r in runs]
        mbs = [r["mb_per_s"] for r in runs]
        print(
            f"{system:10}  {statistics.median(rps):8.0f} ({min(rps):.0f}-{max(rps):.0f})"
            f"      {statistics.median(mbs):7.1f} ({min(mbs):.1f}-{max(mbs):.1f})"
            f"      {max(r['peak_pss_mib'] for r in runs):.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
