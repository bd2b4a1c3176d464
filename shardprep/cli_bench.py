"""``shardprep bench OUT``: an output read the way training reads it, once per worker count.

Each worker count gets a fresh ``ShardDataset(OUT, batch_size=B)`` and ``DataLoader(ds,
batch_size=None, num_workers=W)`` iterated ``epochs`` times through ``ds.timed(loader)``;
each epoch is timed with ``time.perf_counter`` around the loop, and its counters come from
``ds.epoch_stats()`` (``loader.read.telemetry``). The loader and torch are imported when a
bench runs, never with the CLI (``shardprep`` does not import them otherwise).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardprep.storage import is_url

__all__ = ["BenchOptions", "bench", "format_results", "parse_workers", "pick"]

CLOSE = 0.05  # a worker count within 5% of the fastest counts as as fast (fewer workers win)


@dataclass(frozen=True)
class BenchOptions:
    """What ``shardprep bench`` reads, and how."""

    workers: tuple[int, ...]
    batch_size: int = 64
    epochs: int = 2
    decode: bool = False
    cache_dir: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)


def parse_workers(text: str) -> tuple[int, ...]:
    """``"0,2,4"`` → ``(0, 2, 4)``: distinct counts, each 0 or more, in the order given.

    Raises:
        ValueError: not a comma-separated list of non-negative integers.
    """
    counts: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(
                f"{text!r}: expected worker counts separated by commas, e.g. 0,2,4 "
                f"({part!r} is not a non-negative integer)"
            )
        if int(part) not in counts:
            counts.append(int(part))
    return tuple(counts)


def default_workers() -> tuple[int, ...]:
    """0 and the number of CPUs this process may use."""
    return (0, len(os.sched_getaffinity(0)))


def bench(
    out: str, options: BenchOptions, progress: Callable[[str], None] = lambda _: None
) -> list[dict[str, Any]]:
    """One result per worker count (``format_results`` prints them, ``pick`` chooses)."""
    return [_one(out, workers, options, progress) for workers in options.workers]


def _one(
    out: str, workers: int, options: BenchOptions, progress: Callable[[str], None]
) -> dict[str, Any]:
    import torch.utils.data

    from loader import CorruptShardError, ReadOptions, RemoteOptions, ShardDataset

    remote = None
    if is_url(out):
        remote = RemoteOptions(
            storage_options=dict(options.storage_options), cache_dir=options.cache_dir
        )
    ds = ShardDataset(
        out, batch_size=options.batch_size, decode=options.decode, read=ReadOptions(remote=remote)
    )
    manifest = ds.manifest
    total = sum(s.num_samples for s in manifest.shards)
    shard_bytes = sum(s.num_bytes for s in manifest.shards)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    epochs: list[dict[str, Any]] = []
    for epoch in range(options.epochs):
        samples = 0
        began = time.perf_counter()
        try:
            for batch in ds.timed(loader):
                samples += len(batch["__key__"])
        except CorruptShardError as err:
            if not (workers and err.shard):
                raise
            # from a worker, the message is DataLoader's traceback: name the sample first
            reason = f"{err.reason} (in a DataLoader worker, {workers} workers)"
            raise CorruptShardError.at(err.shard, err.key, err.offset, reason) from err
        wall = time.perf_counter() - began
        stats = ds.epoch_stats()
        if stats.samples != samples:  # the counters and the loop must agree exactly
            raise RuntimeError(
                f"epoch {epoch}: the loop received {samples} samples, the counters say "
                f"{stats.samples}"
            )
        epochs.append({"wall_s": wall, "samples": samples, **stats.as_dict()})
        progress(
            f"workers {workers}, epoch {epoch + 1}/{options.epochs}: {samples} samples in "
            f"{wall:.2f} s"
        )
    wall = sum(e["wall_s"] for e in epochs)
    samples = sum(e["samples"] for e in epochs)
    read_bytes = shard_bytes * samples / total if total else 0
    n = len(epochs)
    result: dict[str, Any] = {
        "workers": workers,
        "epochs": n,
        "samples_per_epoch": epochs[0]["samples"],
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        "mb_per_s": read_bytes / wall / 1e6 if wall > 0 else 0.0,
        "first_batch_s": epochs[0].get("first_batch_s", 0.0),
        "epoch_s": [e["wall_s"] for e in epochs],
        "wait_s": sum(e.get("wait_s", 0.0) for e in epochs) / n,
        "compute_s": sum(e.get("compute_s", 0.0) for e in epochs) / n,
        "stages": {
            name[len("stage_") : -len("_s")]: sum(e[name] for e in epochs) / n
            for name in epochs[0]
            if name.startswith("stage_")
        },
    }
    if "io_requests" in epochs[0]:
        hits = sum(e["io_cache_hits"] for e in epochs)
        misses = sum(e["io_cache_misses"] for e in epochs)
        result["requests_per_epoch"] = sum(e["io_requests"] for e in epochs) / n
        result["bytes_per_epoch"] = sum(e["io_bytes"] for e in epochs) / n
        result["retries_per_epoch"] = sum(e["io_retries"] for e in epochs) / n
        result["cache_hit_rate"] = hits / (hits + misses) if hits + misses else None
    return result


def pick(results: Sequence[Mapping[str, Any]]) -> tuple[int, str]:
    """The worker count to use, and why in one line: the fastest, unless fewer workers come
    within ``CLOSE`` of it (they cost less memory and CPU)."""
    best = max(results, key=lambda r: r["samples_per_s"])
    close = [r for r in results if r["samples_per_s"] >= (1 - CLOSE) * best["samples_per_s"]]
    chosen = min(close, key=lambda r: r["workers"])
    if chosen is best:
        fewest = best["workers"] == min(r["workers"] for r in results)
        return int(best["workers"]), (
            f"the fastest ({best['samples_per_s']:,.0f} samples/s)"
            + ("; more workers do not help" if fewest else "")
            + ("" if fewest else f"; fewer workers are more than {CLOSE:.0%} slower")
        )
    return int(chosen["workers"]), (
        f"within {CLOSE:.0%} of the fastest ({best['workers']} workers, "
        f"{best['samples_per_s']:,.0f} samples/s) with fewer workers"
    )


def format_results(results: Sequence[Mapping[str, Any]]) -> str:
    """The human-readable report: one block per worker count, then the pick."""
    lines: list[str] = []
    for r in results:
        loop = r["wait_s"] + r["compute_s"]
        waited = f", the loop waited {r['wait_s'] / loop:.0%} of its time" if loop > 0 else ""
        lines.append(
            f"workers {r['workers']}: {r['samples_per_s']:,.0f} samples/s, "
            f"{r['mb_per_s']:,.1f} MB/s, first batch {r['first_batch_s']:.3f} s{waited}"
        )
        stages = ", ".join(f"{name} {s:.3f}" for name, s in r["stages"].items() if s > 0)
        lines.append(f"  stages per epoch (s, added over workers): {stages or 'none counted'}")
        if "requests_per_epoch" in r:
            rate = r["cache_hit_rate"]
            lines.append(
                f"  per epoch: {r['requests_per_epoch']:,.0f} requests, "
                f"{r['bytes_per_epoch'] / 1e6:,.1f} MB, {r['retries_per_epoch']:,.0f} retries; "
                f"cache hit rate {'n/a' if rate is None else f'{rate:.0%}'}"
            )
    workers, why = pick(results)
    lines.append(f"pick: {workers} workers: {why}")
    return "\n".join(lines)
