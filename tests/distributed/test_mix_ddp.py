"""Mixtures and rank groups on real gloo ranks: counts, equal steps, proportions, resume."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import shardprep
from loader.compose.mix import mixed_batches
from tests.distributed.harness import run_ranks
from tests.distributed.mix_ranks import groups, mixture

pytestmark = pytest.mark.distributed

SIZES = {"small": 50, "medium": 1000, "large": 20000}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Three outputs of very different sizes, a few bytes per sample."""
    base = tmp_path_factory.mktemp("mix")
    outs = []
    for name, count in SIZES.items():
        raw = base / name / "raw"
        for label in ("x", "y"):
            (raw / label).mkdir(parents=True)
        for i in range(count):
            (raw / ("x" if i % 3 else "y") / f"{name}{i:05d}.bin").write_bytes(b"%d" % i)
        out = base / name / "out"
        shardprep.build(str(raw), str(out), shards=1 + count // 5000, workers=1, progress=False)
        outs.append(str(out))
    return outs


def _flat(batches: list[list[list[object]]]) -> list[list[object]]:
    return [pair for batch in batches for pair in batch]


def test_mixture_on_three_ranks(builds: list[str], tmp_path: Path) -> None:
    both = run_ranks(mixture, 3, tmp_path, outs=builds)
    for batching in ("mixed", "per_source"):
        _check_mixture([r[batching] for r in both], batching)


def _check_mixture(results: list[dict[str, Any]], batching: str) -> None:
    # 3000 samples by 0.2/0.3/0.5 = 600/900/1500; each of 3 ranks streams a third of each.
    counts = [200, 300, 500]
    assert all(r["counts"] == counts for r in results)
    for key in ("epoch0", "epoch1"):
        assert {len(r[key]) for r in results} == {results[0]["len"]}, "unequal steps"
        per_source = Counter(s for r in results for _, s in _flat(r[key]))
        assert per_source == {0: 600, 1: 900, 2: 1500}
        keys = Counter((s, k) for r in results for k, s in _flat(r[key]))
        # small (50 samples) is up-sampled 12x, each sample exactly 12 times; the others
        # are down-sampled: no sample twice in an epoch.
        assert {v for (s, _), v in keys.items() if s == 0} == {12}
        assert max(v for (s, _), v in keys.items() if s > 0) == 1
        for r in results:
            for batch in r[key]:
                got = Counter(s for _, s in batch)
                if batching == "per_source":
                    assert len(got) == 1, "a per-source batch mixes sources"
                elif len(batch) == 30:  # full batches: 6/9/15 each, exactly (30 * 0.2, ...)
                    assert [got[i] for i in range(3)] == [6, 9, 15]
    if batching == "mixed":
        assert results[0]["len"] == len(mixed_batches(counts, 30, False, 0, 0)) == 34
    else:
        assert results[0]["len"] == 7 + 10 + 17  # ceil(200/30) + ceil(300/30) + ceil(500/30)
    # large (20000) gives 1500 per epoch: 13 epochs share one lap, in disjoint parts.
    large = [{k for r in results for k, s in _flat(r[e]) if s == 2} for e in ("epoch0", "epoch1")]
    assert len(large[0]) == len(large[1]) == 1500 and not large[0] & large[1]
    # Resume: epoch 1 from a state after 5 batches gives exactly the rest of epoch 1.
    for r in results:
        assert r["resumed"] == r["epoch1"][5:]


def test_rank_groups_take_equal_steps(builds: list[str], tmp_path: Path) -> None:
    results = run_ranks(groups, 4, tmp_path, outs=builds[1:])
    # medium: 1000 // (2 * 16) = 31 steps; large: 20000 // 32 = 625: the smallest wins.
    assert [r["len"] for r in results] == [31] * 4
    for epoch in range(2):
        assert [len(r["epochs"][epoch]) for r in results] == [31] * 4
        for group, prefix in (((0, 1), "medium"), ((2, 3), "large")):
            keys = [k for rank in group for k, _ in _flat(results[rank]["epochs"][epoch])]
            assert len(keys) == len(set(keys)) == 2 * 31 * 16, "a group's ranks overlap"
            assert all(prefix in k for k in keys)
    large = [{k for rank in (2, 3) for k, _ in _flat(results[rank]["epochs"][e])} for e in range(2)]
    assert not large[0] & large[1], "the large group streams a new part each epoch"
