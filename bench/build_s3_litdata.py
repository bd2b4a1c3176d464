"""S3 -> S3 builds through the loopback latency proxy: shardprep (``--engine local -j2`` and
``--engine ray`` on two local 1-CPU nodes) against LitData's ``optimize()`` with 2 workers,
all reading RAW from and writing to the same moto S3 server behind the same proxy.

The data setup is bench.build_s3_cluster's (class folders of incompressible 30-100 KiB files
under ``s3://raw/images``); the shardprep runs are its CLI runs. LitData runs in a child
process of its own (``--litdata-child``): it lists RAW with s3fs, hands ``optimize`` the
``bucket/key`` strings (no scheme, so LitData does not download them itself), and ``fn``
reads each through the proxy with a per-process s3fs and returns ``(bytes, label)``;
``chunk_bytes`` is RAW's size / ``--shards``. LitData's own S3 writes go to the proxy via
``storage_options`` (boto3) and obstore, whose client options get ``allow_http`` (see
_obstore_allow_http). Its time covers the listing and ``optimize``, as shardprep's covers its
scan and build. Configurations are interleaved round by round. Run it with a Python that has
LitData (and sees shardprep):

    /tmp/parquet-bench-venv/bin/python -m bench.build_s3_litdata [--files 1500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.build_s3_cluster import _build, _upload
from bench.memory import run_measured

ROOT = Path(__file__).resolve().parents[1]
_KEY = "testing"
_REGION = "us-east-1"
# pid -> s3fs filesystem, so forked workers build their own; the endpoint comes from
# AWS_ENDPOINT_URL (set by _litdata), since LitData's workers may re-import this module
_FS: dict[int, Any] = {}


def _obstore_allow_http() -> None:
    """LitData 0.2.76 builds its obstore S3Store with fixed client options and no
    ``allow_http``, so uploads to a plain-http endpoint fail with ``BadScheme`` (AWS_ALLOW_HTTP
    is not read). Add the option to LitData's module-level dict; done at import so LitData's
    spawned workers (which import this module to unpickle ``fn``) get it too."""
    import litdata.streaming.downloader as downloader

    options = dict(downloader._OBSTORE_CLIENT_OPTIONS)
    options["allow_http"] = True
    downloader._OBSTORE_CLIENT_OPTIONS = options


if os.environ.get("AWS_ALLOW_HTTP") == "true":  # only in the LitData child and its workers
    _obstore_allow_http()


def _fs() -> Any:
    import s3fs

    fs = _FS.get(os.getpid())
    if fs is None:
        fs = s3fs.S3FileSystem(
            key=_KEY,
            secret=_KEY,
            skip_instance_cache=True,
            client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"], "region_name": _REGION},
        )
        _FS[os.getpid()] = fs
    return fs


def _read(path: str) -> tuple[bytes, int]:
    """LitData's ``fn``: one RAW object through the proxy, labelled by its class folder."""
    data = _fs().cat_file(path)
    label = int(path.rsplit("/", 2)[-2][1:])  # .../c07/0000007.jpg -> 7
    return data, label


def _litdata_child(args: argparse.Namespace) -> None:
    """Runs in its own process: list RAW, ``optimize`` it to ``args.out``; JSON on stdout."""
    from litdata import optimize

    t0 = time.perf_counter()
    fs = _fs()
    inputs = sorted(fs.find(args.raw))
    sizes = fs.du(args.raw, total=False)
    total = sum(sizes.values())
    _FS.clear()  # the parent's s3fs (aiohttp loop) must not be shared with forked workers
    optimize(
        fn=_read,
        inputs=inputs,
        output_dir=args.out,
        num_workers=args.workers,
        chunk_bytes=args.chunk_bytes,
        storage_options={
            "endpoint_url": args.endpoint,
            "aws_access_key_id": _KEY,
            "aws_secret_access_key": _KEY,
            "region_name": _REGION,
        },
        verbose=False,
    )
    elapsed = time.perf_counter() - t0
    written = _fs().find(args.out.removeprefix("s3://"), detail=True)
    chunks = [k for k in written if k.endswith(".bin")]
    index = json.loads(_fs().cat_file(f"{args.out.removeprefix('s3://')}/index.json"))
    samples = sum(chunk["chunk_size"] for chunk in index["chunks"])
    if samples != len(inputs) or len(index["chunks"]) != len(chunks):
        raise SystemExit(
            f"{args.out}: index.json lists {samples} samples in {len(index['chunks'])} chunks;"
            f" expected {len(inputs)} samples in the {len(chunks)} chunks written"
        )
    print(
        json.dumps(
            {
                "elapsed_s": round(elapsed, 3),
                "files": len(inputs),
                "raw_bytes": total,
                "chunks": len(chunks),
                "out_bytes": sum(v["size"] for v in written.values()),
            }
        )
    )


