"""Resume arithmetic and batch-aligned slots, checked against a real DataLoader's round-robin."""

from __future__ import annotations

import pytest
import torch.utils.data
from hypothesis import given
from hypothesis import strategies as st

from loader.errors import IncompatibleStateError
from loader.plan.partition import batch_slot_counts, batches_per_rank
from loader.plan.state import STATE_VERSION, check_state, rank_resume


class _SlotBatches(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Slot s yields the rank's batch numbers s, s + K, ... (< total), after ``resume_at`` batches."""

    def __init__(self, total: int, num_workers: int, resume_at: int) -> None:
        self.total, self.num_workers, self.resume_at = total, num_workers, resume_at

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = torch.utils.data.get_worker_info()
        worker = info.id if info else 0
        slot, skip = rank_resume(self.resume_at, self.num_workers, worker)
        return iter(list(range(slot, self.total, self.num_workers))[skip:])


@pytest.mark.parametrize("num_workers", [1, 2, 3])
@pytest.mark.parametrize("total", [0, 1, 5, 7])
def test_rank_resume_against_real_dataloader(num_workers: int, total: int) -> None:
    """After any number of consumed batches, the restarted DataLoader delivers exactly the rest."""
    for resume_at in range(total + 1):
        loader = torch.utils.data.DataLoader(
            _SlotBatches(total, num_workers, resume_at),
            batch_size=None,
            num_workers=num_workers if num_workers > 1 else 0,
        )
        assert list(loader) == list(range(resume_at, total))


@given(
    per_rank=st.integers(0, 500),
    num_workers=st.integers(1, 6),
    batch_size=st.integers(1, 40),
    drop_last=st.booleans(),
)
def test_batch_slots_are_whole_batches(
    per_rank: int, num_workers: int, batch_size: int, drop_last: bool
) -> None:
    counts = batch_slot_counts(per_rank, num_workers, batch_size, drop_last)
    batches = batches_per_rank(per_rank, batch_size, drop_last)
    assert len(counts) == num_workers
    assert sum(counts) == (batches * batch_size if drop_last else per_rank)
    # Slot w makes batches w, w + K, ...: its count is that many whole batches, plus the
    # partial last batch if it is w's.
    made = [len(range(w, batches, num_workers)) for w in range(num_workers)]
    assert sum(-(-c // batch_size) for c in counts) == batches
    assert [-(-c // batch_size) for c in counts] == made
    partial = [c % batch_size for c in counts if c % batch_size]
    assert len(partial) <= 1 and not (drop_last and partial)


@given(batches=st.integers(0, 200), num_workers=st.integers(1, 8))
def test_rank_resume_skips_exactly_what_each_slot_made(batches: int, num_workers: int) -> None:
    slots = [rank_resume(batches, num_workers, w) for w in range(num_workers)]
    assert sorted(s for s, _ in slots) == list(range(num_workers))
    assert sum(skip for _, skip in slots) == batches
    assert slots[0][0] == batches % num_workers  # worker 0 makes the next batch


def test_rank_resume_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        rank_resume(-1, 2, 0)
    with pytest.raises(ValueError):
        rank_resume(3, 2, 2)


def test_check_state_names_the_field() -> None:
    base = {"version": STATE_VERSION, "manifest": "m", "seed": 0, "world_size": 2}
    check_state({**base, "epoch": 1}, base, ("epoch",))
    with pytest.raises(IncompatibleStateError, match="seed") as info:
        check_state({**base, "seed": 1}, base, ())
    assert (info.value.field, info.value.saved, info.value.current) == ("seed", 1, 0)
    with pytest.raises(IncompatibleStateError, match="world_size=4"):
        check_state({**base, "world_size": 4}, base, ())
    with pytest.raises(IncompatibleStateError, match="version"):
        check_state({**base, "version": 1}, base, ())
    with pytest.raises(IncompatibleStateError, match="'epoch' is -1"):
        check_state({**base, "epoch": -1}, base, ("epoch",))
    with pytest.raises(IncompatibleStateError, match="'epoch' is None"):
        check_state(base, base, ("epoch",))
    with pytest.raises(IncompatibleStateError, match="not list"):
        check_state([], base, ())  # type: ignore[arg-type]


def test_shared_progress_counts_epochs_per_slot_and_set_epoch_wins() -> None:
    from loader.torch.epochs import Restored, ResumePoint, SharedProgress

    progress = SharedProgress()
    assert [progress.claim(0), progress.claim(0), progress.claim(None)] == [
        (0, False),
        (1, False),
        (0, False),
    ]
    progress.set_epoch(5)
    assert progress.claim(1) == (5, True) and progress.claim(1) == (6, False)
    assert progress.next_epoch() == 7
    progress.set_resume(ResumePoint(2, 9, 3))
    assert progress.resume_for(2) == ResumePoint(2, 9, 3) and progress.resume_for(3) is None
    progress.set_epoch(4)  # another epoch: the pending resume is dropped
    assert progress.resume_for(2) is None
    # restore reports: every worker at its end of epoch 4 -> complete; one missing -> refused
    for worker, slot in ((0, 1), (1, 0)):
        progress.report_restored(worker, 4, Restored(slot, 3, True, 2))
    assert progress.restored(4, 2) == [Restored(1, 3, True, 2), Restored(0, 3, True, 2)]
    progress.report_restored(1, 4, Restored(0, 2, False, 3))
    assert [r.at_end for r in progress.restored(4, 2)] == [True, False]
    assert progress.restored(4, 2)[1] == Restored(0, 2, False, 3)
    with pytest.raises(RuntimeError, match="not every DataLoader worker"):
        progress.restored(4, 3)
