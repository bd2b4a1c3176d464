"""Build benchmark: raw tree -> shards, per system, plus tar/cat floors.

Figures per variant: files/s and MB/s (raw payload bytes / build time),
peak PSS of the process tree, output size. Python systems' build time is
the build call only (imports excluded, see ``import_s``); reference shell
commands are timed whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from bench.harness import (
    Config,
    dataset,
    dir_size,
    is_built,
    log,
    mark_built,
    repeat,
    rm,
    run_shell,
    run_task,
)

DATASETS = ("small", "images", "text")


@dataclass(frozen=True)
class Variant:
    """One build configuration of one system."""

    name: str
    system: str  # peer key, or "tar"/"cat" for shell references
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def slug(self) -> str:
        """Folder-safe name."""
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")


VARIANTS: tuple[Variant, ...] = (
    Variant("tar cf (floor)", "tar"),
    Variant("cat (floor)", "cat"),
    Variant("shardprep w1", "shardprep", {"workers": 1}),
    Variant("shardprep w2", "shardprep", {"workers": 2}),
    Variant("shardprep zstd w1", "shardprep", {"workers": 1, "compression": "zstd"}),
    Variant("shardprep zstd w2", "shardprep", {"workers": 2, "compression": "zstd"}),
    Variant("webdataset ShardWriter", "webdataset"),
    Variant("MDSWriter", "mds"),
    Variant("MDSWriter zstd", "mds", {"compression": "zstd"}),
    Variant("LitData optimize w1", "litdata", {"workers": 1}),
    Variant("LitData optimize w2", "litdata", {"workers": 2}),
    Variant("LitData optimize zstd w2", "litdata", {"workers": 2, "compression": "zstd"}),
)
BY_NAME = {v.name: v for v in VARIANTS}
REFERENCE = "tar cf (floor)"


def out_dir(cfg: Config, dskey: str, v: Variant) -> Path:
    """Where ``v``'s output for dataset ``dskey`` lives (reused by ``load``)."""
    return cfg.work / "built" / dskey / v.slug


def build_once(
    cfg: Config, root: Path, meta: dict[str, Any], v: Variant, out: Path, shards: int
) -> dict[str, Any]:
    """One measured build into a fresh ``out``; returns the figures."""
    rm(out)
    Path(str(out) + ".ok").unlink(missing_ok=True)
    raw = root / "raw"
    n, total = sum(meta["counts"]), meta["total_bytes"]
    if v.system == "tar":
        out.mkdir(parents=True)
        res = run_shell(f"tar cf '{out}/raw.tar' -C '{raw}' .", cfg.timeout)
        secs = res["wall_s"]
    elif v.system == "cat":
        out.mkdir(parents=True)
        res = run_shell(
            f"find '{raw}' -type f -print0 | xargs -0 cat > '{out}/raw.cat'", cfg.timeout
        )
        secs = res["wall_s"]
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        spec = {
            "task": "build",
            "system": v.system,
            "raw": str(raw),
            "meta": str(root / "meta.json"),
            "out": str(out),
            "params": {"shards": shards, **v.params},
        }
        res, _ = run_task(spec, cfg.timeout)
        secs = res.get("build_s", 0.0)
    if "error" in res:
        return res
    res["files_s"] = n / secs
    res["mb_s"] = total / secs / 1e6
    res["out_bytes"] = dir_size(out)
    mark_built(out, v.system)
    return res


def ensure_built(cfg: Config, kind: str, n: int, v: Variant, shards: int) -> Path:
    """Output of ``v`` for ``kind-n``, building it (unmeasured) if missing."""
    root, meta = dataset(cfg, kind, n)
    out = out_dir(cfg, f"{kind}-{n}", v)
    if not is_built(out, v.system):
        log(f"  preparing {v.name} on {kind}-{n}")
        res = build_once(cfg, root, meta, v, out, shards)
        if "error" in res:
            raise RuntimeError(res["error"])
    return out


def run(cfg: Config, datasets: tuple[str, ...] = DATASETS) -> dict[str, Any]:
    """Measure every variant on every dataset; returns the ``build`` section."""
    section: dict[str, Any] = {}
    for kind in datasets:
        root, meta = dataset(cfg, kind)
        dskey = f"{kind}-{cfg.sizes[kind]}"
        log(f"build: {dskey} ({meta['total_bytes'] / 1e6:.1f} MB)")
        rows: dict[str, Any] = {}
        for v in VARIANTS:
            out = out_dir(cfg, dskey, v)
            rows[v.name] = repeat(
                cfg, partial(build_once, cfg, root, meta, v, out, cfg.shards[kind]), v.name
            )
            if v.system in ("tar", "cat"):
                rm(out)  # floors are not reused; save disk
        ref = rows.get(REFERENCE, {})
        for r in rows.values():
            if "files_s" in r and "files_s" in ref:
                r["vs_tar"] = r["files_s"] / ref["files_s"]
        section[kind] = {
            "n": sum(meta["counts"]),
            "raw_bytes": meta["total_bytes"],
            "shards": cfg.shards[kind],
            "rows": rows,
        }
    return section
