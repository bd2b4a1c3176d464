"""Scaling: the same ``small`` data at 1x and 10x size.

A streaming loader's peak memory must stay flat when the dataset grows
10x (shard size is kept constant, so the shard count grows 10x); build
peak memory should stay flat too. One run per point (no warm-up): the
figure of interest is memory, and the 10x builds are long.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bench.build import BY_NAME, Variant, build_once, out_dir
from bench.harness import Config, dataset, log, rm
from bench.load import LOADERS, measure

BUILDERS = ("shardprep w1", "webdataset ShardWriter", "MDSWriter", "LitData optimize w1")
READERS = (
    "tarfile loop",
    "shardprep",
    "webdataset",
    "MDS StreamingDataset",
    "LitData StreamingDataset",
)
SHARDS_1X = 16


def run(cfg: Config) -> dict[str, Any]:
    """The ``scale`` section."""
    one = dataclasses.replace(cfg, repeats=1, warmup=0)
    workers = (0,) if cfg.quick else (0, 2)
    section: dict[str, Any] = {"points": {}}
    for factor, n in zip((1, 10), cfg.scale, strict=False):
        shards = SHARDS_1X * factor
        root, meta = dataset(cfg, "small", n)
        log(f"scale: {factor}x = small-{n}, {shards} shards")
        builds: dict[str, Any] = {}
        for name in BUILDERS:
            v: Variant = BY_NAME[name]
            out = out_dir(cfg, f"small-{n}", v)
            res = build_once(one, root, meta, v, out, shards)
            builds[name] = res
            log(
                f"  build {name}: "
                + (
                    res.get("error")
                    or f"{res['files_s']:.0f} files/s, peak {res['peak_pss'] / 2**20:.0f} MiB"
                )
            )
        loads = measure(
            one, "small", n, shards, tuple(lv for lv in LOADERS if lv.name in READERS), workers
        )
        section["points"][f"{factor}x"] = {"n": n, "shards": shards, "build": builds, "load": loads}
    # the 10x shards are large (webdataset's ~5x the raw size); keep only raw data
    rm(cfg.work / "built" / f"small-{cfg.scale[1]}")
    return section
