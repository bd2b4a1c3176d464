"""Real multi-process DDP runs: equal per-rank counts and steps, no duplicates, resume, determinism."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch.utils.data

from loader import ShardDataset
from tests.distributed.harness import run_ranks
from tests.distributed.ranks import OPTIONS, before_group_then_train_like, train_like

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def _flat(batches: list[list[list[object]]]) -> list[list[object]]:
    return [pair for batch in batches for pair in batch]


@pytest.fixture(scope="module")
def three_ranks(
    built: Path, built_zstd: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[dict[str, Any]]]:
    """One start of 3 ranks for two tests: a dataset made before the process group (over
    ``built``), then ``train_like`` over ``built_zstd`` with uneven="drop". Per part, by rank."""
    folder = tmp_path_factory.mktemp("three-ranks")
    results = run_ranks(
        before_group_then_train_like,
        3,
        folder,
        before=str(built),
        out=str(built_zstd),
        uneven="drop",
    )
    return {part: [r[part] for r in results] for part in ("before_group", "train_like")}


@pytest.mark.parametrize(("world_size", "uneven"), [(3, "drop"), (4, "pad")])
def test_ranks_get_equal_disjoint_shares(
    built_zstd: Path, tmp_path: Path, world_size: int, uneven: str, request: pytest.FixtureRequest
) -> None:
    if (world_size, uneven) == (3, "drop"):  # its ranks also run the next test's passes
        results = request.getfixturevalue("three_ranks")["train_like"]
    else:
        results = run_ranks(train_like, world_size, tmp_path, out=str(built_zstd), uneven=uneven)
    total = 1001
    per_rank = total // world_size if uneven == "drop" else -(-total // world_size)
    assert [r["num_samples"] for r in results] == [per_rank] * world_size
    assert [r["len"] for r in results] == [-(-per_rank // 16)] * world_size
    for key in ("epoch0_b16", "epoch0_b1", "epoch1_b16"):
        steps = {len(r[key]) for r in results}
        assert len(steps) == 1, f"{key}: unequal step counts {steps}"
        assert [len(_flat(r[key])) for r in results] == [per_rank] * world_size
        real = Counter(k for r in results for k, padded in _flat(r[key]) if not padded)
        assert max(real.values()) == 1, f"{key}: a sample was yielded twice"
        if uneven == "drop":
            assert total - len(real) == total % world_size
        else:
            assert len(real) == total
            assert (
                sum(p for r in results for _, p in _flat(r[key])) == world_size * per_rank - total
            )
    # No set_epoch call: the second pass is epoch 1 by itself, a different order.
    assert _flat(results[0]["epoch0_b16"]) != _flat(results[0]["epoch1_b16"])
    # The resume state is the same on every rank, and resuming yields exactly the rest.
    assert all(r["state"] == results[0]["state"] for r in results)
    assert results[0]["state"]["epoch"] == 1 and results[0]["state"]["batches"] == 7
    for r in results:
        assert r["resumed"] == r["epoch1_b16"][7:]
    # Determinism: a single process simulating each rank gets the same order as real DDP.
    for rank, r in enumerate(results):
        ds = ShardDataset(
            str(built_zstd),
            uneven=uneven,
            batch_size=16,
            rank=rank,
            world_size=world_size,
            **OPTIONS,
        )
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        assert [
            [[str(k), bool(p)] for k, p in zip(b["__key__"], b["__padded__"], strict=True)]
            for b in loader
        ] == r["epoch0_b16"]


def test_dataset_made_before_the_process_group_splits_by_its_final_rank(
    three_ranks: dict[str, list[dict[str, Any]]],
) -> None:
    results = three_ranks["before_group"]
    assert [r["rank"] for r in results] == [0, 1, 2]
    for epoch in (0, 1):
        thirds = [[k for b in r["epochs"][epoch] for k, _ in b] for r in results]
        assert [len(t) for t in thirds] == [34] * 3  # 103 // 3; one dropped
        assert len(set().union(*thirds)) == 102  # disjoint: 3 x 34 distinct keys
    assert results[0]["epochs"][0] != results[0]["epochs"][1], "persistent workers, epoch 2"
