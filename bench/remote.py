"""Remote benchmark: shards in object storage behind a slow link, first epoch and cached epoch.

``python -m bench.remote [--samples 6000] [--latency-ms 20] [--bandwidth-mbs 100]``

A moto S3 server on 127.0.0.1 (``tests/s3.py``) holds the outputs of
shardprep, MosaicML's ``MDSWriter`` and LitData's ``optimize`` built from the
same ``images`` dataset (JPEG-sized random payloads, 16 shards). Every read
goes through ``tests.s3.Proxy`` (in a process of its own, ``bench.proxy``: in the driver it
shared the GIL with the PSS sampler), which adds ``--latency-ms`` to every request
and paces every connection at ``--bandwidth-mbs``: a stand-in for a region's
round trip and per-connection bandwidth. Each row is one epoch (batch 64,
shuffle on) in a fresh process (``bench.runner``), DataLoader ``num_workers``
0 and 2. Every figure is measured once per round and the rounds go
round-robin over all of them (``--repeats`` rounds; median and min–max):

* ``epoch 1``: nothing cached (shardprep streams with read-ahead; with
  ``cache_dir`` it also fills the cache; MDS and LitData download into
  their caches);
* ``epoch 2``: the same cache folder, warm;
* ``floor``: 8 concurrent whole-object GETs of shardprep's 16 shards (s3fs, and
  obstore: ``floor obstore``);
* ``shardprep``: the default fetch backend (obstore when installed),
  ``shardprep fsspec``: ``RemoteOptions(backend="fsspec")``;
* ``shardprep 8x8MiB`` (only when ``--systems`` names it): read-ahead with the defaults
  before 16 x 4 MiB (``RemoteOptions(request_bytes=8 MiB, max_requests=8)``), for the A/B;
* ``shardprep 64MiB`` (only when named): ``read_ahead_bytes=64 MiB``, the default before
  issue 38 (16 requests of 4 MiB in process; in 2 workers the same as today's default);
* ``shardprep 16x16MiB`` (only when named): 16 requests of 16 MiB in a 256 MiB budget;
* ``shardprep 16x32MiB`` (only when named): 16 requests of 32 MiB in a 512 MiB budget
  (``RemoteOptions(request_bytes=32 MiB, max_requests=16, read_ahead_bytes=512 MiB)``): fewer
  GETs, with the whole epoch allowed in flight;
* ``local``: shardprep over the same build on local disk.

``--server whole`` (the default) is stock moto, which reads the whole object for every GET,
ranged or not (~25 MB per shard here): on the bench's 2 shared cores a reader that sends many
ranged GETs pays moto's CPU for each. ``--server ranged`` is the control,
``bench/moto_ranged.py``: the same moto, whose GET copies only the bytes it serves (each
object read from moto's file once and kept), as a real object store's ranged GET costs its
client nothing proportional to the object's size. Both serve the same bytes: before the first
row, a few ranges of one shard are read from the server directly and compared with the built
file (and every row's "complete" counts every sample's bytes).

MB/s counts payload bytes for every row. Results: ``WORK/remote-results.json``
and, with ``--out``, the markdown page (docs/benchmarks-remote.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench.build import BY_NAME, ensure_built
from bench.harness import DEFAULT_WORK, REPO, Config, dataset, log, median_dict, rm, run_task

BATCH = 64
SHARDS = 16
BUILDS = {"shardprep": "shardprep w1", "mds": "MDSWriter", "litdata": "LitData optimize w1"}
# RemoteOptions of A/B rows, run only when --systems names them: the read-ahead defaults before
# this change (8 requests of 8 MiB in the 64 MiB budget) against today's (16 of 4 MiB)
OPTIONS = {
    "shardprep 8x8MiB": {"request_bytes": 8 << 20, "max_requests": 8},
    "shardprep 64MiB": {"read_ahead_bytes": 64 << 20},
    # issue 38's A/B of fewer, larger GETs for more memory: 16 requests of 16 MiB in 256 MiB (a
    # window of ~12-16 MiB is one GET), of 32 MiB in 512 MiB (the whole 399 MB epoch may be in
    # flight at once)
    "shardprep 16x16MiB": {
        "request_bytes": 16 << 20,
        "max_requests": 16,
        "read_ahead_bytes": 256 << 20,
    },
    "shardprep 16x32MiB": {
        "request_bytes": 32 << 20,
        "max_requests": 16,
        "read_ahead_bytes": 512 << 20,
    },
}
BACKENDS = {
    "shardprep": "auto",
    "shardprep fsspec": "fsspec",
    "shardprep cache": "auto",
    "shardprep cache fsspec": "fsspec",
}
# --server: the python -m module that serves S3 (the stock server, or the control)
SERVERS = {"whole": "moto.server", "ranged": "bench.moto_ranged"}
IMPORTS = {"shardprep": ("s3fs", "obstore"), "mds": ("boto3",), "litdata": ("boto3", "obstore")}
LABELS = {
    "floor": "floor: 8 concurrent whole-object GETs (s3fs)",
    "floor obstore": "floor: 8 concurrent whole-object GETs (obstore)",
    "local": "shardprep, same build on local disk",
    "shardprep": "shardprep `ShardDataset(batch_size=64)`, read-ahead (obstore)",
    "shardprep fsspec": 'shardprep, read-ahead, `backend="fsspec"`',
    "shardprep 8x8MiB": "shardprep, read-ahead, 8 requests of 8 MiB (the defaults before issue 20)",
    "shardprep 64MiB": "shardprep, read-ahead, `read_ahead_bytes=64 MiB` (the default before issue 38)",
    "shardprep 16x16MiB": "shardprep, read-ahead, 16 requests of 16 MiB in a 256 MiB budget",
    "shardprep 16x32MiB": "shardprep, read-ahead, 16 requests of 32 MiB in a 512 MiB budget",
    "shardprep cache": "shardprep, read-ahead + `cache_dir`",
    "shardprep cache fsspec": 'shardprep, read-ahead + `cache_dir`, `backend="fsspec"`',
    "mds": "MosaicML StreamingDataset (remote → local)",
    "litdata": "LitData StreamingDataset",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.remote", description=__doc__)
    p.add_argument("--samples", type=int, default=6000, help="images samples (default 6000)")
    p.add_argument("--latency-ms", type=float, default=20.0, help="added to every request")
    p.add_argument("--bandwidth-mbs", type=float, default=100.0, help="per connection, MB/s")
    p.add_argument("--repeats", type=int, default=3, help="rounds, round-robin (median, spread)")
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK)
    p.add_argument("--workers", default="0,2", help="DataLoader num_workers to measure")
    p.add_argument("--systems", default="shardprep,shardprep fsspec,shardprep cache,litdata,mds")
    p.add_argument("--out", type=Path, default=None, help="write the markdown page here")
    p.add_argument(
        "--server",
        choices=sorted(SERVERS),
        default="whole",
        help="whole: stock moto (reads the whole object per GET); ranged: the control server",
    )
    p.add_argument(
        "--pss-interval",
        type=float,
        default=1.0,
        help="seconds between reads of a measured process's PSS (each read of a process that "
        "imported torch holds its memory-map lock for ~10 ms; 0.02: as before 2026-11-29)",
    )
    a = p.parse_args(argv)
    cfg = Config.make(False, a.work_dir, a.repeats, "")
    cfg.warmup = 0
    cfg.pss_interval = a.pss_interval
    cfg.command = "python -m bench.remote " + " ".join(shlex.quote(x) for x in argv)
    if cfg.work.resolve().is_relative_to(REPO):
        p.error("--work-dir must be outside the repository")
    workers = tuple(int(w) for w in a.workers.split(","))
    systems = tuple(s for s in a.systems.split(",") if s)
    result = run(
        cfg, a.samples, a.latency_ms / 1000, a.bandwidth_mbs * 1e6, workers, systems, a.server
    )
    path = cfg.work / "remote-results.json"
    path.write_text(json.dumps(result, indent=1))
    log(f"results in {path}")
    if a.out:
        a.out.write_text(render(result))
        log(f"wrote {a.out}")
    return 0


def run(
    cfg: Config,
    n: int,
    latency: float,
    bandwidth: float,
    workers: tuple[int, ...],
    systems: tuple[str, ...],
    server: str = "whole",
) -> dict[str, Any]:
    """Every row of the remote scenario (see the module docstring)."""
    sys.path.insert(0, str(REPO))
    from bench.proxy import ProxyProcess
    from tests.s3 import S3Server

    _, meta = dataset(cfg, "images", n)
    peers = {"shardprep"} | {
        system.split()[0] for system in systems
    }  # (the floors read shardprep's)
    outs = {
        system: ensure_built(cfg, "images", n, BY_NAME[b], SHARDS)
        for system, b in BUILDS.items()
        if system in peers  # (an environment without MosaicML Streaming runs the others)
    }
    rows: dict[str, Any] = {}
    started, load_before = time.time(), os.getloadavg()[0]
    with (
        S3Server(module=SERVERS[server]) as s3,
        ProxyProcess(s3.port, latency, bandwidth) as proxy,
    ):
        s3.create_bucket("bench")
        _upload(s3, outs)
        _check_ranges(s3, outs["shardprep"])
        env = s3.environment(proxy.endpoint)
        os.environ.update(env)  # measured processes inherit them (MDS and LitData read them)
        os.environ["S3_ENDPOINT_URL"] = proxy.endpoint  # MosaicML streaming's variable
        os.environ["AWS_ALLOW_HTTP"] = "true"  # obstore (LitData) refuses http:// otherwise
        options = s3.storage_options(proxy.endpoint)
        total = meta["total_bytes"]
        shards = sorted(p.name for p in outs["shardprep"].glob("shard-*.tar"))
        floor = {
            "task": "get_floor",
            "system": "floor",
            "storage_options": options,
            "urls": [f"bench/shardprep/{name}" for name in shards],
            "concurrency": 8,
            "samples": n,
            "payload_bytes": total,
        }
        cells: dict[str, Any] = {}  # key -> once(): one run (a dict), or {key: run} for a pair
        for client in ("s3fs", "obstore"):
            spec = {**floor, "client": client}
            key = "floor | w0" if client == "s3fs" else "floor obstore | w0"
            cells[key] = lambda spec=spec: _measure(cfg, spec, n, total)
        cells["local | w0"] = _load_cell(cfg, "shardprep", str(outs["shardprep"]), {}, 0, n, total)
        caches = []
        for system in systems:
            peer = system.split()[0]
            url = f"s3://bench/{peer}"
            for w in workers:
                cache = cfg.work / "remote-cache" / f"{system.replace(' ', '-')}-w{w}"
                cached = "cache" in system or peer in ("mds", "litdata")
                remote = {
                    "storage_options": options,
                    "boto3_options": _boto3_options(env),
                    "cache_dir": str(cache) if cached else None,
                    "backend": BACKENDS.get(system, "auto"),
                    "options": OPTIONS.get(system, {}),
                }
                key = f"{system} | w{w}"
                once = _load_cell(cfg, peer, url, {"remote": remote}, w, n, total)
                if cached:  # epoch 1 from an empty cache, then epoch 2 on what it left
                    caches.append(cache)
                    once = _epochs(once, cache, key)
                else:
                    key += " | epoch 1"
                cells[key] = once
        runs: dict[str, list[dict[str, Any]]] = {}
        for round_ in range(cfg.repeats):
            log(f"round {round_ + 1}/{cfg.repeats}")
            for key, once in cells.items():
                result = once()
                for k, r in result.get("epochs", {key: result}).items():
                    runs.setdefault(k, []).append(r)
        for key, results in runs.items():
            rows[key] = _summary(results, key)
        for cache in caches:
            rm(cache)
    return {
        "rows": rows,
        "meta": {
            "command": cfg.command,
            "samples": n,
            "server": server,
            "payload_bytes": meta["total_bytes"],
            "shards": SHARDS,
            "latency_ms": latency * 1000,
            "bandwidth_mbs": bandwidth / 1e6,
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            "minutes": (time.time() - started) / 60,
            "loadavg": [load_before, os.getloadavg()[0]],
            "repeats": cfg.repeats,
            "pss_interval_s": cfg.pss_interval,
            "cpus": os.cpu_count(),
        },
    }


def _load_cell(
    cfg: Config, peer: str, out: str, params: dict[str, Any], w: int, n: int, total: int
) -> Any:
    """One epoch of ``peer`` over ``out`` in a fresh process: a function of no arguments."""
    spec = {
        "task": "load",
        "system": peer,
        "out": out,
        "batch_size": BATCH,
        "num_workers": w,
        "params": {"shuffle": True, "batches": peer == "shardprep", **params},
        # the storage client each system imports lazily counts as import time, not epoch time
        "imports": IMPORTS[peer] if params.get("remote") else (),
    }
    return lambda: _measure(cfg, spec, n, total)


def _epochs(once: Any, cache: Path, key: str) -> Any:
    """Epoch 1 from an emptied ``cache``, then epoch 2 on what it left:
    ``{"epochs": {key | epoch k: run}}``."""

    def both() -> dict[str, Any]:
        rm(cache)
        return {"epochs": {f"{key} | epoch 1": once(), f"{key} | epoch 2": once()}}

    return both


def _summary(results: list[dict[str, Any]], label: str) -> dict[str, Any]:
    """Median of every numeric field over the rounds, and the spread of MB/s."""
    failed = [r for r in results if "error" in r]
    if failed:
        return {"error": failed[0]["error"], "runs": len(results) - len(failed)}
    med = median_dict(results)
    med["runs"] = len(results)
    med["mb_s_runs"] = [r["mb_s"] for r in results]
    med["complete"] = all(r.get("complete") for r in results)
    log(
        f"  {label}: MB/s {med['mb_s']:.0f} ({min(med['mb_s_runs']):.0f}-{max(med['mb_s_runs']):.0f})"
    )
    return med


def _measure(cfg: Config, spec: dict[str, Any], n: int, total: int) -> dict[str, Any]:
    res, _ = run_task(spec, cfg.timeout, cfg.pss_interval)
    if "error" in res:
        return res
    res["mb_s"] = res["bytes"] / res["epoch_s"] / 1e6
    res["complete"] = res["samples"] == n and res["bytes"] == total
    return res


def _upload(s3: Any, outs: dict[str, Path]) -> None:
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
    for system, out in outs.items():
        t = time.perf_counter()
        fs.put(str(out), f"bench/{system}", recursive=True)
        log(f"uploaded {system} in {time.perf_counter() - t:.1f}s")


def _check_ranges(s3: Any, out: Path) -> None:
    """A few ranges of the first shard, read from the server directly (no proxy), must be the
    built file's bytes: the control server serves what stock moto serves."""
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
    path = sorted(out.glob("shard-*.tar"))[0]
    data = path.read_bytes()
    size = len(data)
    for a, b in ((0, 1), (0, 8 << 20), (12345, size // 2 + 7), (size - 1000, size)):
        got = fs.cat_file(f"bench/shardprep/{path.name}", start=a, end=b)
        if got != data[a:b]:
            raise RuntimeError(
                f"the S3 server ({s3.module}) served other bytes than the built file for "
                f"bytes {a}-{b} of {path.name} ({len(got)} bytes, {len(data[a:b])} in the file)"
            )
    if fs.cat_file(f"bench/shardprep/{path.name}") != data:
        raise RuntimeError(f"the S3 server served {path.name} with other bytes ({s3.module})")
    log(f"server {s3.module}: 5 reads of {path.name} match the built file")


def _boto3_options(env: dict[str, str]) -> dict[str, str]:
    """LitData's ``storage_options`` (boto3 client arguments)."""
    return {
        "endpoint_url": env["AWS_ENDPOINT_URL"],
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_DEFAULT_REGION"],
    }


def render(result: dict[str, Any]) -> str:
    """The rows as a markdown table (the analysis is written by hand around it)."""
    rows, meta = result["rows"], result["meta"]
    lines = [
        f"`{meta['command']}` — {meta['samples']} samples, {meta['payload_bytes'] / 1e6:.0f} MB "
        f"payload, {meta['shards']} shards, {meta['latency_ms']:g} ms per request, "
        f"{meta['bandwidth_mbs']:g} MB/s per connection, server "
        f"{meta.get('server', 'whole')}; {meta['when']}, "
        f"{meta['minutes']:.1f} min, load average {meta['loadavg'][0]:.1f} → "
        f"{meta['loadavg'][1]:.1f} on {meta['cpus']} CPUs",
        "",
        "| system | num_workers | epoch | MB/s (median) | MB/s min–max | epoch s | TTFB s "
        "| MB/s after the first batch | peak PSS MiB | complete |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for key, r in rows.items():
        name, workers, *epoch = [part.strip() for part in key.split("|")]
        head = f"| {LABELS.get(name, name)} | {workers[1:]} | {epoch[0] if epoch else ''} "
        if "error" in r:
            lines.append(head + f"| n/a: {r['error'][:120]} | | | | | | |")
            continue
        ttfb = f"{r['ttfb_s']:.2f}" if r.get("ttfb_s") is not None else ""
        after = (
            f"{r['bytes'] / (r['epoch_s'] - r['ttfb_s']) / 1e6:.0f}"
            if r.get("ttfb_s") is not None and r["epoch_s"] > r["ttfb_s"]
            else ""
        )
        pss = f"{r['peak_pss'] / 2**20:.0f}" if r.get("peak_pss") else ""
        lines.append(
            head + f"| {r['mb_s']:.1f} | {_spread(r)} | {r['epoch_s']:.2f} | {ttfb} | {after} "
            f"| {pss} | "
            f"{'yes' if r.get('complete') else 'NO'} |"
        )
    return "\n".join(lines + [""] + ratios(rows)) + "\n"


def _spread(r: dict[str, Any]) -> str:
    runs = r.get("mb_s_runs") or [r["mb_s"]]
    return f"{min(runs):.0f}–{max(runs):.0f}"


def ratios(rows: dict[str, Any]) -> list[str]:
    """First-epoch ratios (medians of the same run): shardprep against LitData and the floors."""
    out = ["| first epoch | " + " | ".join(f"w{w}" for w in (0, 2)) + " |", "|---|---:|---:|"]

    def mb(key: str) -> float | None:
        r = rows.get(key)
        return None if r is None or "error" in r else float(r["mb_s"])

    for system in ("shardprep", "shardprep fsspec", *OPTIONS):
        for other, label in (
            ("litdata | w{w} | epoch 1", "LitData"),
            ("floor | w0", "floor (s3fs)"),
            ("floor obstore | w0", "floor (obstore)"),
        ):
            cells = []
            for w in (0, 2):
                a, b = mb(f"{system} | w{w} | epoch 1"), mb(other.format(w=w))
                cells.append(f"{a / b:.2f}×" if a and b else "")
            if any(cells):  # (systems not in this run get no row)
                out.append(
                    f"| {LABELS.get(system, system)} / {label} | " + " | ".join(cells) + " |"
                )
    return out


if __name__ == "__main__":
    sys.exit(main())
