"""Elastic resume on real gloo ranks: a job stopped at W ranks x K workers resumes at W' x K'."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from loader.core import ShardStream
from loader.plan.elastic import pass_share
from tests.distributed.elastic_ranks import (
    OPTIONS,
    elastic_passes,
    stateful_pass,
    stateful_passes,
)
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.distributed


class Case(NamedTuple):
    """Stopped after ``stop`` batches of epoch 0 at ``old`` (ranks, workers), resumed at ``new``."""

    old: tuple[int, int]
    new: tuple[int, int]
    uneven: str
    stop: int


SHRINK = Case((4, 2), (3, 1), "pad", 2)
GROW = Case((2, 0), (4, 2), "drop", 3)


def test_elastic_resume_on_real_ranks(built: Path, tmp_path: Path) -> None:
    """Both cases, on three starts of the ranks instead of four: GROW's 2 ranks stop; SHRINK's
    4 ranks stop and GROW's resume at 4 ranks on the same start; SHRINK's 3 ranks resume."""
    out = str(built)
    for name in ("2", "4", "3"):
        (tmp_path / name).mkdir()

    def stop(case: Case) -> dict[str, Any]:
        return {"uneven": case.uneven, "workers": case.old[1], "stop": case.stop}

    def resume(case: Case, first: list[Any]) -> dict[str, Any]:
        states = [r["state"] for r in first]
        assert all(s == states[0] for s in states) and states[0]["batches"] == case.stop
        return {"uneven": case.uneven, "workers": case.new[1], "state": states[0]}

    grow_first = [r[0] for r in run_ranks(elastic_passes, 2, tmp_path / "2", out=out,
                                          passes=[stop(GROW)])]  # fmt: skip
    # one start at 4 ranks: SHRINK's interrupted pass, then GROW's resumed one
    at4 = run_ranks(
        elastic_passes, 4, tmp_path / "4", out=out, passes=[stop(SHRINK), resume(GROW, grow_first)]
    )
    shrink_first, grow_second = [r[0] for r in at4], [r[1] for r in at4]
    shrink_second = [r[0] for r in run_ranks(elastic_passes, 3, tmp_path / "3", out=out,
                                             passes=[resume(SHRINK, shrink_first)])]  # fmt: skip
    _check_resumed(out, SHRINK, shrink_first, shrink_second)
    _check_resumed(out, GROW, grow_first, grow_second)


def _check_resumed(out: str, case: Case, first: list[Any], second: list[Any]) -> None:
    """Epoch 0 at ``case.old`` until the stop, then at ``case.new``: every sample once but the
    documented drops, equal steps; then the new world's normal epoch 1."""
    total, (old, _), (new, new_workers) = 103, case.old, case.new
    steps = {len(r["batches"]) for r in second}
    assert len(steps) == 1, f"{case}: unequal steps after the resume: {steps}"
    before = [k for r in first for b in r["batches"] for k, padded in b if not padded]
    after = [k for r in second for b in r["batches"] for k, padded in b if not padded]
    real = Counter(before + after)
    assert max(real.values()) == 1, f"{case}: a sample was streamed twice in the epoch"
    assigned = min(total, pass_share(total, old, case.uneven) * old)
    rest = assigned - len(before)
    share = pass_share(rest, new, case.uneven)
    assert [sum(map(len, r["batches"])) for r in second] == [share] * new, case
    assert len(real) == total - (total - assigned) - (rest - min(rest, share * new)), case
    # Epoch 1 is the new world's normal epoch 1 (computed here without torch's DataLoader).
    stream = ShardStream(out, uneven=case.uneven, **OPTIONS)
    slots = max(1, new_workers)
    for rank, r in enumerate(second):
        per_slot = [
            [b["__key__"].tolist() for b in stream.iterate(1, rank=rank, world_size=new,
                                                            worker=w, num_workers=slots)]
            for w in range(slots)
        ]  # fmt: skip
        expected = [per_slot[i % slots][i // slots] for i in range(sum(map(len, per_slot)))]
        assert r["next"] == expected, case


def test_statefuldataloader_states_resume_at_other_worlds_on_real_ranks(
    built: Path, tmp_path: Path
) -> None:
    """torchdata states saved at 4 ranks x 2 workers, resumed at 3 x 1 and 2 x 0 (through
    ds.resume: torchdata restores its own num_workers only) and at 3 x 2 (through the
    StatefulDataLoader's own load_state_dict): every sample of the epoch once, equal steps."""
    total, out, stop = 103, str(built), 2
    (tmp_path / "old").mkdir()
    first = run_ranks(stateful_pass, 4, tmp_path / "old", out=out, workers=2, stop=stop)
    before = [k for r in first for b in r["batches"] for k in b]
    assert len(before) == 4 * stop * OPTIONS["batch_size"] and len(set(before)) == len(before)
    assigned = total - total % 4  # uneven="drop"
    rest = assigned - len(before)
    state = first[0]["state"]
    worlds = {3: [(1, "resume"), (2, "load")], 2: [(0, "resume")]}  # one start per world
    for world, resumes in worlds.items():
        folder = tmp_path / f"new-{world}"
        folder.mkdir()
        passes = [{"workers": workers, "state": state, "how": how} for workers, how in resumes]
        results = run_ranks(stateful_passes, world, folder, out=out, passes=passes)
        for number, (workers, _) in enumerate(resumes):
            second = [r[number] for r in results]
            after = [k for r in second for b in r["batches"] for k in b]
            share = pass_share(rest, world, "drop")
            assert [sum(map(len, r["batches"])) for r in second] == [share] * world
            real = Counter(before + after)
            assert max(real.values()) == 1, f"a sample was streamed twice ({world} x {workers})"
            assert len(real) == assigned - (rest - share * world)
            for r in second:  # the batches arrive in their order, whatever the new num_workers
                assert r["positions"] == list(range(len(r["positions"])))
