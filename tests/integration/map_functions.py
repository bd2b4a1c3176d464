"""Map functions that the --map tests import by name (``tests.integration.map_functions:...``).

Module-level, so spawned workers and Ray tasks import them back by name.
"""

from __future__ import annotations

import io
import os
from typing import Any

from PIL import Image

FAIL_KEY_ENV = "SHARDPREP_TEST_MAP_FAIL_KEY"  # half_size raises on the sample with this key


def resize_png(data: bytes, factor: int = 2) -> bytes:
    """``data`` (a PNG) downscaled by ``factor``, re-encoded as PNG (deterministic: zlib only)."""
    with Image.open(io.BytesIO(data)) as image:
        image = image.convert("RGB")
        small = image.resize((image.width // factor, image.height // factor), Image.BILINEAR)
    out = io.BytesIO()
    small.save(out, format="PNG", optimize=False, compress_level=6)
    return out.getvalue()


def half_size(sample: dict[str, Any]) -> dict[str, Any]:
    """The sample with its PNG at half width and height."""
    if sample["__key__"] == os.environ.get(FAIL_KEY_ENV):
        raise ValueError("cannot decode this one")
    sample["png"] = resize_png(sample["png"])
    return sample


def new_key(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "__key__": sample["__key__"] + "-x"}


def new_class(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "cls": b"0" if sample["cls"] != b"0" else b"1"}


def drops_class(sample: dict[str, Any]) -> dict[str, Any]:
    return {"__key__": sample["__key__"], "png": sample["png"]}


def text_payload(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "txt": "a caption"}


def returns_none(sample: dict[str, Any]) -> None:
    sample["png"] = b""


def decodes_garbage(sample: dict[str, Any]) -> dict[str, Any]:
    """Raises Pillow's UnidentifiedImageError, an OSError."""
    Image.open(io.BytesIO(b"not an image"))
    return sample
