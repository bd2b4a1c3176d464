"""Arena: a DataLoader worker's reusable shared-memory ring for batch payloads.

A large payload tensor made fresh in shared memory for every batch (what
``default_collate`` does) costs more kernel time than the batch's bytes: a new
segment, a zero-filled page fault per 4 KiB in the worker, its file
descriptor passed over a socket, a mapping in the main process, and the
unmapping on both sides afterwards. Measured here on the ``images`` benchmark
with 2 workers, that was 1.2 CPU-seconds per GB of kernel time in the workers
against 0.5 of user time.

Instead each worker owns one shared-memory ring (made once, at its first large
batch, holding a few batches) and writes each batch's packed payloads into it.
The first batch from a ring carries the ring itself (its file descriptor,
once); every later one carries only ``(offset, size)``. In the main process the
payload arrives as a tensor over the ring's bytes, without a copy. When that
tensor and every view of it are freed (``pin_memory`` frees it at once, having
copied it), its bytes are released: the oldest payloads of a ring first, so a
payload freed early waits for the older ones, and the ring's ``released``
counter, which the worker reads before writing again, only ever covers bytes
nobody holds. Nothing ever waits: a batch that does not fit in the free part
of the ring (a consumer keeping many batches, say) is made in fresh shared
memory as before.

The main process keeps the rings it receives in a table (``_received``), the
one piece of process-wide state here: an unpickling function has no other
place to find them. Each entry names the worker's process id; whenever a new
ring arrives, the rings of workers that have exited are dropped, so the table
holds one ring per live worker (several DataLoaders at once included).

On Linux the ring is a ``memfd`` (``os.memfd_create``) that torch wraps as a shared
storage: its pages are allocated as they are first written. torch's own shared storage
(``UntypedStorage._new_shared``) allocates every page of the segment up front, 0.3 ms per MiB
here: 6 ms for the ``images`` benchmark's ring, on the way to every worker's first batch. A
``memfd`` also lies outside ``/dev/shm``, so a container's small ``/dev/shm`` does not limit it;
memory it cannot get is the out-of-memory handling of any allocation. The counter of released
bytes lives in the ring's first page, so the first batch carries one file descriptor, not two.

The hand-over relies on the processor not making the main process's counter
update visible before the reads of the freed payload: true on x86-64 (total store order),
not promised on ARM. ``RINGS`` is therefore False elsewhere, and batches are
made in fresh shared memory there, as before.
"""

from __future__ import annotations

import os
import platform
import threading
import uuid
import weakref
from collections import deque
from typing import Any

import numpy as np
import torch

__all__ = ["ALIGN", "RINGS", "Arena", "Ticket", "fresh_shared", "receive_bytes", "ring_slot"]

RINGS = platform.machine().lower() in ("x86_64", "amd64")
MIN_BYTES = 8 << 20  # a ring holds at least this much
# ... and at least this many batches the size of its first one. With the DataLoader's default
# prefetch_factor of 2, a worker writes batch k while k - 1 is in flight and k - 2 may still be
# held by the consumer: 3 batches, plus up to one more of padding where the ring wraps. 4 would
# do for batches of one size; the fifth leaves room for batches up to 1/4 larger than the
# first (tests/unit/test_arena_ring.py). A payload that does not fit crosses in fresh shared
# memory, 13-16x the cost of the ring on the `images` benchmark (docs/benchmarks-feeding.md).
BATCHES = 5
# The ring's first bytes hold its counter (see _counter); payloads start a page further, so
# the counter the receiving process writes never shares a cache line with payload bytes.
HEADER = 4096
MEMFD = hasattr(os, "memfd_create")  # and torch's sharing strategy passes file descriptors
ALIGN = 8  # every array ``Arena.place`` writes starts at a multiple of this in the ring


# Where one array lies in a slot of a ring: (byte offset, NumPy dtype string, element count).
# A plain tuple: it is pickled with every small batch.
Place = tuple[int, str, int]


_NAMES: dict[np.dtype[Any], str] = {}  # each dtype's ``str``, worked out once


class Ticket:
    """Where one payload tensor lies in a worker's ring; unpickled, it is a copy of those bytes."""

    __slots__ = ("begin", "consumed", "owner", "ring", "size", "storage")

    def __init__(
        self,
        owner: int,
        ring: str,
        begin: int,
        size: int,
        consumed: int,
        storage: torch.Tensor | None,
    ) -> None:
        self.owner, self.ring = owner, ring
        self.begin, self.size, self.consumed = begin, size, consumed
        self.storage = storage  # the whole ring (counter included), in its first ticket only

    def __reduce__(self) -> tuple[Any, ...]:
        return (_receive, self.fields())

    def fields(self) -> tuple[Any, ...]:
        """What crosses: the arguments of ``receive_bytes`` in the receiving process."""
        return (self.owner, self.ring, self.begin, self.size, self.consumed, self.storage)


