"""Resume arithmetic: batches consumed → samples consumed per worker slot, against a real DataLoader."""

from __future__ import annotations

import pytest
import torch.utils.data
from hypothesis import given
from hypothesis import strategies as st

from loader.errors import IncompatibleStateError
from loader.state import STATE_VERSION, check_state, consumed_per_slot


class _Tagged(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Worker w yields (w, 0), (w, 1), ... ``counts[w]`` items."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = torch.utils.data.get_worker_info()
        worker = info.id if info else 0
        return iter([(worker, i) for i in range(self.counts[worker])])


def _collate(batch):  # type: ignore[no-untyped-def]
    return batch


@pytest.mark.parametrize("counts", [[5], [7, 6, 6], [3, 3, 2], [1, 0, 0], [40, 39]])
@pytest.mark.parametrize("batch_size", [1, 2, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_matches_real_dataloader(counts: list[int], batch_size: int, drop_last: bool) -> None:
    loader = torch.utils.data.DataLoader(
        _Tagged(counts),
        batch_size=batch_size,
        num_workers=len(counts) if len(counts) > 1 else 0,
        collate_fn=_collate,
        drop_last=drop_last,
    )
    batches = list(loader)
    for k in range(len(batches) + 1):
        delivered = [0] * len(counts)
        for batch in batches[:k]:
            for worker, _ in batch:
                delivered[worker] += 1
        assert consumed_per_slot(k, counts, batch_size, drop_last) == delivered


@given(
    counts=st.lists(st.integers(0, 50), min_size=1, max_size=6),
    batch_size=st.integers(1, 9),
    data=st.data(),
)
def test_consumed_is_monotone_and_ends_at_counts(
    counts: list[int], batch_size: int, data: st.DataObject
) -> None:
    total = sum(-(-c // batch_size) for c in counts)
    k = data.draw(st.integers(0, total))
    now = consumed_per_slot(k, counts, batch_size)
    assert all(0 <= n <= c for n, c in zip(now, counts, strict=True))
    if k < total:
        after = consumed_per_slot(k + 1, counts, batch_size)
        assert sum(after) > sum(now)
    assert consumed_per_slot(total, counts, batch_size) == counts
    with pytest.raises(ValueError, match="only"):
        consumed_per_slot(total + 1, counts, batch_size)


def test_check_state_names_the_field() -> None:
    base = {
        "version": STATE_VERSION,
        "manifest": "m",
        "seed": 0,
        "shuffle": True,
        "uneven": "drop",
        "block_size": 8,
        "shuffle_buffer": 9,
        "shuffle_buffer_bytes": 10,
        "class_weights": None,
        "world_size": 2,
    }
    check_state(base, base)
    with pytest.raises(IncompatibleStateError, match="seed") as info:
        check_state({**base, "seed": 1}, base)
    assert (info.value.field, info.value.saved, info.value.current) == ("seed", 1, 0)
    with pytest.raises(IncompatibleStateError, match="world_size=4"):
        check_state({**base, "world_size": 4}, base)
    with pytest.raises(IncompatibleStateError, match="version"):
        check_state({**base, "version": 99}, base)
