"""Trace remote epochs: every request's start and end, and what comes before the first data GET.

``python -m bench.remote_trace [--samples 6000] [--runs 3] [--workers 0] [--setup obstore]``

The scenario of ``bench.remote`` (moto S3 behind ``tests.s3.Proxy``: ``--latency-ms`` per
request, ``--bandwidth-mbs`` per connection; shardprep's build of ``images``, 16 shards,
``ShardDataset(batch_size=64)``, shuffle on, obstore for the data), one epoch per fresh
process as ``bench.runner`` times it: s3fs, obstore, torch and the loader are imported before
the timer, which starts where the dataset is made. Every ``Source.fetch`` (every remote read
of the loader goes through it: the manifest, the indexes, the read-ahead's parts) is recorded
with its start and end on that timer (``time.perf_counter``, the same clock in DataLoader
workers), its thread and its process. Printed per run: when the manifest was read, the dataset
made, the first index back, the first data GET sent, the first batch and the end; the requests
before the first data GET; and the requests in flight every 50 ms.

``--sample-ms 20`` samples the epoch's PSS as ``bench.remote`` does (every 20 ms), to see what
the sampler costs the epoch; by default nothing samples it.

``--setup obstore`` is an experiment, not a setting: the reads made while the dataset is set up
(the manifest) go through obstore instead of s3fs, which the loader avoids because a process
that used obstore cannot fork DataLoader workers that use it (``loader.io.fetch``); it measures
what that rule costs a fresh process (w0 only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.build import BY_NAME, ensure_built
from bench.harness import DEFAULT_WORK, REPO, Config, env_for, log
from bench.memory import run_measured

SHARDS = 16
BATCH = 64
STEP_S = 0.05  # the in-flight timeline's step


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        print(json.dumps(child(json.loads(argv[1]))))
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.remote_trace", description=__doc__)
    p.add_argument("--samples", type=int, default=6000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workers", type=int, default=0, help="DataLoader num_workers")
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--bandwidth-mbs", type=float, default=100.0)
    p.add_argument("--setup", choices=("fsspec", "obstore"), default="fsspec")
    p.add_argument(
        "--sample-ms",
        type=float,
        default=0.0,
        help="sample the epoch's PSS as bench.remote does (it uses 20 ms; 0: not sampled)",
    )
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK)
    a = p.parse_args(argv)
    if a.setup == "obstore" and a.workers:
        p.error("--setup obstore is for --workers 0 (forked workers could not use obstore)")
    cfg = Config.make(False, a.work_dir, 1, "")
    out = ensure_built(cfg, "images", a.samples, BY_NAME["shardprep w1"], SHARDS)
    sys.path.insert(0, str(REPO))
    import fsspec

    from tests.s3 import Proxy, S3Server

    with (
        S3Server() as s3,
        Proxy(s3.port, latency=a.latency_ms / 1000, bandwidth=a.bandwidth_mbs * 1e6) as proxy,
    ):
        s3.create_bucket("bench")
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
        fs.put(str(out), "bench/shardprep", recursive=True)
        env = {**env_for("shardprep"), **s3.environment(proxy.endpoint), "AWS_ALLOW_HTTP": "true"}
        spec = {
            "out": "s3://bench/shardprep",
            "workers": a.workers,
            "storage_options": s3.storage_options(proxy.endpoint),
            "setup": a.setup,
        }
        for run in range(a.runs):
            with tempfile.TemporaryDirectory() as events:
                spec["events"] = events
                cmd = [sys.executable, "-m", "bench.remote_trace", "--child", json.dumps(spec)]
                code, stdout, stderr = _run(cmd, env, a.sample_ms / 1000)
                if code != 0:
                    raise RuntimeError(f"run {run + 1} failed: {stderr[-2000:]}")
                result = json.loads(stdout.strip().splitlines()[-1])
                for name in sorted(os.listdir(events)):  # what DataLoader workers recorded
                    with open(os.path.join(events, name)) as f:
                        result["requests"] += [json.loads(line) for line in f]
            log(f"run {run + 1}/{a.runs}, load average {os.getloadavg()[0]:.2f}")
            print(report(result), flush=True)
    return 0


def _run(cmd: list[str], env: dict[str, str], interval: float) -> tuple[int, str, str]:
    """Run ``cmd``; with ``interval``, under ``bench.memory``'s PSS sampler (as ``bench.remote``)."""
    if interval > 0:
        m = run_measured(cmd, env=env, cwd=str(REPO), timeout=600, interval=interval)
        return m.returncode, m.stdout, m.stderr
    done = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=600)
    return done.returncode, done.stdout, done.stderr


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One traced epoch in this fresh process (see the module docstring)."""
    import obstore  # noqa: F401  (imported before the timer, as bench.runner does)
    import s3fs  # noqa: F401
    import torch.utils.data  # noqa: F401

    import loader.torch.dataset  # noqa: F401
    from bench.peers import shardprep_ as peer
    from bench.peers.common import collate
    from loader.io import fetch as backends
    from loader.io import source

    main_pid = os.getpid()
    requests: list[dict[str, Any]] = []
    marks: dict[str, float] = {}
    t0 = 0.0
    fetch = source.Source.fetch

    def traced(
        self: source.Source, name: str, start: int, stop: int, setup: bool = False
    ) -> bytes | memoryview:
        began = time.perf_counter() - t0
        data = fetch(self, name, start, stop, setup)
        event = {
            "name": name,
            "bytes": stop - start,
            "setup": setup,
            "thread": threading.current_thread().name,
            "pid": os.getpid(),
            "start": began,
            "end": time.perf_counter() - t0,
        }
        if os.getpid() == main_pid:
            requests.append(event)
        else:  # a DataLoader worker: one line per request, read back by the driver
            with open(os.path.join(spec["events"], f"{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps(event) + "\n")
        return data

    source.Source.fetch = traced  # type: ignore[method-assign]
    if spec["setup"] == "obstore":  # the experiment: the manifest through obstore
        backends._fsspec_opens = lambda protocol: False  # type: ignore[assignment]
    params = {
        "shuffle": True,
        "batches": True,
        "remote": {"storage_options": spec["storage_options"], "backend": "auto"},
    }
    import gc

    gc.collect()
    t0 = time.perf_counter()
    batches = peer.batch_loader(spec["out"], BATCH, spec["workers"], collate, params)
    marks["constructed"] = time.perf_counter() - t0
    steps = 0
    for _ in batches:
        if not steps:
            marks["first batch"] = time.perf_counter() - t0
        steps += 1
    marks["end"] = time.perf_counter() - t0
    return {"marks": marks, "requests": requests, "steps": steps, "workers": spec["workers"]}


def report(result: dict[str, Any]) -> str:
    """The run's marks, the requests before the first data GET, and the in-flight timeline."""
    requests = sorted(result["requests"], key=lambda r: r["start"])
    marks = dict(result["marks"])
    manifest = [r for r in requests if r["name"] == "manifest.json"]
    indexes = [r for r in requests if r["name"].endswith(".idx")]
    data = [r for r in requests if not r["name"].endswith((".idx", ".json"))]
    if manifest:
        marks["manifest sent"], marks["manifest back"] = manifest[0]["start"], manifest[0]["end"]
    if indexes:
        marks["first index back"] = min(r["end"] for r in indexes)
    if data:
        marks["first data GET"] = data[0]["start"]
    lines = [
        "  " + ", ".join(f"{k} {v:.3f} s" for k, v in sorted(marks.items(), key=lambda kv: kv[1])),
        f"  {len(requests)} requests ({len(indexes)} index, {len(data)} data), "
        f"{result['steps']} batches, num_workers {result['workers']}",
        "  before the first data GET:",
    ]
    first = data[0]["start"] if data else marks["end"]
    for r in requests:
        if r["start"] < first:
            lines.append(
                f"    {r['start']:.3f}-{r['end']:.3f} s {r['name']} ({r['thread']}, "
                f"pid {r['pid']}{', set-up read' if r['setup'] else ''})"
            )
    flight = [
        sum(1 for r in requests if r["start"] <= i * STEP_S < r["end"])
        for i in range(int(marks["end"] / STEP_S) + 1)
    ]
    lines.append(f"  in flight every {STEP_S * 1000:.0f} ms: {flight}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
