"""A mixture's memory and first batch do not grow with samples_per_epoch (issue 23).

Each size runs in its own process (``mix_memory_child``): a MixedDataset over
two small outputs, 32-sample batches, through a torch DataLoader; peak RSS
(``VmHWM``: ``ru_maxrss`` carries the forking pytest
process's peak across exec) after 5 batches and a resume near the epoch's end. Before
the plans were lazy, 1e8 samples took 1.7 GiB and 44 s before the first batch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from loader.compose.mix import MAX_SAMPLES_PER_EPOCH
from loader.torch.mixdataset import MixedDataset
from tests.processes import run_bounded

ROOT = Path(__file__).resolve().parents[2]
FIRST_BATCH_S = 5.0  # measured 0.01-0.03 s; generous for a loaded machine


def _child(built: Path, built_zstd: Path, samples: int, batching: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "tests.integration.mix_memory_child", str(built),
               str(built_zstd), str(samples), batching]  # fmt: skip
    result = run_bounded(command, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    figures: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    print(json.dumps(figures))  # the figures, for the report (pytest -s)
    return figures


@pytest.mark.parametrize("batching", ["mixed", "per_source"])
def test_peak_memory_and_first_batch_do_not_grow_with_the_epoch(
    built: Path, built_zstd: Path, batching: str
) -> None:
    small = _child(built, built_zstd, 10**6, batching)
    large = _child(built, built_zstd, 10**8, batching)
    assert large["counts"] == [25_000_000, 75_000_000]
    assert large["len"] == 3_125_000 and small["len"] == 31_250 + (batching == "per_source")
    assert large["peak_rss_kib"] <= 1.2 * small["peak_rss_kib"], (small, large)
    for figures in (small, large):
        assert figures["first_batch_s"] < FIRST_BATCH_S, figures
        at = figures["resume_at"]
        assert figures["resumed"] == [at, at + 1]


@pytest.mark.parametrize("batching", ["mixed", "per_source"])
def test_an_epoch_of_1e15_samples_streams(built: Path, built_zstd: Path, batching: str) -> None:
    figures = _child(built, built_zstd, 10**15, batching)
    assert figures["counts"] == [25 * 10**13, 75 * 10**13] and figures["len"] == 10**15 // 32
    assert figures["first_batch_s"] < FIRST_BATCH_S
    at = figures["resume_at"]  # mixed: two batches before the end
    assert figures["resumed"] == [at, at + 1]
    if batching == "mixed":
        assert at == 10**15 // 32 - 2


def test_past_2_to_the_53_samples_is_refused_by_name(built: Path) -> None:
    with pytest.raises(ValueError, match=r"samples_per_epoch must be between 0 and 2\*\*53"):
        MixedDataset([str(built)], [1], batch_size=4, samples_per_epoch=MAX_SAMPLES_PER_EPOCH + 1)
    top = MixedDataset([str(built)], [1], batch_size=4, samples_per_epoch=MAX_SAMPLES_PER_EPOCH,
                       rank=0, world_size=1)  # fmt: skip
    assert top.stream.counts(1) == [2**53] and len(top) == 2**51