def _litdata(
    python: str, endpoint: str, out: str, chunk_bytes: int, workers: int
) -> dict[str, Any]:
    command = [
        python,
        "-m",
        "bench.build_s3_litdata",
        "--litdata-child",
        "--endpoint",
        endpoint,
        "--out",
        out,
        "--chunk-bytes",
        str(chunk_bytes),
        "--workers",
        str(workers),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {
        "AWS_ACCESS_KEY_ID": _KEY,
        "AWS_SECRET_ACCESS_KEY": _KEY,
        "AWS_DEFAULT_REGION": _REGION,
        "AWS_REGION": _REGION,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",  # obstore refuses a plain-http endpoint without it
    }
    measured = run_measured(command, env=env, cwd=str(ROOT), timeout=900)
    if measured.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{measured.stderr[-3000:]}")
    summary = json.loads(measured.stdout.strip().splitlines()[-1])
    elapsed = summary["elapsed_s"]
    return {
        "elapsed_s": elapsed,
        "files_per_s": round(summary["files"] / elapsed, 1),
        "mb_per_s": round(summary["raw_bytes"] / 1e6 / elapsed, 2),
        "peak_mib": round(measured.peak_pss / 2**20, 1),
        "chunks": summary["chunks"],
    }


def _spread(values: list[float]) -> float:
    """(max - min) / median, in percent."""
    return round(100 * (max(values) - min(values)) / statistics.median(values), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--latency", type=float, default=0.02)
    parser.add_argument("--bandwidth", type=float, default=100e6)
    parser.add_argument("--litdata-python", default=sys.executable)
    parser.add_argument("--systems", default="local,ray,litdata", help="comma-separated subset")
    # the child's arguments
    parser.add_argument("--litdata-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--raw", default="raw/images", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--chunk-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.litdata_child:
        _litdata_child(args)
        return
    import fsspec
    from ray.cluster_utils import Cluster

    from tests.s3 import Proxy, S3Server

    systems = args.systems.split(",")
    results: dict[str, list[dict[str, Any]]] = {}
    loads: list[tuple[float, float, float]] = [os.getloadavg()]
    with S3Server() as s3, Proxy(s3.port, args.latency, args.bandwidth) as proxy:
        for bucket in ("raw", "out"):
            s3.create_bucket(bucket)
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
        raw_bytes = _upload(fs, "raw/images", args.files, 30 << 10, 100 << 10, 0)
        print(f"RAW: {args.files} files, {raw_bytes / 1e6:.1f} MB", file=sys.stderr)
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
        )
        try:
            if "ray" in systems:
                for _ in range(2):
                    cluster.add_node(num_cpus=1)
                cluster.wait_for_nodes(timeout=60)
            ray = ["--engine", "ray", "--ray-address", cluster.address]
            for r in range(args.rounds):
                for name in systems:
                    out = f"s3://out/{name}-{r}"
                    if name == "local":
                        engine = ["--engine", "local", "--workers", str(args.workers)]
                        got = _build("s3://raw/images", out, proxy.endpoint, args.shards, engine)
                    elif name == "ray":
                        got = _build("s3://raw/images", out, proxy.endpoint, args.shards, ray)
                    else:
                        chunk = raw_bytes // args.shards
                        got = _litdata(
                            args.litdata_python, proxy.endpoint, out, chunk, args.workers
                        )
                    results.setdefault(name, []).append(got)
                    loads.append(os.getloadavg())
                    print(name, r, got, os.getloadavg(), file=sys.stderr)
        finally:
            cluster.shutdown()  # type: ignore[no-untyped-call]
    table = {
        name: {
            **{key: statistics.median(run[key] for run in runs) for key in runs[0]},
            "files_per_s_spread_pct": _spread([run["files_per_s"] for run in runs]),
        }
        for name, runs in results.items()
    }
    print(
        json.dumps(
            {"args": vars(args), "median": table, "runs": results, "loadavg": loads}, indent=1
        )
    )


if __name__ == "__main__":
    main()
