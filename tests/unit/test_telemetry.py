"""Epoch telemetry (loader.read.telemetry): counts exact, stage seconds within the epoch's wall
time, a known slow decode or slow training step seen where it happens, with 0 and 2 workers."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.utils.data

from loader import ShardDataset
from loader.core import ShardStream
from loader.read.telemetry import STAGES, EpochStats
from tests.processes import dataloader_iterator

SLOW_S = 0.002  # a decode of at least this long per sample (time.sleep never returns early)
STEP_S = 0.005  # a training step of at least this long per batch


def slow_decode(data: bytes) -> bytes:
    time.sleep(SLOW_S)
    return data


def _epoch(ds: ShardDataset, workers: int, step_s: float = 0.0) -> tuple[float, int, int]:
    """One timed epoch: (wall seconds, samples, batches) as the loop saw them."""
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    samples = batches = 0
    began = time.perf_counter()
    with dataloader_iterator(ds.timed(loader)) as batches_in:
        for batch in batches_in:
            samples += len(batch["__key__"])
            batches += 1
            if step_s:
                time.sleep(step_s)
    return time.perf_counter() - began, samples, batches


def _additive(stats: EpochStats) -> float:
    """The stages that add up (``network`` overlaps ``read``)."""
    return sum(s for name, s in stats.stages.items() if name != "network")


@pytest.mark.parametrize("workers", [0, 2])
def test_counts_are_exact_and_stages_fit_in_the_epoch(built: Path, workers: int) -> None:
    ds = ShardDataset(str(built), batch_size=8)
    wall, samples, batches = _epoch(ds, workers)
    stats = ds.epoch_stats()
    assert (stats.epoch, stats.samples, stats.batches) == (0, 103, len(ds)) == (0, 103, 13)
    assert (samples, batches) == (103, len(ds))
    assert set(stats.stages) == set(STAGES)
    assert all(s >= 0 for s in stats.stages.values())
    assert stats.stages["read"] > 0 and stats.stages["assemble"] > 0
    # each process counts only its own time: a worker's stages fit in the epoch
    assert _additive(stats) <= wall * max(1, workers)
    assert stats.wait_s is not None and stats.compute_s is not None
    assert stats.first_batch_s is not None and 0 < stats.first_batch_s <= wall
    assert stats.wait_s + stats.compute_s <= wall
    # handoff: pickling to the main process, in workers only
    assert (stats.stages["handoff"] > 0) == (workers > 0)
    assert stats.io is None  # a local output
    flat = stats.as_dict()
    assert flat["samples"] == 103 and flat["stage_read_s"] == stats.stages["read"]
    assert flat["wait_share"] == pytest.approx(stats.wait_s / (stats.wait_s + stats.compute_s))
    # the next epoch's pass replaces the counts
    _epoch(ds, workers)
    assert (ds.epoch_stats().epoch, ds.epoch_stats().samples) == (1, 103)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_slow_decode_is_counted_as_decode_and_the_loop_waits_for_it(
    built: Path, workers: int
) -> None:
    ds = ShardDataset(str(built), batch_size=8, decode={"bin": slow_decode})
    wall, samples, _ = _epoch(ds, workers)
    stats = ds.epoch_stats()
    assert samples == stats.samples == 103
    assert stats.stages["decode"] >= 103 * SLOW_S
    assert _additive(stats) <= wall * max(1, workers)
    assert stats.wait_s is not None and stats.compute_s is not None
    # the busiest worker decodes its whole share before the loop can end; the loop's own
    # body is a few microseconds a batch, so nearly all of that is waiting
    busiest = max(ds.stream.slot_samples(1, max(1, workers)))
    assert stats.wait_s + stats.compute_s >= busiest * SLOW_S
    assert stats.wait_s >= busiest * SLOW_S - stats.compute_s


@pytest.mark.parametrize("workers", [0, 2])
def test_a_slow_training_step_is_counted_as_compute(built: Path, workers: int) -> None:
    ds = ShardDataset(str(built), batch_size=8)
    wall, _, batches = _epoch(ds, workers, step_s=STEP_S)
    stats = ds.epoch_stats()
    assert stats.compute_s is not None and stats.wait_s is not None
    # every step but the last is followed by a next() (the last one's by the loop's end)
    assert stats.compute_s >= (batches - 1) * STEP_S
    assert stats.wait_s + stats.compute_s <= wall


def test_without_timed_workers_leave_the_wait_unknown(built: Path) -> None:
    ds = ShardDataset(str(built), batch_size=8)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    with dataloader_iterator(loader) as batches:
        assert sum(len(b["__key__"]) for b in batches) == 103
    stats = ds.epoch_stats()
    assert stats.samples == 103 and stats.wait_s is None and "wait_s" not in stats.as_dict()
    # an in-process pass next: the workers' rows of the last pass are not counted in it
    assert sum(len(b["__key__"]) for b in ds) == 103
    assert (ds.epoch_stats().epoch, ds.epoch_stats().samples) == (0, 103)  # (its own counter)


def test_the_core_stream_counts_its_pass_without_torch_layers(
    built: Path, built_zstd: Path
) -> None:
    stream = ShardStream(str(built), batch_size=10, decode={"bin": slow_decode})
    began = time.perf_counter()
    samples = sum(len(b["__key__"]) for b in stream.iterate(0))
    wall = time.perf_counter() - began
    stats = stream.epoch_stats()
    assert (stats.samples, stats.batches) == (samples, 11) == (103, 11)
    assert stats.stages["decode"] >= 103 * SLOW_S
    assert stats.stages["checksums"] > 0 and stats.stages["read"] > 0
    assert _additive(stats) <= wall
    assert stats.wait_s is None  # no loop was watched
    single = ShardStream(str(built_zstd))  # no batch size: zstd frames, one sample per item
    assert sum(1 for _ in single.iterate(0)) == 1001
    assert (single.epoch_stats().samples, single.epoch_stats().batches) == (1001, 1001)
    assert single.epoch_stats().stages["read"] > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mixture_counts_its_samples_and_batches(built: Path, workers: int) -> None:
    """A mixture's stream counts no stages; its epoch's samples and batches are still exact
    (they were 0 and the epoch -1, logged as if measured: the hostile pass of issue 38)."""
    from loader import MixedDataset

    ds = MixedDataset([str(built), str(built)], [1, 1], batch_size=8, samples_per_epoch=64)
    _, samples, batches = _epoch(ds, workers)  # type: ignore[arg-type]
    stats = ds.epoch_stats()
    assert (samples, batches) == (64, 8)
    assert (stats.epoch, stats.samples, stats.batches) == (0, 64, 8)
    assert stats.wait_s is not None
