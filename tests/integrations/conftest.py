"""Builds shared by the integration tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import shardprep
from loader import ShardDataset
from tests.conftest import write_class_folders

ODD_SAMPLES = 941  # odd on purpose: with 2 ranks and uneven="drop", 1 sample per epoch is left out


@pytest.fixture(scope="session")
def odd_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """941 samples (3 classes) in 7 shards."""
    base = tmp_path_factory.mktemp("odd_build")
    raw = write_class_folders(base / "raw", {"a": 500, "b": 300, "c": 141})
    shardprep.build(str(raw), str(base / "out"), shards=7, workers=1, progress=False)
    return base / "out"


@pytest.fixture(scope="session")
def odd_keys(odd_build: Path) -> frozenset[str]:
    """Every key of ``odd_build``, read back through the loader on one rank (which drops nothing)."""
    ds = ShardDataset(str(odd_build), rank=0, world_size=1, shuffle=False)
    keys = [sample["__key__"] for sample in ds]
    assert len(keys) == len(set(keys)) == ODD_SAMPLES
    return frozenset(keys)


DECODE_SAMPLES = 101
IMAGE_SIZE = (8, 6)  # width, height: one size for all, so batches stack


def expected_sample(index: int) -> dict[str, Any]:
    """What sample ``index`` of ``decoded_build`` decodes to: class, array, and its image's pixel value."""
    return {
        "cls": index % 3,
        "npy": [float(index), index + 0.5, -float(index)],
        "pixel": [index % 256, (3 * index) % 256, 255 - index % 256],
    }


@pytest.fixture(scope="session")
def decoded_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """101 keyed samples (``<i>.png`` RGB 8x6, ``<i>.npy`` float32[3], ``<i>.cls``) in 4 shards."""
    import numpy as np
    from PIL import Image

    base = tmp_path_factory.mktemp("decoded_build")
    raw = base / "raw"
    raw.mkdir()
    for index in range(DECODE_SAMPLES):
        expected = expected_sample(index)
        stem = raw / f"{index:05d}"
        Image.new("RGB", IMAGE_SIZE, tuple(expected["pixel"])).save(f"{stem}.png")
        np.save(f"{stem}.npy", np.array(expected["npy"], dtype=np.float32))
        Path(f"{stem}.cls").write_text(str(expected["cls"]))
    shardprep.build(str(raw), str(base / "out"), shards=4, workers=1, progress=False)
    return base / "out"
