"""A small, deterministic, imbalanced dataset of images for trying shardprep and for tests.

Writes ``RAW/class-<k>/<nnnnnn>.png``: 32x32 RGB PNG images, all of one
size. Each class draws its own shape (a disc, a square, horizontal bars,
vertical bars, a cross) in its own colour, at a random place and size, over
a dark noisy background, so a small convolutional network tells them apart
(``docs/examples/train_ddp.py``). Classes ``k`` and ``k + 40`` look alike:
with more than 40 classes the extra ones repeat earlier shapes and colours.
Class ``k`` gets about ``20**(-k/(C-1))`` of the largest class's count.

The PNG files are encoded here (zlib, no Pillow), byte-identical for the
same arguments on a given zlib.
"""

from __future__ import annotations

import os
import struct
import zlib

import numpy as np

from shardprep.format.errors import InputError
from shardprep.format.rng import derive_rng

__all__ = ["IMAGE_SIZE", "class_sizes", "encode_png", "write_example"]

MARKER = ".shardprep-example"  # hidden, so the scan skips it
IMAGE_SIZE = 32
SHAPES = ("disc", "square", "horizontal bars", "vertical bars", "cross")
PALETTE = np.array(
    [
        (230, 40, 40),  # red
        (40, 200, 60),  # green
        (50, 90, 240),  # blue
        (240, 220, 40),  # yellow
        (220, 60, 220),  # magenta
        (40, 220, 220),  # cyan
        (250, 140, 20),  # orange
        (245, 245, 245),  # white
    ],
    dtype=np.int16,
)


def class_sizes(num_samples: int, num_classes: int) -> list[int]:
    """Per-class counts summing to ``num_samples``; largest ≈ 20× smallest, each ≥ 1."""
    if num_samples < num_classes:
        raise InputError(f"need at least one sample per class ({num_samples} < {num_classes})")
    shares = np.array([20.0 ** (-k / max(1, num_classes - 1)) for k in range(num_classes)])
    counts = np.maximum(1, np.floor(shares / shares.sum() * num_samples)).astype(int)
    counts[0] += num_samples - counts.sum()
    return [int(c) for c in counts]


def encode_png(pixels: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of ``pixels`` (``(height, width, 3)`` uint8), no filtering."""
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(
            f"need a (height, width, 3) uint8 array, not {pixels.dtype} {pixels.shape}"
        )
    height, width, _ = pixels.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8), pixels.reshape(height, -1)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 9))
        + chunk(b"IEND", b"")
    )


def draw(label: int, rng: np.random.Generator) -> np.ndarray:
    """One ``IMAGE_SIZE`` square RGB image of class ``label`` (its shape in its colour)."""
    n = IMAGE_SIZE
    image = rng.integers(0, 70, size=(n, n, 3)).astype(np.int16)  # dark noisy background
    size = int(rng.integers(n // 4, n // 2 + 1))  # half-width of the shape
    cy, cx = (int(v) for v in rng.integers(size // 2 + 2, n - size // 2 - 2, size=2))
    y, x = np.mgrid[0:n, 0:n]
    shape = SHAPES[label % len(SHAPES)]
    if shape == "disc":
        mask = (y - cy) ** 2 + (x - cx) ** 2 <= size**2
    elif shape == "square":
        mask = (abs(y - cy) <= size * 3 // 4) & (abs(x - cx) <= size * 3 // 4)
    elif shape == "horizontal bars":
        mask = (abs(x - cx) <= size) & ((y - cy) % 6 < 3)
    elif shape == "vertical bars":
        mask = (abs(y - cy) <= size) & ((x - cx) % 6 < 3)
    else:  # cross
        mask = ((abs(y - cy) <= 2) & (abs(x - cx) <= size)) | (
            (abs(x - cx) <= 2) & (abs(y - cy) <= size)
        )
    colour = PALETTE[(label * 3) % len(PALETTE)] + rng.integers(-25, 26, size=3)
    image[mask] = colour
    image += rng.integers(-12, 13, size=image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def write_example(
    raw: str, num_samples: int = 1000, num_classes: int = 5, seed: int = 0
) -> list[int]:
    """Write the example dataset to ``raw`` (must be empty or absent); returns per-class counts.

    Raises:
        InputError: ``raw`` exists and is not empty (unless it holds this very example).
    """
    counts = class_sizes(num_samples, num_classes)
    marker = os.path.join(raw, MARKER)
    stamp = f"png {num_samples} {num_classes} {seed}\n"
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
            with open(os.path.join(folder, f"{index:06d}.png"), "wb") as f:
                f.write(encode_png(draw(k, rng)))
            index += 1
    with open(marker, "w") as f:
        f.write(stamp)
    return counts