class Arena:
    """A worker's ring; a packed payload is written into a reserved slot, then committed."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.ring = uuid.uuid4().hex
        self._data: torch.Tensor | None = None
        self._view: memoryview | None = None
        self._allocated = 0  # bytes handed out so far, padding included
        self._announced = False

    def reserve(self, size: int) -> tuple[int, int, memoryview] | None:
        """Room for a payload of ``size`` bytes: (offset, bytes consumed, a writable view).

        None if the ring has no such room free. The caller writes the payload
        into the view and then commits it (:meth:`commit`); a reservation not committed
        (a member failed its checksum) is given up, and the next one gets the
        same bytes. A worker makes one batch at a time, so nothing reserves in between.
        """
        if self._data is None:
            self._data = _shared_bytes(HEADER + max(MIN_BYTES, BATCHES * size))
            self._view = memoryview(self._data.numpy())[HEADER:]  # type: ignore[arg-type]
            self._counter = _counter(self._data)
        assert self._view is not None
        slot = ring_slot(self._allocated, int(self._counter[0]), len(self._view), size)
        if slot is None:
            return None  # the main process has not released enough yet
        begin, consumed = slot
        return begin, consumed, self._view[begin : begin + size]

    def commit(self, begin: int, consumed: int, size: int) -> tuple[torch.Tensor, Ticket]:
        """Hand out the reserved payload: the tensor over its bytes (valid until the main
        process has received it) and the ticket that crosses instead."""
        ticket = self._commit(begin, consumed, size)
        assert self._data is not None
        return self._data[HEADER + begin : HEADER + begin + size], ticket

    def _commit(self, begin: int, consumed: int, size: int) -> Ticket:
        assert self._data is not None
        self._allocated += consumed
        storage = None if self._announced else self._data
        self._announced = True
        return Ticket(self.owner, self.ring, begin, size, consumed, storage)

    def place(self, arrays: list[np.ndarray[Any, Any]]) -> tuple[Ticket, list[Place]] | None:
        """Write ``arrays`` into one slot of the ring, each starting at a multiple of
        ``ALIGN``, and commit it: the slot's ticket and, per array, where it lies in the slot
        (``Place``: offset, NumPy dtype string, element count; flattened). None if the ring
        has no room (nothing is written then).

        A small batch's arrays (payloads, offsets, keys, flags) cross this way
        (``loader.torch.batch.cross``): one slot, one ticket, a few memory copies.
        """
        flat = [a.reshape(-1) for a in arrays]
        total = 0
        for a in flat:
            total += -(-a.nbytes // ALIGN) * ALIGN
        slot = self.reserve(total + ALIGN)
        if slot is None:
            return None
        begin, consumed, out = slot
        at = -begin % ALIGN  # the ring's payloads start page-aligned: this aligns each array
        places: list[Place] = []
        for a in flat:
            size = a.nbytes
            out[at : at + size] = a.view(np.uint8).data  # one memcpy, no temporary array
            dtype = a.dtype
            name = _NAMES.get(dtype)
            if name is None:
                name = _NAMES[dtype] = dtype.str
            places.append((at, name, a.size))
            at += -(-size // ALIGN) * ALIGN
        return self._commit(begin, consumed, total + ALIGN), places

    def withdraw(self, ticket: Ticket) -> None:
        """Undo the last :meth:`commit` (of ``ticket``, which never left this process: a later
        field of its batch failed its checksum), so that its bytes are free again."""
        self._allocated -= ticket.consumed
        if ticket.storage is not None:
            self._announced = False  # the next ticket carries the ring


def _shared_bytes(size: int) -> torch.Tensor:
    """A zero-filled uint8 tensor of ``size`` bytes in shared memory, its pages made on first use."""
    strategy = torch.multiprocessing.get_sharing_strategy()  # type: ignore[no-untyped-call]
    if MEMFD and strategy == "file_descriptor":
        fd = os.memfd_create("shardprep-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            storage = torch.UntypedStorage._new_shared_fd_cpu(fd, size)  # type: ignore[attr-defined]
        finally:
            os.close(fd)  # the storage holds its own duplicate
    else:
        storage = torch.UntypedStorage._new_shared(size)  # type: ignore[no-untyped-call]
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _counter(data: torch.Tensor) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The ring's count of bytes released by the receiving process: its first 8 bytes."""
    return np.frombuffer(data.numpy(), dtype=np.int64, count=1)


