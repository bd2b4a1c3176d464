"""A shard's task carries its metadata as columns: the samples it rebuilds are exactly the plan's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import shardprep
from shardprep.config import BuildConfig
from shardprep.inventory import Inventory
from shardprep.scan import scan
from shardprep.weighting import select_samples
from tests.conftest import payload, write_class_folders


@pytest.fixture(scope="module")
def inventories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Inventory]:
    """Class folders, a listing with a .json member per row, and tar input (containers)."""
    base = tmp_path_factory.mktemp("tasks")
    folders = write_class_folders(base / "raw", {"ant": 9, "bee": 4, "cat": 6})
    listing_root = base / "listing"
    rows = ["path,label,note"]
    for i in range(12):
        (listing_root / "d").mkdir(parents=True, exist_ok=True)
        (listing_root / "d" / f"{i}.bin").write_bytes(payload(i % 2, i))
        rows.append(f"d/{i}.bin,{'xy'[i % 2]},n{i * 7}")
    (listing_root / "l.csv").write_text("\n".join(rows) + "\n")
    shardprep.build(str(folders), str(base / "tars"), shards=3, workers=1, progress=False)
    return {
        "folders": scan(str(folders)),
        "listing": scan(str(listing_root / "l.csv")),
        "tar": scan(str(base / "tars")),
    }


@given(data=st.data(), layout=st.sampled_from(["folders", "listing", "tar"]))
def test_a_subset_rebuilds_the_same_samples(
    inventories: dict[str, Inventory], data: st.DataObject, layout: str
) -> None:
    inventory = inventories[layout]
    n = len(inventory)
    indices = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=3 * n)), dtype=np.int64)
    subset = inventory.subset(indices)
    assert len(subset) == len(indices)
    assert subset.samples(np.arange(len(indices))) == inventory.samples(indices)


@given(
    data=st.data(),
    weighting=st.sampled_from(
        [{"class_weights": "balanced"}, {"class_weights": "ant=1,bee=3,cat=1", "keep_all": True},
         {"class_weights": "sqrt", "weights_only": True}]
    ),
)  # fmt: skip
def test_a_selection_subset_keeps_copies_multiplicities_and_weights(
    inventories: dict[str, Inventory], data: st.DataObject, weighting: dict[str, object]
) -> None:
    inventory = inventories["folders"]
    selection = select_samples(inventory, BuildConfig(shards=2, **weighting))  # type: ignore[arg-type]
    positions = np.array(
        data.draw(st.lists(st.integers(0, len(selection) - 1), max_size=40)), dtype=np.int64
    )
    part = inventory.subset(selection.source[positions])
    rebuilt = selection.subset(positions).samples(part, np.arange(len(positions)))
    assert rebuilt == selection.samples(inventory, positions)
