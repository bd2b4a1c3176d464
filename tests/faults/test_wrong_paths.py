"""The loader pointed at the wrong place: one line naming the path and what to pass instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from loader import ShardDataset
from loader.core import ShardStream
from shardprep.format.errors import ManifestError


@pytest.mark.parametrize("make", [ShardDataset, ShardStream])
def test_a_shard_file_names_its_folder(built: Path, make: type) -> None:
    shard = built / "shard-00000.tar"
    with pytest.raises(ManifestError) as caught:
        make(str(shard))
    assert str(caught.value) == (
        f"{shard}: a file, not a shardprep output folder; pass the folder holding "
        f"manifest.json and the shards ({built} is one)"
    )


def test_a_file_elsewhere_gets_no_hint(tmp_path: Path) -> None:
    stray = tmp_path / "notes.txt"
    stray.write_text("x")
    with pytest.raises(ManifestError) as caught:
        ShardDataset(str(stray))
    assert str(caught.value) == (
        f"{stray}: a file, not a shardprep output folder; pass the folder holding "
        "manifest.json and the shards"
    )


def test_a_missing_path_says_it_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    with pytest.raises(ManifestError) as caught:
        ShardDataset(str(missing))
    assert str(caught.value) == (
        f"{missing}: no such folder; pass the output folder of shardprep build "
        "(the one holding manifest.json)"
    )


def test_a_folder_without_manifest_says_so(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="no manifest; is this a finished shardprep output"):
        ShardDataset(str(tmp_path))
