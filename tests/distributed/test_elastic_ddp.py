"""Elastic resume on real gloo ranks: a job stopped at W ranks x K workers resumes at W' x K'."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from loader.core import ShardStream
from loader.plan.elastic import pass_share
from tests.distributed.elastic_ranks import OPTIONS, elastic_pass, stateful_pass, stateful_passes
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    ("old", "new", "uneven", "stop"),
    [((4, 2), (3, 1), "pad", 2), ((2, 0), (4, 2), "drop", 3)],
)
def test_elastic_resume_on_real_ranks(
    built: Path, tmp_path: Path, old: tuple[int, int], new: tuple[int, int], uneven: str, stop: int
) -> None:
    total, out = 103, str(built)
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    first = run_ranks(
        elastic_pass, old[0], tmp_path / "old", out=out, uneven=uneven, workers=old[1], stop=stop
    )
    states = [r["state"] for r in first]
    assert all(s == states[0] for s in states) and states[0]["batches"] == stop
    second = run_ranks(
        elastic_pass, new[0], tmp_path / "new", out=out, uneven=uneven, workers=new[1],
        state=states[0],
    )  # fmt: skip
    steps = {len(r["batches"]) for r in second}
    assert len(steps) == 1, f"unequal steps after the resume: {steps}"
    before = [k for r in first for b in r["batches"] for k, padded in b if not padded]
    after = [k for r in second for b in r["batches"] for k, padded in b if not padded]
    real = Counter(before + after)
    assert max(real.values()) == 1, "a sample was streamed twice in the epoch"
    assigned = min(total, pass_share(total, old[0], uneven) * old[0])
    rest = assigned - len(before)
    share = pass_share(rest, new[0], uneven)
    assert [sum(map(len, r["batches"])) for r in second] == [share] * new[0]
    assert len(real) == total - (total - assigned) - (rest - min(rest, share * new[0]))
    # Epoch 1 is the new world's normal epoch 1 (computed here without torch's DataLoader).
    stream = ShardStream(out, uneven=uneven, **OPTIONS)
    slots = max(1, new[1])
    for rank, r in enumerate(second):
        per_slot = [
            [b["__key__"].tolist() for b in stream.iterate(1, rank=rank, world_size=new[0],
                                                            worker=w, num_workers=slots)]
            for w in range(slots)
        ]  # fmt: skip
        expected = [per_slot[i % slots][i // slots] for i in range(sum(map(len, per_slot)))]
        assert r["next"] == expected


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
