"""The worker ring's arithmetic (``loader.torch.arena.ring_slot``), simulated: a payload never
overlaps a payload the receiving process still holds, never wraps, and with the default
``BATCHES`` a DataLoader with ``prefetch_factor=2`` (a worker writes batch k while k - 1 is
in flight and k - 2 is held by the consumer) always finds room for batches up to 1/4 larger
than the ring's first one."""

from __future__ import annotations

from collections import deque

from hypothesis import given
from hypothesis import strategies as st

from loader.torch import arena
from loader.torch.arena import ring_slot


def _run(first: int, sizes: list[int], held: int, batches: int) -> int:
    """Write a payload of each size into a ring of ``batches`` first batches, the consumer
    keeping the last ``held`` of them; return how many did not fit (fresh shared memory).
    Every payload's bytes are checked intact when it is released."""
    capacity = batches * first
    ring = bytearray(capacity)
    allocated = released = misses = 0
    live: deque[tuple[int, int, int, bytes]] = deque()  # begin, size, consumed, expected bytes
    for number, size in enumerate([first, *sizes]):
        while len(live) > held:  # released oldest first, as loader.torch.arena._Ring does
            begin, length, consumed, expected = live.popleft()
            assert bytes(ring[begin : begin + length]) == expected
            released += consumed
        slot = ring_slot(allocated, released, capacity, size)
        if slot is None:
            misses += 1
            continue
        begin, consumed = slot
        assert begin >= 0 and begin + size <= capacity and consumed >= size  # never wraps
        payload = bytes([number % 251]) * size
        ring[begin : begin + size] = payload
        allocated += consumed
        live.append((begin, size, consumed, payload))
    for begin, length, _, expected in live:
        assert bytes(ring[begin : begin + length]) == expected
    return misses


@given(
    first=st.integers(1_000, 100_000),
    growth=st.lists(st.floats(0.8, 1.25), min_size=1, max_size=60),
)
def test_default_ring_holds_prefetched_batches_up_to_a_quarter_larger(
    first: int, growth: list[float]
) -> None:
    sizes = [int(first * g) for g in growth]
    assert _run(first, sizes, held=2, batches=arena.BATCHES) == 0


def test_four_batches_are_not_enough_for_batches_larger_than_the_first() -> None:
    # why BATCHES is 5: after a wrap, three 1.2x batches and the tail's padding need more
    assert _run(100, [120] * 12, held=2, batches=4) > 0
    assert _run(100, [120] * 12, held=2, batches=5) == 0


@given(
    first=st.integers(1, 12),
    sizes=st.lists(st.integers(1, 40), max_size=80),
    held=st.integers(0, 6),
    batches=st.integers(1, 6),
)
def test_payloads_never_overlap_held_ones(
    first: int, sizes: list[int], held: int, batches: int
) -> None:
    _run(first, sizes, held, batches)  # any sizes, any consumer: misses allowed, overlaps not


def test_a_payload_that_fits_exactly_is_placed_and_one_byte_more_is_not() -> None:
    assert ring_slot(allocated=30, released=10, capacity=30, size=10) == (0, 10)
    assert ring_slot(allocated=30, released=10, capacity=30, size=11) is None
    # the tail (25-29) is skipped; ring bytes 0-5 were handed out first, and must be released
    assert ring_slot(allocated=25, released=6, capacity=30, size=6) == (0, 11)
    assert ring_slot(allocated=25, released=5, capacity=30, size=6) is None


def test_a_reservation_not_committed_is_given_up() -> None:
    """A batch with a damaged member is not committed: the next reservation gets the same
    bytes, and only committed payloads advance the ring (the receiver releases only those)."""
    ring = arena.Arena()
    first = ring.reserve(1000)
    assert first is not None
    again = ring.reserve(1000)
    assert again is not None and again[:2] == first[:2] == (0, 1000)
    tensor, ticket = ring.commit(0, 1000, 1000)
    assert (ticket.begin, ticket.size, ticket.consumed) == (0, 1000, 1000)
    assert ticket.storage is not None and tensor.numel() == 1000
    following = ring.reserve(500)
    assert following is not None and following[:2] == (1000, 500)
    _, second = ring.commit(1000, 500, 500)
    assert second.storage is None  # the ring itself crosses once, with the first payload


def test_a_withdrawn_commit_gives_its_bytes_back() -> None:
    """A batch whose later field fails its checksum (version 3: checked once every field is
    copied) withdraws the payloads it committed, last first: the next reservation gets the
    same bytes, and the next ticket carries the ring if the withdrawn one did."""
    ring = arena.Arena()
    assert ring.reserve(1000) is not None
    _, first = ring.commit(0, 1000, 1000)
    _, second = ring.commit(1000, 500, 500)
    ring.withdraw(second)
    ring.withdraw(first)
    again = ring.reserve(1000)
    assert again is not None and again[:2] == (0, 1000)
    _, ticket = ring.commit(0, 1000, 1000)
    assert ticket.storage is not None  # the ring crosses with the first ticket that leaves
    _, kept = ring.commit(1000, 500, 500)
    ring.withdraw(kept)
    following = ring.reserve(500)
    assert following is not None and following[:2] == (1000, 500)
