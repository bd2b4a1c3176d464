"""Elastic resume on real gloo ranks: a job stopped at W ranks x K workers resumes at W' x K'."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from loader.core import ShardStream
from loader.plan.elastic import pass_share
from tests.distributed.elastic_ranks import OPTIONS, run_passes
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
STATEFUL_STOP = 2  # the StatefulDataLoader passes at 4 ranks x 2 workers stop after 2 batches
# the StatefulDataLoader state resumed at (ranks, workers, how): through ds.resume (torchdata
# restores its own num_workers only) or through the loader's own load_state_dict
STATEFUL_RESUMES = [(3, 1, "resume"), (3, 2, "load"), (2, 0, "resume")]


@pytest.fixture(scope="module")
def runs(built: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Both tests' passes on four starts of the ranks instead of six (a rank start costs seconds
    on 2 cores): at 2 ranks GROW stops; at 4 SHRINK and the StatefulDataLoader stop and GROW
    resumes; at 3 SHRINK and two StatefulDataLoader states resume; at 2 the last one does.
    Each pass has its own dataset and loader. Per pass, the results of its ranks."""
    out, base = str(built), tmp_path_factory.mktemp("elastic")
    found: dict[str, list[Any]] = {}

    def start(world: int, named: dict[str, dict[str, Any]]) -> None:
        folder = base / f"start-{len(found)}-at-{world}"
        folder.mkdir()
        results = run_ranks(run_passes, world, folder, out=out, passes=list(named.values()))
        for number, name in enumerate(named):
            found[name] = [r[number] for r in results]

    def stop(case: Case) -> dict[str, Any]:
        return {"kind": "elastic", "uneven": case.uneven, "workers": case.old[1], "stop": case.stop}

    def resume(case: Case, first: list[Any]) -> dict[str, Any]:
        states = [r["state"] for r in first]
        assert all(s == states[0] for s in states) and states[0]["batches"] == case.stop
        return {
            "kind": "elastic",
            "uneven": case.uneven,
            "workers": case.new[1],
            "state": states[0],
        }

    def stateful(world: int, workers: int, how: str) -> dict[str, Any]:
        state = found["stateful-first"][0]["state"]
        return {"kind": "stateful", "workers": workers, "state": state, "how": how}

    start(2, {"grow-first": stop(GROW)})
    start(
        4,
        {
            "shrink-first": stop(SHRINK),
            "grow-second": resume(GROW, found["grow-first"]),
            "stateful-first": {"kind": "stateful", "workers": 2, "stop": STATEFUL_STOP},
        },
    )
    start(
        3,
        {
            "shrink-second": resume(SHRINK, found["shrink-first"]),
            **{f"stateful-{w}x{k}": stateful(w, k, how) for w, k, how in STATEFUL_RESUMES[:2]},
        },
    )
    start(2, {f"stateful-{w}x{k}": stateful(w, k, how) for w, k, how in STATEFUL_RESUMES[2:]})
    return found


def test_elastic_resume_on_real_ranks(built: Path, runs: dict[str, list[Any]]) -> None:
    """Stopped at 4 x 2 and resumed at 3 x 1 (pad); stopped at 2 x 0 and resumed at 4 x 2 (drop)."""
    out = str(built)
    _check_resumed(out, SHRINK, runs["shrink-first"], runs["shrink-second"])
    _check_resumed(out, GROW, runs["grow-first"], runs["grow-second"])


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
    runs: dict[str, list[Any]],
) -> None:
    """torchdata states saved at 4 ranks x 2 workers, resumed at 3 x 1 and 2 x 0 (through
    ds.resume: torchdata restores its own num_workers only) and at 3 x 2 (through the
    StatefulDataLoader's own load_state_dict): every sample of the epoch once, equal steps."""
    total, stop = 103, STATEFUL_STOP
    first = runs["stateful-first"]
    before = [k for r in first for b in r["batches"] for k in b]
    assert len(before) == 4 * stop * OPTIONS["batch_size"] and len(set(before)) == len(before)
    assigned = total - total % 4  # uneven="drop"
    rest = assigned - len(before)
    for world, workers, _ in STATEFUL_RESUMES:
        second = runs[f"stateful-{world}x{workers}"]
        after = [k for r in second for b in r["batches"] for k in b]
        share = pass_share(rest, world, "drop")
        assert [sum(map(len, r["batches"])) for r in second] == [share] * world
        real = Counter(before + after)
        assert max(real.values()) == 1, f"a sample was streamed twice ({world} x {workers})"
        assert len(real) == assigned - (rest - share * world)
        for r in second:  # the batches arrive in their order, whatever the new num_workers
            assert r["positions"] == list(range(len(r["positions"])))
