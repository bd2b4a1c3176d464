"""A small, deterministic, imbalanced class-folder dataset for trying shardprep and for tests.

Writes ``RAW/class-<k>/<nnnnnn>.npy``: small uint8 arrays ("images") of
varying size; class k gets about 20**(-k/(C-1)) of the largest class's count.
"""

from __future__ import annotations

import io
import os

import numpy as np

from shardprep.errors import InputError
from shardprep.rng import derive_rng

__all__ = ["class_sizes", "write_example"]

MARKER = ".shardprep-example"  # hidden, so the scan skips it


def class_sizes(num_samples: int, num_classes: int) -> list[int]:
    """Per-class counts summing to ``num_samples``; largest ≈ 20× smallest, each ≥ 1."""
    if num_samples < num_classes:
        raise InputError(f"need at least one sample per class ({num_samples} < {num_classes})")
    shares = np.array([20.0 ** (-k / max(1, num_classes - 1)) for k in range(num_classes)])
    counts = np.maximum(1, np.floor(shares / shares.sum() * num_samples)).astype(int)
    counts[0] += num_samples - counts.sum()
    return [int(c) for c in counts]


def write_example(
    raw: str, num_samples: int = 1000, num_classes: int = 5, seed: int = 0
) -> list[int]:
    """Write the example dataset to ``raw`` (must be empty or absent); returns per-class counts.

    Raises:
        InputError: ``raw`` exists and is not empty.
    """
    counts = class_sizes(num_samples, num_classes)
    marker = os.path.join(raw, MARKER)
    stamp = f"{num_samples} {num_classes} {seed}\n"
    if os.path.exists(raw) and os.listdir(raw):
        if os.path.exists(marker):
            with open(marker) as f:
                if f.read() == stamp:
                    return counts  # the same example is already there
        raise InputError(f"{raw}: not empty; choose a new folder for the example", raw)
    rng = derive_rng(seed, "example")
    index = 0
    for k, count in enumerate(counts):
        folder = os.path.join(raw, f"class-{k}")
        os.makedirs(folder, exist_ok=True)
        for _ in range(count):
            side = int(rng.integers(8, 48))
            image = rng.integers(0, 256, size=(side, side), dtype=np.uint8)
            buffer = io.BytesIO()
            np.save(buffer, image)
            with open(os.path.join(folder, f"{index:06d}.npy"), "wb") as f:
                f.write(buffer.getvalue())
            index += 1
    with open(marker, "w") as f:
        f.write(stamp)
    return counts
