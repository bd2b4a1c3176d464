"""Load benchmark: one epoch, batch 64, DataLoader workers 0 and 2.

Every system uses the same collate (``bench.peers.common.collate``: sample
-> payload bytes, list per batch). Shuffling is on for every system, each with
its own mechanism. ``cat`` of the webdataset shards and a bare ``tarfile``
loop over them are the references. MB/s counts payload bytes for all rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from bench.build import BY_NAME, DATASETS, ensure_built
from bench.harness import Config, dataset, log, repeat, rm, run_shell, run_task

WORKERS = (0, 2)
BATCH = 64


@dataclass(frozen=True)
class LoadVariant:
    """A reader over the output of one build variant."""

    name: str
    system: str  # peer key, "tarfile" or "cat"
    built: str  # build variant whose output is read
    datasets: tuple[str, ...] = DATASETS
    params: tuple[tuple[str, Any], ...] = ()  # extra loader parameters


LOADERS: tuple[LoadVariant, ...] = (
    LoadVariant("cat (floor)", "cat", "webdataset ShardWriter"),
    LoadVariant("tarfile loop", "tarfile", "webdataset ShardWriter"),
    LoadVariant("shardprep", "shardprep", "shardprep w1"),
    # whole batches made in the workers, payloads packed into shared-memory tensors
    LoadVariant("shardprep batches", "shardprep", "shardprep w1", params=(("batches", True),)),
    LoadVariant("shardprep zstd", "shardprep", "shardprep zstd w1", ("text",)),
    LoadVariant("webdataset", "webdataset", "webdataset ShardWriter"),
    LoadVariant("MDS StreamingDataset", "mds", "MDSWriter"),
    LoadVariant("MDS zstd", "mds", "MDSWriter zstd", ("text",)),
    LoadVariant("LitData StreamingDataset", "litdata", "LitData optimize w1"),
    LoadVariant("LitData zstd", "litdata", "LitData optimize zstd w2", ("text",)),
)
SINGLE = ("cat", "tarfile")  # no DataLoader: measured once, shown as workers 0


def load_once(
    cfg: Config, lv: LoadVariant, out: Path, workers: int, n: int, nbytes: int
) -> dict[str, Any]:
    """One measured epoch in a fresh process."""
    rm(Path(str(out) + ".cache"))  # compressed readers decompress into this
    if lv.system == "cat":
        res = run_shell(f"cat '{out}'/*.tar > /dev/null", cfg.timeout)
        res.update(samples=n, bytes=nbytes, epoch_s=res.get("wall_s", 0.0), ttfb_s=None)
    else:
        spec = {
            "task": "load",
            "system": lv.system,
            "out": str(out),
            "batch_size": BATCH,
            "num_workers": workers,
            "params": {"shuffle": True, **dict(lv.params)},
        }
        res, _ = run_task(spec, cfg.timeout)
    if "error" in res:
        return res
    res["samples_s"] = res["samples"] / res["epoch_s"]
    res["mb_s"] = res["bytes"] / res["epoch_s"] / 1e6
    res["complete"] = res["samples"] == n
    return res


def measure(
    cfg: Config,
    kind: str,
    n: int,
    shards: int,
    loaders: tuple[LoadVariant, ...],
    workers: tuple[int, ...] = WORKERS,
) -> dict[str, Any]:
    """Rows ``"<name> | w<k>"`` for ``kind-n`` (used by load and scale)."""
    _, meta = dataset(cfg, kind, n)
    rows: dict[str, Any] = {}
    for lv in loaders:
        try:
            out = ensure_built(cfg, kind, n, BY_NAME[lv.built], shards)
        except RuntimeError as e:
            for w in workers if lv.system not in SINGLE else (0,):
                rows[f"{lv.name} | w{w}"] = {"error": f"build failed: {e}"}
            continue
        for w in workers if lv.system not in SINGLE else (0,):
            once = partial(load_once, cfg, lv, out, w, n, meta["total_bytes"])
            rows[f"{lv.name} | w{w}"] = repeat(cfg, once, f"{lv.name} w{w}")
    return rows


def run(cfg: Config, datasets: tuple[str, ...] = DATASETS) -> dict[str, Any]:
    """The ``load`` section: every reader, every dataset, workers 0 and 2."""
    section: dict[str, Any] = {}
    for kind in datasets:
        n = cfg.sizes[kind]
        log(f"load: {kind}-{n}")
        loaders = tuple(lv for lv in LOADERS if kind in lv.datasets)
        rows = measure(cfg, kind, n, cfg.shards[kind], loaders)
        cat = rows.get("cat (floor) | w0", {})
        tl = rows.get("tarfile loop | w0", {})
        for r in rows.values():
            if "mb_s" in r and "mb_s" in cat:
                r["vs_cat"] = r["mb_s"] / cat["mb_s"]
            if "samples_s" in r and "samples_s" in tl:
                r["vs_tarfile"] = r["samples_s"] / tl["samples_s"]
        section[kind] = {"n": n, "rows": rows}
    return section
