"""S3 -> S3 builds through the loopback latency proxy: --engine local against --engine ray on
one and two local Ray nodes, and the driver's peak memory at 1x and 10x the samples.

Everything is real and on this machine: a moto S3 server (tests/s3.py) behind the latency
proxy (every request delayed ``--latency`` s, each connection paced at ``--bandwidth``), RAW
an S3 prefix of class folders of ``images``-like files (incompressible, 30-100 KiB), OUT a
prefix of another bucket, and a ``ray.cluster_utils.Cluster`` whose head has no CPUs (the
driver joins it) and whose worker nodes have 1 CPU each. Builds run as CLI processes
(``python -m shardprep build``); the driver's peak memory is the PSS of its process tree
(bench.memory), which excludes Ray's workers (children of the nodes, not of the driver).
Configurations are interleaved round by round.

    python -m bench.build_s3_cluster [--files 1500] [--rounds 3] [--latency 0.02]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.memory import run_measured
from tests.s3 import Proxy, S3Server

ROOT = Path(__file__).resolve().parents[1]
CLASSES = 10


def _upload(fs: Any, prefix: str, files: int, low: int, high: int, seed: int) -> int:
    """``files`` random files of ``low``..``high`` bytes as class folders; returns bytes."""
    rng = random.Random(seed)
    sizes = [rng.randint(low, high) for _ in range(files)]
    jobs = [
        (f"{prefix}/c{i % CLASSES:02d}/{i:07d}.jpg", os.urandom(size))
        for i, size in enumerate(sizes)
    ]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda job: fs.pipe_file(*job), jobs))
    return sum(sizes)


def _build(raw: str, out: str, endpoint: str, shards: int, engine: list[str]) -> dict[str, Any]:
    options = ["--storage-option", "key=testing", "--storage-option", "secret=testing"]
    kwargs = json.dumps({"endpoint_url": endpoint, "region_name": "us-east-1"})
    command = [
        sys.executable,
        "-m",
        "shardprep",
        "build",
        raw,
        out,
        "--shards",
        str(shards),
        "--json",
        *options,
        "--storage-option",
        f"client_kwargs={kwargs}",
        *engine,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    measured = run_measured(command, env=env, cwd=str(ROOT), timeout=900)
    if measured.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{measured.stderr[-3000:]}")
    summary = json.loads(measured.stdout[measured.stdout.index("{\n") :])
    return {
        "elapsed_s": summary["elapsed_s"],
        "files_per_s": summary["files_per_s"],
        "mb_per_s": summary["mb_per_s"],
        "peak_mib": round(measured.peak_pss / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=1500)
    parser.add_argument("--memory-files", type=int, default=1000, help="1x of the memory test")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--latency", type=float, default=0.02)
    parser.add_argument("--bandwidth", type=float, default=100e6)
    args = parser.parse_args()
    import fsspec
    from ray.cluster_utils import Cluster

    results: dict[str, list[dict[str, Any]]] = {}
    with S3Server() as s3, Proxy(s3.port, args.latency, args.bandwidth) as proxy:
        for bucket in ("raw", "out"):
            s3.create_bucket(bucket)
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
        raw_bytes = _upload(fs, "raw/images", args.files, 30 << 10, 100 << 10, 0)
        _upload(fs, "raw/tiny-1x", args.memory_files, 200, 400, 1)
        _upload(fs, "raw/tiny-10x", 10 * args.memory_files, 200, 400, 2)
        print(f"RAW: {args.files} files, {raw_bytes / 1e6:.1f} MB", file=sys.stderr)
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
        )
        try:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes(timeout=60)
            ray = ["--engine", "ray", "--ray-address", cluster.address]
            for r in range(args.rounds):
                runs: list[tuple[str, list[str]]] = [
                    ("local -j2", ["--engine", "local", "--workers", "2"]),
                    ("ray 1 node", ray),
                ]
                for name, engine in runs:
                    out = f"s3://out/{name.replace(' ', '_')}-{r}"
                    got = _build("s3://raw/images", out, proxy.endpoint, args.shards, engine)
                    results.setdefault(name, []).append(got)
                    print(name, r, got, file=sys.stderr)
                second = cluster.add_node(num_cpus=1)
                cluster.wait_for_nodes(timeout=60)
                out = f"s3://out/ray_2_nodes-{r}"
                got = _build("s3://raw/images", out, proxy.endpoint, args.shards, ray)
                results.setdefault("ray 2 nodes", []).append(got)
                print("ray 2 nodes", r, got, file=sys.stderr)
                if r == args.rounds - 1:  # the driver's memory, 2 nodes
                    for scale in ("1x", "10x"):
                        got = _build(
                            f"s3://raw/tiny-{scale}",
                            f"s3://out/tiny-{scale}",
                            proxy.endpoint,
                            args.shards,
                            ray,
                        )
                        results[f"ray 2 nodes, tiny {scale}"] = [got]
                        print("tiny", scale, got, file=sys.stderr)
                cluster.remove_node(second)
        finally:
            cluster.shutdown()  # type: ignore[no-untyped-call]
    table = {
        name: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        for name, runs in results.items()
    }
    print(json.dumps({"args": vars(args), "median": table, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
