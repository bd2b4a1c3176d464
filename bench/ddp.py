"""DDP exactness: real ``torch.distributed`` (gloo, CPU) over 1001 samples in
10 shards, 3 and 4 ranks x 2 DataLoader workers, batch sizes 1 and 16.

Each rank is a fresh ``bench.runner`` process (``file://`` rendezvous) that
iterates one epoch with its system's default remainder handling and records
the SHA-1 of every payload. The driver then counts, per run: samples and
steps per rank, duplicates (a payload seen more than once, padding flagged
``__padded__`` excluded), drops (payloads never seen), and whether all ranks
took the same number of steps (otherwise a real DDP job would hang or
desynchronise at the end of the epoch).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from bench.build import Variant, build_once, out_dir
from bench.generate import list_raw
from bench.harness import REPO, Config, dataset, env_for, is_built, log

N, SHARDS, WORKERS = 1001, 10, 2
WORLDS, BATCHES = (3, 4), (1, 16)
DDP_TIMEOUT = 120  # seconds per launch; a hung rank dumps its stacks (see r<rank>.log)

# (row name, system, build variant, loader params)
SYSTEMS: tuple[tuple[str, str, Variant, dict[str, Any]], ...] = (
    (
        "webdataset split_by_node/worker",
        "webdataset",
        Variant("webdataset ShardWriter", "webdataset"),
        {},
    ),
    ("MDS StreamingDataset", "mds", Variant("MDSWriter", "mds"), {}),
    (
        "LitData StreamingDataset",
        "litdata",
        Variant("LitData optimize w1", "litdata", {"workers": 1, "chunk_size": -(-N // SHARDS)}),
        {},
    ),
    ("shardprep (default: drop)", "shardprep", Variant("shardprep w1", "shardprep"), {}),
    ("shardprep uneven=pad", "shardprep", Variant("shardprep w1", "shardprep"), {"uneven": "pad"}),
)


def launch(
    cfg: Config, system: str, out: Path, world: int, batch: int, params: dict[str, Any]
) -> list[dict[str, Any]]:
    """Start ``world`` rank processes, wait, and return their results."""
    run_dir = cfg.work / "ddp" / uuid.uuid4().hex[:12]
    run_dir.mkdir(parents=True)
    procs = []
    for rank in range(world):
        spec = {
            "task": "ddp_rank",
            "system": system,
            "out": str(out),
            "rank": rank,
            "world": world,
            "batch_size": batch,
            "num_workers": WORKERS,
            "params": {"shuffle": True, **params},
            "init_file": str(run_dir / "init"),
            "result_file": str(run_dir / f"r{rank}.json"),
            "watchdog_s": DDP_TIMEOUT - 10,
        }
        env = env_for(system)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
        )
        log_f = open(run_dir / f"r{rank}.log", "w")  # noqa: SIM115 (closed below)
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, "-m", "bench.runner", json.dumps(spec)],
                    env=env,
                    cwd=str(REPO),
                    stdout=log_f,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                ),
                log_f,
            )
        )
    deadline = time.monotonic() + DDP_TIMEOUT
    results = []
    for rank, (p, f) in enumerate(procs):
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        f.close()
        rf = run_dir / f"r{rank}.json"
        res = (
            json.loads(rf.read_text())
            if rf.exists()
            else {"error": f"rank {rank} produced no result (exit {p.returncode}); see {run_dir}"}
        )
        results.append(res)
    if not any("error" in r for r in results):
        shutil.rmtree(run_dir, ignore_errors=True)  # keep logs of failed runs only
    return results


def summarize(results: list[dict[str, Any]], expected: set[str]) -> dict[str, Any]:
    """Per-run exactness figures from the ranks' payload hashes."""
    errs = [r["error"] for r in results if "error" in r]
    if errs:
        return {"error": errs[0]}
    real: Counter[str] = Counter()
    padded = 0
    for r in results:
        for h, p in zip(r["hashes"], r["padded"], strict=False):
            if p:
                padded += 1
            else:
                real[h] += 1
    steps = [r["steps"] for r in results]
    return {
        "samples": [r["samples"] for r in results],
        "steps": steps,
        "len": [r["len"] for r in results],
        "duplicates": sum(c - 1 for c in real.values() if c > 1),
        "drops": len(expected - set(real)),
        "unknown": len(set(real) - expected),
        "padded": padded,
        "steps_equal": len(set(steps)) == 1,
    }


def run(cfg: Config) -> dict[str, Any]:
    """The ``ddp`` section."""
    root, meta = dataset(cfg, "tiny", N)
    expected = {
        hashlib.sha1(Path(p).read_bytes()).hexdigest() for p, _, _ in list_raw(root / "raw")
    }
    rows: dict[str, Any] = {}
    for name, system, v, params in SYSTEMS:
        out = out_dir(cfg, f"tiny-{N}", v)
        if not is_built(out, system):
            b = build_once(cfg, root, meta, v, out, SHARDS)
            if "error" in b:
                log(f"ddp: {name}: build failed: {b['error']}")
                for w in WORLDS:
                    for bs in BATCHES:
                        rows[f"{name} | {w}x{WORKERS} | bs{bs}"] = {"error": f"build: {b['error']}"}
                continue
        for world in WORLDS:
            for bs in BATCHES:
                s = summarize(launch(cfg, system, out, world, bs, params), expected)
                key = f"{name} | {world}x{WORKERS} | bs{bs}"
                rows[key] = s
                log(
                    f"ddp: {key}: "
                    + (
                        s.get("error")
                        or f"samples {s['samples']} steps {s['steps']} dup {s['duplicates']} "
                        f"drop {s['drops']} pad {s['padded']}"
                    )
                )
    return {"n": N, "shards": SHARDS, "workers": WORKERS, "rows": rows}
