"""loader.io.ranges.BufferPool: a read buffer is reused only once no view of it exists."""

from __future__ import annotations

import mmap
import sys

import pytest

from loader.io.ranges import GRAIN, BufferPool, allocate


def test_a_buffer_is_reused_only_when_nothing_views_it() -> None:
    pool = BufferPool()
    pool.start(3 * GRAIN)
    first = pool.take(100)
    first[:5] = b"first"
    kept = first[1:3]  # a view of a view keeps the buffer too
    del first
    pool.start(3 * GRAIN)  # the next window while a view of the first one is alive
    second = pool.take(100)
    second[:6] = b"second"
    assert bytes(kept) == b"ir"  # not overwritten
    assert len(pool._buffers) == 2
    del kept, second
    pool.start(3 * GRAIN)  # both free now: one is reused, no third is made
    third = pool.take(100)
    assert bytes(third[:6]) in (b"first\0", b"second")
    assert len(pool._buffers) == 2


def test_a_window_larger_than_every_free_buffer_gets_a_new_one() -> None:
    pool = BufferPool()
    pool.start(GRAIN)
    view = pool.take(GRAIN)
    assert len(view) == GRAIN
    del view
    pool.start(4 * GRAIN)
    assert len(pool._buffers) == 1
    assert len(pool._buffers[0]) >= 4 * GRAIN


def test_reads_past_the_estimate_get_a_buffer_of_their_own() -> None:
    pool = BufferPool()
    pool.start(GRAIN)
    a = pool.take(GRAIN)
    b = pool.take(2 * GRAIN)  # more than the window's estimate: a buffer of its own
    a[:1], b[:1] = b"a", b"b"
    assert bytes(a[:1]) == b"a" and bytes(b[:1]) == b"b"
    assert len(b) == 2 * GRAIN


@pytest.mark.skipif(sys.platform != "linux", reason="anonymous mmap buffers on Linux only")
def test_on_linux_buffers_are_private_anonymous_maps() -> None:
    buffer = allocate(GRAIN)
    assert isinstance(buffer, mmap.mmap)
    assert bytes(buffer[:16]) == bytes(16)  # zeroed
    assert allocate(0) == bytearray()
