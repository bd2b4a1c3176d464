"""A shard's task carries its metadata as columns: the samples it rebuilds are exactly the plan's."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import shardprep
from shardprep.config import BuildConfig
from shardprep.engine.local import LocalEngine
from shardprep.format.errors import DuplicateKeyError, InputError
from shardprep.inventory import Inventory
from shardprep.scan import check_unique_keys, scan
from shardprep.scan.class_folders import _scan_class, scan_class_folders
from shardprep.spill import InventoryStore, StoreFolder
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


@pytest.mark.parametrize("layout", ["folders", "listing", "tar", "keyed"])
@pytest.mark.parametrize("chunk", [1, 4, 1 << 16])
def test_the_on_disk_inventory_reads_back_what_the_scan_found(
    inventories: dict[str, Inventory],
    tmp_path_factory: pytest.TempPathFactory,
    layout: str,
    chunk: int,
) -> None:
    """Scanned into column files (flushed every ``chunk`` samples), read back in any slice."""
    base = tmp_path_factory.mktemp("store")
    if layout == "keyed":
        raw = base / "keyed"
        raw.mkdir()
        for i in range(7):
            (raw / f"k{i}.bin").write_bytes(payload(i % 2, i))
            (raw / f"k{i}.txt").write_bytes(b"t" * i)
        raw_path, expected = str(raw), scan(str(raw))
    else:
        raw_path, expected = inventories[layout].root, inventories[layout]
        raw_path = {"listing": f"{raw_path}/l.csv"}.get(layout, raw_path)
    store = scan(raw_path, sink=lambda root, meta: InventoryStore(str(base), root, meta, chunk))
    assert isinstance(store, InventoryStore)
    n = len(expected)
    assert len(store) == n and store.num_parts == expected.num_parts
    assert store.class_names == expected.class_names and store.exts == expected.exts
    assert store.class_counts() == expected.class_counts()
    assert store.source_bytes() == expected.source_bytes()
    every = np.arange(n)
    assert store.rows(0, n).samples(every) == expected.samples(every)
    for lo, hi in [(0, 0), (0, 1), (n - 1, n), (1, n - 2), (2, 5)]:
        assert store.rows(lo, hi).samples(np.arange(hi - lo)) == expected.samples(every[lo:hi])
    picks = np.array([n - 1, 0, 3, 3, 1])
    assert store.gather(picks).samples(np.arange(5)) == expected.samples(picks)
    pieces = [rows for _, rows in store.chunks(3)]
    assert Inventory.concat(pieces).samples(every) == expected.samples(every)
    digest_store, digest_memory = hashlib.sha256(), hashlib.sha256()
    store.digest_into(digest_store)
    expected.digest_into(digest_memory)
    assert digest_store.hexdigest() == digest_memory.hexdigest()  # --resume fingerprints agree


def test_duplicate_keys_are_found_across_spilled_buckets(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for i in range(40):  # a.jpg and a.png in one class folder: one key, two samples
        (raw / "c").mkdir(parents=True, exist_ok=True)
        (raw / "c" / f"{i:02d}.jpg").write_bytes(b"x")
    (raw / "d").mkdir()
    (raw / "d" / "x.jpg").write_bytes(b"x")
    inventory = scan(str(raw))
    check_unique_keys(inventory, per_bucket=3)  # 14 buckets, no clash
    (raw / "c" / "17.png").write_bytes(b"x")
    with pytest.raises(InputError, match=r"c/17\.jpg' and '.*c/17\.png' become one sample key"):
        scan(str(raw))
    clashing = scan_class_folders(str(raw), lambda _n: None)  # not checked yet
    with pytest.raises(DuplicateKeyError) as info:
        check_unique_keys(clashing, per_bucket=3)
    assert info.value.key == "c__17"


def test_class_folders_scanned_by_worker_processes_into_disk_parts(
    inventories: dict[str, Inventory], tmp_path: Path
) -> None:
    """Each task writes its class folder to its own store; the merge copies it and removes it."""
    expected = inventories["folders"]
    make = StoreFolder(str(tmp_path), chunk=2)
    engine = LocalEngine(2)
    store = scan(expected.root, sink=make, part_sink=make, ordered_map=engine.ordered_map)
    assert isinstance(store, InventoryStore)
    every = np.arange(len(expected))
    assert store.rows(0, len(store)).samples(every) == expected.samples(every)
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(store.folder)]
    # one task's part is a closed store on disk, not an in-memory builder
    part, problems = _scan_class((expected.root, 0, "ant", make, None))
    assert isinstance(part, InventoryStore) and not problems.items
    assert part.rows(0, len(part)).samples(np.arange(9)) == expected.samples(np.arange(9))
