"""The out-of-core plan gives plan_shards's exact result, whatever the memory limits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardprep.format.errors import PlanError
from shardprep.inventory import Inventory, InventoryBuilder
from shardprep.plan import plan_shards
from shardprep.plan_store import PlanInput, PlanLimits, plan_input_to_files
from shardprep.weighting import Selection
from tests.strategies import PlanCase, plan_cases, plan_cases_with_copies

# Every step spills: runs of 13 keys merged 3 at a time (two levels from 27 runs), a merge of
# 20 keys, groups of 9 samples, buckets of 11.
TINY = PlanLimits(chunk=7, run=13, merge=20, bucket=11, group=9, fan_in=3)
LIMITS = st.sampled_from(
    [TINY, PlanLimits(chunk=3, run=5, merge=4, bucket=2, group=1, fan_in=2), PlanLimits()]
)


class _Given(PlanInput):
    """Labels and sizes given directly (any values), rows from a stand-in inventory."""

    def __init__(self, case: PlanCase, groups: np.ndarray | None) -> None:
        n = len(case.labels)
        builder = InventoryBuilder("/data")
        for i in range(max(n, int(groups.max()) + 1 if groups is not None else 0)):
            builder.add(f"s/{i:05d}", 0, [("bin", i, -1)])
        selection = (
            Selection.every(n) if groups is None else Selection(groups, np.zeros(n, np.int64))
        )
        super().__init__(builder.freeze(("c",)), selection)
        object.__setattr__(self, "case", case)

    def keys(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        case: PlanCase = self.case  # type: ignore[attr-defined]
        sources = self.selection.sources(np.arange(lo, hi))
        return case.labels[lo:hi].astype(np.int64), case.sizes[lo:hi].astype(np.int64), sources


def _both(
    case: PlanCase, groups: np.ndarray | None, limits: PlanLimits, folder: Path
) -> tuple[list[np.ndarray], list[np.ndarray], list[Inventory], Inventory]:
    expected = plan_shards(case.labels, case.sizes, case.num_shards, case.seed, groups=groups)
    data = _Given(case, groups)
    planned = plan_input_to_files(data, case.num_shards, case.seed, str(folder), limits)
    loaded = [planned.load(s) for s in range(case.num_shards)]
    assert [planned.shard_size(s) for s in range(case.num_shards)] == [len(p) for p in expected]
    inventory = data.inventory
    assert isinstance(inventory, Inventory)
    return expected, [p for p, _, _ in loaded], [rows for _, rows, _ in loaded], inventory


@settings(max_examples=40, deadline=None)
@given(case=plan_cases(), limits=LIMITS)
def test_same_shards_and_order_as_plan_shards(
    case: PlanCase, limits: PlanLimits, tmp_path_factory: pytest.TempPathFactory
) -> None:
    expected, got, rows, inventory = _both(case, None, limits, tmp_path_factory.mktemp("plan"))
    for shard, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have.tolist() == want.tolist(), f"shard {shard}"
        # each shard's file carries exactly its samples' metadata, in write order
        assert rows[shard].samples(np.arange(len(have))) == inventory.samples(have)


@settings(max_examples=40, deadline=None)
@given(data=plan_cases_with_copies(), limits=LIMITS)
def test_copies_same_as_plan_shards(
    data: tuple[PlanCase, np.ndarray], limits: PlanLimits, tmp_path_factory: pytest.TempPathFactory
) -> None:
    case, groups = data
    expected, got, rows, inventory = _both(case, groups, limits, tmp_path_factory.mktemp("plan"))
    for want, have, shard_rows in zip(expected, got, rows, strict=True):
        assert have.tolist() == want.tolist()
        assert shard_rows.samples(np.arange(len(have))) == inventory.samples(groups[have])


def test_the_work_folder_keeps_only_one_file_per_shard(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    case = PlanCase(rng.integers(0, 5, 500), rng.integers(1, 10_000, 500), 12, 4)
    _both(case, None, TINY, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"shard-{s}" for s in range(12))


@pytest.mark.parametrize("num_shards", [0, 6])
def test_impossible_shard_counts_raise_plan_error(num_shards: int, tmp_path: Path) -> None:
    case = PlanCase(np.zeros(5, np.int64), np.ones(5, np.int64), num_shards, 0)
    with pytest.raises(PlanError, match=f"cannot make {num_shards} shard"):
        plan_input_to_files(_Given(case, None), num_shards, 0, str(tmp_path), TINY)
