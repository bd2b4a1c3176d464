"""Build into object storage: does uploading overlap writing, and how much local disk is used?

Starts the tests' moto S3 server and TCP proxy on 127.0.0.1 (``tests/s3.py``; needs the test
extras), writes a class-folder dataset, then times, on the same data and options:

- ``local``: ``shardprep build RAW folder`` (the write alone);
- ``upload only``: putting that build's files into S3 through the proxy with the same number of
  threads a remote build uploads with (the upload alone);
- ``remote``: ``shardprep build RAW s3://bucket/out`` through the proxy (write + upload,
  overlapped), with the peak number of shard files in its staging folder (sampled every 5 ms).

With perfect overlap ``remote`` ≈ max(local, upload only); without any, their sum. The proxy's
``--latency`` is added before every 64 KiB the client sends, which paces uploads per connection
(``--latency 0.002`` ≈ 30 MB/s per connection).

    python -m bench.build_upload --samples 2000 --sample-kib 100 --shards 16 --workers 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec

import shardprep
import shardprep.destination as destination
from tests.s3 import Proxy, S3Server


def _raw(root: Path, samples: int, size: int) -> int:
    total = 0
    for i in range(samples):
        folder = root / f"c{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        body = (i.to_bytes(4, "little") * (size // 4 + 1))[: size - (i % 97)]
        (folder / f"{i:06d}.bin").write_bytes(body)
        total += len(body)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--sample-kib", type=int, default=100)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--latency", type=float, default=0.002)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-build-upload-"))
    try:
        raw_bytes = _raw(base / "raw", args.samples, args.sample_kib * 1024)
        options = {"shards": args.shards, "workers": args.workers, "progress": False}
        with S3Server() as s3, Proxy(s3.port, latency=args.latency) as proxy:
            s3.create_bucket("bench")
            storage = s3.storage_options(proxy.endpoint)
            fs = fsspec.filesystem("s3", skip_instance_cache=True, **storage)

            started = time.perf_counter()
            shardprep.build(str(base / "raw"), str(base / "local"), **options)
            local_s = time.perf_counter() - started

            files = sorted((base / "local").iterdir())
            started = time.perf_counter()
            with ThreadPoolExecutor(destination.UPLOAD_THREADS) as pool:
                list(pool.map(lambda p: fs.put_file(str(p), f"bench/copy/{p.name}"), files))
            upload_s = time.perf_counter() - started

            staging_root = base / "tmp"
            staging_root.mkdir()
            tempfile.tempdir = str(staging_root)
            peak, done = [0], threading.Event()

            def sample() -> None:
                while not done.wait(0.005):
                    for folder in staging_root.iterdir():
                        try:
                            n = sum(".tar" in name for name in os.listdir(folder))
                        except FileNotFoundError:
                            continue
                        peak[0] = max(peak[0], n)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            started = time.perf_counter()
            shardprep.build(str(base / "raw"), "s3://bench/out", storage_options=storage, **options)
            remote_s = time.perf_counter() - started
            done.set()
            sampler.join()
            tempfile.tempdir = None
        mb = raw_bytes / 1e6
        print(
            f"{args.samples} samples, {mb:.0f} MB, {args.shards} shards, {args.workers} workers, "
            f"proxy latency {args.latency * 1e3:g} ms per 64 KiB sent"
        )
        print("| step | s | MB/s |")
        print("|---|---:|---:|")
        for name, seconds in (
            ("local build (write only)", local_s),
            (f"upload only ({destination.UPLOAD_THREADS} threads)", upload_s),
            ("remote build (write + upload)", remote_s),
        ):
            print(f"| {name} | {seconds:.2f} | {mb / seconds:.1f} |")
        print(
            f"remote / max(local, upload) = {remote_s / max(local_s, upload_s):.2f}; "
            f"remote / (local + upload) = {remote_s / (local_s + upload_s):.2f}; "
            f"peak shards staged {peak[0]} (bound {args.workers + destination.UPLOAD_THREADS})"
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
