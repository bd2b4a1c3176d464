"""Inspect: summarise a built output from its manifest alone (no shard is read).

OUT is a folder or a URL (``s3://bucket/prefix``: only its ``manifest.json`` is read,
:func:`~shardprep.url_output.read_manifest_at`).

Optional plotting of per-shard class histograms needs matplotlib
(``pip install "shardprep[plot]"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardprep.format.errors import InputError
from shardprep.format.versions import manifest_version, version_entries
from shardprep.url_output import read_manifest_at

__all__ = ["format_inspection", "inspection", "plot_histograms"]


def inspection(out: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The manifest's summary plus one row per shard, as plain data."""
    manifest = read_manifest_at(out, storage_options)
    data = manifest.to_json()
    return {
        "out": out,
        "version": manifest_version(manifest),
        "versions": version_entries(manifest),
        "options": data["options"],
        "classes": data["classes"],
        "totals": data["totals"],
        **{
            k: v
            for k, v in data.items()
            if k
            not in {
                "format",
                "version",
                "options",
                "classes",
                "totals",
                "shards",
                "input_fingerprint",
                "versions",
            }
        },
        "shards": [
            {k: s[k] for k in ("file", "num_samples", "num_bytes", "class_counts")}
            for s in data["shards"]
        ],
    }


def format_inspection(data: dict[str, Any]) -> str:
    """Human-readable text of :func:`inspection`'s result."""
    totals = data["totals"]
    lines = [
        f"{data['out']}: {totals['num_samples']} samples in {totals['num_shards']} shards, "
        f"{totals['num_bytes']:,} bytes (compression: {data['options'].get('compression')})",
        f"  samples per shard {totals['min_shard_samples']}-{totals['max_shard_samples']}, "
        f"max/min shard bytes {totals['shard_bytes_ratio']:.4f}",
    ]
    classes = data["classes"]
    if classes:
        lines.append(
            "  classes: " + ", ".join(f"{c['index']}={c['name']} ({c['count']})" for c in classes)
        )
    weighting = data.get("class_weighting")
    if weighting:
        lines += _weighting_lines(weighting, "  ")
    versions = data.get("versions") or []
    if len(versions) > 1:  # a build appended to: what each version added
        lines.append(f"  versions: {len(versions)} (this manifest is version {data['version']})")
        for v in versions:
            last = v["first_shard"] + v["num_shards"] - 1
            sha = v.get("manifest_sha256")
            lines.append(
                f"    {v['version']}: shards {v['first_shard']}-{last}, {v['num_samples']} "
                + ("samples, " + f"manifest sha256 {sha}" if sha else "samples (manifest.json)")
            )
            if v.get("class_weighting"):
                lines += _weighting_lines(v["class_weighting"], "      ")
    lines.append(f"  {'shard':<22}{'samples':>9}{'bytes':>14}  class histogram")
    for s in data["shards"]:
        lines.append(
            f"  {s['file']:<22}{s['num_samples']:>9}{s['num_bytes']:>14,}  "
            + " ".join(str(c) for c in s["class_counts"])
        )
    return "\n".join(lines)


def _weighting_lines(weighting: dict[str, Any], indent: str) -> list[str]:
    return [
        f"{indent}class weighting: {weighting.get('mode')}",
        f"{indent}  original counts: {weighting.get('original_counts')}",
        f"{indent}  realized counts: {weighting.get('realized_counts')}",
    ]


def plot_histograms(out: str, png: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Draw the per-shard class histogram (and, if reweighted, the original one) to ``png``.

    Raises:
        InputError: matplotlib is not installed, or the output is unlabelled.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise InputError('--plot needs matplotlib: pip install "shardprep[plot]"') from err
    manifest = read_manifest_at(out, storage_options)
    if manifest.class_names is None:
        raise InputError(f"{out}: unlabelled data has no class histogram to plot", out)
    import numpy as np

    counts = np.array([s.class_counts for s in manifest.shards])
    weighting = manifest.extra.get("class_weighting")
    panels = 2 if weighting else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    if weighting:
        original = np.array(weighting["original_counts"], dtype=float)
        axes[0][0].bar(manifest.class_names, original / len(manifest.shards), color="gray")
        axes[0][0].set_title("before: mean samples per shard, by class")
        axes[0][0].set_xlabel("class")
    ax = axes[0][panels - 1]
    bottom = np.zeros(len(manifest.shards))
    for c, name in enumerate(manifest.class_names):
        ax.bar(range(len(manifest.shards)), counts[:, c], bottom=bottom, label=name)
        bottom += counts[:, c]
    ax.set_title(
        "after: samples per shard, stacked by class"
        if weighting
        else "samples per shard, stacked by class"
    )
    ax.set_xlabel("shard")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
