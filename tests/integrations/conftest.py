"""Builds shared by the integration tests."""

from __future__ import annotations

from pathlib import Path

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
