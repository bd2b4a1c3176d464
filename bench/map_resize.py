"""A resize transform while sharding: shardprep ``build(map=...)`` vs LitData ``optimize(fn=...)``.

Both run the same Pillow resize + JPEG re-encode per sample, with the same worker count, from the
same class folders of JPEGs; times are end to end (each tool's own listing, workers, writing).
Rounds interleave the tools. LitData needs ``pip install litdata`` (see bench/README.md: use a
venv with ``--system-site-packages`` and ``-c constraints.txt``).

    python -m bench.map_resize --images 3000 --workers 2 --rounds 3 --dir /tmp/map-bench
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import time
from typing import Any

import numpy as np
from PIL import Image

SIDE = 256  # input images: SIDE x SIDE JPEG; the map halves them


def resize_jpeg(data: bytes) -> bytes:
    """``data`` (a JPEG) at half width and height, re-encoded at quality 90."""
    with Image.open(io.BytesIO(data)) as image:
        image = image.convert("RGB")
        small = image.resize((image.width // 2, image.height // 2), Image.BILINEAR)
    out = io.BytesIO()
    small.save(out, format="JPEG", quality=90)
    return out.getvalue()


def shardprep_map(sample: dict[str, Any]) -> dict[str, Any]:
    """The shardprep map: resize the sample's .jpg."""
    sample["jpg"] = resize_jpeg(sample["jpg"])
    return sample


def litdata_fn(item: tuple[str, int, str]) -> dict[str, Any]:
    """The LitData optimize() callback: read one file and resize it."""
    path, cls, key = item
    with open(path, "rb") as f:
        return {"key": key, "jpg": resize_jpeg(f.read()), "cls": cls}


def litdata_copy(item: tuple[str, int, str]) -> dict[str, Any]:
    path, cls, key = item
    with open(path, "rb") as f:
        return {"key": key, "jpg": f.read(), "cls": cls}


def generate(raw: str, images: int, classes: int = 5) -> list[tuple[str, int, str]]:
    """Class folders of smooth-plus-noise JPEGs (about 20-40 KiB each); returns LitData's items."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:SIDE, 0:SIDE].astype(np.float32) / SIDE
    items = []
    for i in range(images):
        cls = i % classes
        folder = os.path.join(raw, f"c{cls}")
        os.makedirs(folder, exist_ok=True)
        a, b, c = rng.random(3)
        base = np.stack([a * x * 255, b * y * 255, c * (x + y) * 127], axis=-1)
        noisy = base + rng.normal(0, 12, size=base.shape)
        pixels = np.clip(noisy, 0, 255).astype(np.uint8)
        path = os.path.join(folder, f"{i:06d}.jpg")
        Image.fromarray(pixels).save(path, format="JPEG", quality=90)
        items.append((path, cls, f"{i:06d}"))
    return items


def run_shardprep(raw: str, out: str, workers: int, shards: int, transform: bool) -> float:
    import shardprep

    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    shardprep.build(
        raw,
        out,
        shards=shards,
        workers=workers,
        map=shardprep_map if transform else None,
        progress=False,
    )
    return time.perf_counter() - start


def run_litdata(
    items: list[tuple[str, int, str]], out: str, workers: int, chunk_bytes: int, transform: bool
) -> float:
    from litdata import optimize

    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    optimize(
        fn=litdata_fn if transform else litdata_copy,
        inputs=items,
        output_dir=out,
        num_workers=workers,
        chunk_bytes=chunk_bytes,
        reorder_files=False,
        mode="overwrite",
        verbose=False,
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/map-bench")
    args = parser.parse_args()
    raw = os.path.join(args.dir, "raw")
    shutil.rmtree(args.dir, ignore_errors=True)
    items = generate(raw, args.images)
    total = sum(os.path.getsize(p) for p, _, _ in items)
    chunk_bytes = total // args.shards + 1
    runs: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, run in (
            (
                "shardprep map",
                lambda: run_shardprep(raw, f"{args.dir}/sp", args.workers, args.shards, True),
            ),
            (
                "litdata fn",
                lambda: run_litdata(items, f"{args.dir}/ld", args.workers, chunk_bytes, True),
            ),
            (
                "shardprep copy",
                lambda: run_shardprep(raw, f"{args.dir}/sp", args.workers, args.shards, False),
            ),
            (
                "litdata copy",
                lambda: run_litdata(items, f"{args.dir}/ld", args.workers, chunk_bytes, False),
            ),
        ):
            runs.setdefault(name, []).append(run())
    report = {
        "images": args.images,
        "input_mb": round(total / 1e6, 1),
        "workers": args.workers,
        "results": {
            name: {
                "median_s": round(float(np.median(t)), 3),
                "runs_s": [round(v, 3) for v in t],
                "images_per_s": round(args.images / float(np.median(t)), 1),
            }
            for name, t in runs.items()
        },
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