def ring_slot(allocated: int, released: int, capacity: int, size: int) -> tuple[int, int] | None:
    """Where the next payload of ``size`` bytes goes in a ring of ``capacity`` bytes.

    ``allocated``: bytes handed out so far (padding included), ``released``: how many of
    them the receiving process has released (oldest first). Returns the payload's offset and
    the bytes it consumes (itself, plus the ring's tail when it does not fit there: a payload
    never wraps), or None if those bytes are not all released yet.
    """
    start = allocated % capacity
    pad = capacity - start if start + size > capacity else 0
    if allocated + pad + size - released > capacity:
        return None
    return (0 if pad else start), pad + size


class _Lent:
    """One payload lent from a ring: its bytes, whether it is freed, and the weak reference
    whose callback (this object) frees it when the array over the payload goes."""

    __slots__ = ("freed", "ref", "ring", "size")

    def __init__(self, ring: _Ring, size: int) -> None:
        self.ring, self.size, self.freed = ring, size, False
        self.ref: weakref.ref[Any] | None = None

    def __call__(self, _: weakref.ref[Any]) -> None:
        self.ref = None  # (the reference held this object: the cycle ends here)
        self.ring.free(self)


class _Ring:
    """A worker's ring as the receiving process sees it, and which of its bytes are in use."""

    __slots__ = ("counter", "data", "lock", "owner", "pending", "view")

    def __init__(self, owner: int, data: torch.Tensor) -> None:
        self.owner, self.data = owner, data  # kept: it owns the memory
        self.view = memoryview(data.numpy())[HEADER:]  # type: ignore[arg-type]
        self.counter = _counter(data)  # the worker reads it; only this process adds to it
        self.pending: deque[_Lent] = deque()  # payloads lent, oldest first
        self.lock = threading.Lock()  # payloads are freed in any thread, in any order

    def lend(self, begin: int, size: int, consumed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """An array over the payload's bytes in the ring (no copy), released when it is freed."""
        array = np.frombuffer(self.view, dtype=np.uint8, count=size, offset=begin)
        lent = _Lent(self, consumed)
        # The tensor's storage holds ``array``; once no tensor or view of it is left, ``array``
        # goes, the reference calls ``lent`` and its bytes return to the worker. (A weak
        # reference with a callback: ``weakref.finalize`` costs ~3x more per batch.)
        lent.ref = weakref.ref(array, lent)
        self.pending.append(lent)  # (appending is atomic; ``free`` pops under the lock)
        return array

    def free(self, lent: _Lent) -> None:
        """``lent`` is freed; the oldest payloads freed so far go back to the worker."""
        with self.lock:
            lent.freed = True
            pending = self.pending
            while pending and pending[0].freed:  # the worker reuses its oldest bytes first
                self.counter[0] += pending.popleft().size


_received: dict[str, _Ring] = {}
_lock = threading.Lock()  # the pin-memory thread unpickles too


def _receive(
    owner: int,
    ring: str,
    begin: int,
    size: int,
    consumed: int,
    storage: torch.Tensor | None,
) -> torch.Tensor:
    """In the receiving process: the payload, lent from the ring until it is freed."""
    return torch.from_numpy(receive_bytes(owner, ring, begin, size, consumed, storage))


def receive_bytes(
    owner: int,
    ring: str,
    begin: int,
    size: int,
    consumed: int,
    storage: torch.Tensor | None,
) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """In the receiving process: a payload's bytes (a ``Ticket``'s ``fields()``), lent from
    the ring until the array and every view of it are freed."""
    with _lock:
        if storage is not None:
            for stale in [k for k, r in _received.items() if not _alive(r.owner)]:
                del _received[stale]  # its worker has exited: nothing will refer to it again
            _received[ring] = _Ring(owner, storage)
        entry = _received.get(ring)
    if entry is None:
        raise RuntimeError(
            f"a batch refers to shared-memory ring {ring} of DataLoader worker process {owner}, "
            "which this process never received: a batch made in a ShardDataset worker is "
            "unpickled once, by the DataLoader that started the worker"
        )
    return entry.lend(begin, size, consumed)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        return True
    return True


def fresh_shared(size: int) -> tuple[torch.Tensor, memoryview]:
    """A uint8 tensor of ``size`` bytes in fresh shared memory, and a writable view of it: for
    a payload the ring has no room for (it crosses as is, as ``default_collate``'s do)."""
    data = torch.empty(0, dtype=torch.uint8).new(
        torch.UntypedStorage._new_shared(size)  # type: ignore[no-untyped-call]
    )
    return data, memoryview(data.numpy())  # type: ignore[arg-type]
