"""Remote mixture benchmark: a mixture of two remote builds against one remote build of its size.

``python -m bench.remote_mix [--samples 3000] [--latency-ms 20] [--bandwidth-mbs 100] [--rounds 3]``

A moto S3 server on 127.0.0.1 (``tests/s3.py``) behind ``tests.s3.Proxy``
(``--latency-ms`` per request, ``--bandwidth-mbs`` per connection) holds
shardprep's build of the ``images`` dataset (``--samples``, 16 shards) and,
twice under two prefixes, its build of half as many samples (8 shards each).
Each row is one epoch (batch 64, shuffle on) through a torch DataLoader
(``num_workers`` 0 and 2) in a fresh process:

* ``single``: ``ShardDataset(url, batch_size=64)``, read-ahead on (default options);
* ``mix``: ``MixedDataset([half_a, half_b], [1, 1], batch_size=64)``: the same number of
  samples and bytes, read-ahead on (each source reads its batches' pieces ahead);
* ``mix direct``: the mixture with ``read_ahead_bytes=0``: one ranged GET per piece as it
  is needed, as mixtures read before they shared ShardStream's read path.

Rounds are interleaved (every row once per round, in turn); the table gives the median and
the range. MB/s counts payload bytes (the epoch's samples are checked complete).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.build import BY_NAME, ensure_built
from bench.harness import DEFAULT_WORK, REPO, Config, dataset, log

BATCH = 64
SHARDS = 16
ROWS = ("single", "mix", "mix direct")
CHILD_TIMEOUT_S = 600.0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.remote_mix", description=__doc__)
    p.add_argument("--samples", type=int, default=3000, help="images samples (even; 3000)")
    p.add_argument("--latency-ms", type=float, default=20.0, help="added to every request")
    p.add_argument("--bandwidth-mbs", type=float, default=100.0, help="per connection, MB/s")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--workers", default="0,2", help="DataLoader num_workers to measure")
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        print(json.dumps(_epoch(json.loads(a.child))))
        return 0
    if a.samples % 2:
        p.error("--samples must be even (two halves)")
    cfg = Config.make(False, a.work_dir, 1, "")
    if cfg.work.resolve().is_relative_to(REPO):
        p.error("--work-dir must be outside the repository")
    command = "python -m bench.remote_mix " + " ".join(shlex.quote(x) for x in argv)
    workers = tuple(int(w) for w in a.workers.split(","))
    result = run(cfg, a.samples, a.latency_ms / 1000, a.bandwidth_mbs * 1e6, workers, a.rounds)
    result["meta"]["command"] = command
    path = cfg.work / "remote-mix-results.json"
    path.write_text(json.dumps(result, indent=1))
    log(f"results in {path}")
    print(render(result))
    return 0


def run(
    cfg: Config, n: int, latency: float, bandwidth: float, workers: tuple[int, ...], rounds: int
) -> dict[str, Any]:
    """Every row, ``rounds`` times interleaved (see the module docstring)."""
    sys.path.insert(0, str(REPO))
    from tests.s3 import Proxy, S3Server

    builder = BY_NAME["shardprep w1"]
    whole = ensure_built(cfg, "images", n, builder, SHARDS)
    half = ensure_built(cfg, "images", n // 2, builder, SHARDS // 2)
    payload = dataset(cfg, "images", n)[1]["total_bytes"]
    half_payload = dataset(cfg, "images", n // 2)[1]["total_bytes"]
    runs: dict[str, list[dict[str, Any]]] = {}
    started, load_before = time.time(), os.getloadavg()[0]
    with S3Server() as s3, Proxy(s3.port, latency=latency, bandwidth=bandwidth) as proxy:
        s3.create_bucket("bench")
        _upload(s3, {"whole": whole, "half-a": half, "half-b": half})
        options = s3.storage_options(proxy.endpoint)
        for number in range(rounds):
            for w in workers:
                for row in ROWS:
                    spec = {"row": row, "workers": w, "storage_options": options}
                    res = _child(spec)
                    expected = (n, payload) if row == "single" else (n, 2 * half_payload)
                    res["complete"] = (res.get("samples"), res.get("bytes")) == expected
                    runs.setdefault(f"{row} | w{w}", []).append(res)
                    log(f"round {number + 1} {row} w{w}: {_fmt(res)}")
    return {
        "runs": runs,
        "meta": {
            "samples": n,
            "payload_bytes": payload,
            "latency_ms": latency * 1000,
            "bandwidth_mbs": bandwidth / 1e6,
            "rounds": rounds,
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            "minutes": (time.time() - started) / 60,
            "loadavg": [load_before, os.getloadavg()[0]],
            "cpus": os.cpu_count(),
        },
    }


def _fmt(res: dict[str, Any]) -> str:
    if "error" in res:
        return f"error {res['error'][:200]}"
    return f"{res['mb_s']:.1f} MB/s, {res['samples_s']:.0f} samples/s, {res['epoch_s']:.2f} s"


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """One epoch in a fresh process (its own imports, threads and connections)."""
    from tests.processes import run_bounded

    command = [sys.executable, "-m", "bench.remote_mix", "--child", json.dumps(spec)]
    try:
        done = run_bounded(command, timeout=CHILD_TIMEOUT_S, cwd=REPO)
    except AssertionError as err:  # past the deadline: the whole session was killed
        return {"error": str(err)[-500:]}
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def _epoch(spec: dict[str, Any]) -> dict[str, Any]:
    """In the child: one epoch of ``spec["row"]``; samples, payload bytes, seconds."""
    import torch.utils.data

    from loader import MixedDataset, ReadOptions, RemoteOptions, ShardDataset
    from loader.core import ShardStream

    remote: dict[str, Any] = {"storage_options": spec["storage_options"]}
    if spec["row"] == "mix direct":
        remote["read_ahead_bytes"] = 0
    read = ReadOptions(remote=RemoteOptions(**remote))
    started = time.perf_counter()
    ds: Any
    if spec["row"] == "single":
        ds = ShardDataset("s3://bench/whole", batch_size=BATCH, read=read, rank=0, world_size=1)
    else:
        sources = [ShardStream(f"s3://bench/{p}", read=read) for p in ("half-a", "half-b")]
        ds = MixedDataset(sources, [1, 1], batch_size=BATCH, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=spec["workers"])
    samples = nbytes = 0
    first: float | None = None
    for batch in loader:
        first = time.perf_counter() - started if first is None else first
        samples += len(batch["__key__"])
        nbytes += sum(len(b) for b in _payloads(batch["jpg"]))
    epoch_s = time.perf_counter() - started
    return {
        "samples": samples,
        "bytes": nbytes,
        "epoch_s": epoch_s,
        "ttfb_s": first,
        "mb_s": nbytes / epoch_s / 1e6,
        "samples_s": samples / epoch_s,
    }


def _payloads(column: Any) -> list[bytes]:
    """The payloads of a batch column (``PackedBytes`` or a list of bytes)."""
    return list(column.tolist() if hasattr(column, "tolist") else column)


def _upload(s3: Any, outs: dict[str, Path]) -> None:
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
    for name, out in outs.items():
        t = time.perf_counter()
        fs.put(str(out), f"bench/{name}", recursive=True)
        log(f"uploaded {name} in {time.perf_counter() - t:.1f}s")


def render(result: dict[str, Any]) -> str:
    """Median and range of every row as a markdown table."""
    meta = result["meta"]
    lines = [
        f"`{meta['command']}`: {meta['samples']} samples, {meta['payload_bytes'] / 1e6:.0f} MB "
        f"payload, {meta['latency_ms']:g} ms per request, {meta['bandwidth_mbs']:g} MB/s per "
        f"connection, {meta['rounds']} interleaved rounds; {meta['when']}, "
        f"{meta['minutes']:.1f} min, load average {meta['loadavg'][0]:.1f} → "
        f"{meta['loadavg'][1]:.1f} on {meta['cpus']} CPUs",
        "",
        "| row | num_workers | MB/s median (min–max) | samples/s median | epoch s median "
        "| first batch s | complete |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for key, runs in result["runs"].items():
        row, workers = (part.strip() for part in key.split("|"))
        good = [r for r in runs if "error" not in r]
        if not good:
            lines.append(f"| {row} | {workers[1:]} | n/a: {runs[0]['error'][:100]} | | | | |")
            continue
        mb = [r["mb_s"] for r in good]
        lines.append(
            f"| {row} | {workers[1:]} | {statistics.median(mb):.1f} ({min(mb):.1f}–{max(mb):.1f}) "
            f"| {statistics.median(r['samples_s'] for r in good):.0f} "
            f"| {statistics.median(r['epoch_s'] for r in good):.2f} "
            f"| {statistics.median(r['ttfb_s'] or 0 for r in good):.2f} "
            f"| {'yes' if all(r['complete'] for r in runs) else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
