"""Samples: a worker's windows read in turn and handed out one sample at a time, in each
window's seeded order, with the error policy (``raise`` or ``skip``).

The windows and their orders are planned in ``loader.plan.windows``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from loader.errors import CorruptShardError
from loader.plan.order import SampleRange
from loader.plan.windows import plan_windows, window_order
from loader.read.chunk import Chunk
from loader.read.reader import ShardReader

__all__ = ["ErrorPolicy", "piece_samples", "read_piece", "sample_stream", "shuffled_windows"]

log = logging.getLogger(__name__)


class _Substitute:
    """Stands in for an unreadable piece under ``on_error="skip"``: repeats one good sample."""

    def __init__(self, sample: dict[str, Any], count: int) -> None:
        self._sample = {**sample, "__padded__": True}
        self._count = count

    def __len__(self) -> int:
        return self._count

    def sample(self, j: int) -> dict[str, Any]:
        return dict(self._sample)


class ErrorPolicy:
    """``raise`` (default) or ``skip``: replace unreadable samples, capped by consecutive failures.

    Skipped samples are replaced by a repeat of a readable one flagged
    ``__padded__``, so every rank still yields exactly the same count. A
    failure is an unreadable range (missing or truncated shard, undecodable
    zstd frame) or one sample that fails its checksum.
    """

    def __init__(self, mode: str, max_consecutive: int) -> None:
        if mode not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', not {mode!r}")
        self.skip = mode == "skip"
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.last_good: dict[str, Any] | None = None
        self.given: dict[str, Any] | None = None  # the last stand-in handed out for one sample
        self.last_error: CorruptShardError | None = None

    def failed(
        self, err: CorruptShardError, count: int, in_a_row: bool = True, note: str = ""
    ) -> None:
        """Record that ``count`` samples are unreadable because of ``err`` (warned, with ``note``).

        ``in_a_row``: no readable sample came out since the previous failure.

        Raises:
            CorruptShardError: ``err`` itself when not skipping, or a new one
                after more than ``max_consecutive`` failures in a row.
        """
        if not self.skip:
            raise err
        self.consecutive = self.consecutive + 1 if in_a_row else 1
        self.last_error = err
        log.warning("skipping %d sample(s)%s: %s", count, note, err)
        if self.consecutive > self.max_consecutive:
            raise CorruptShardError.at(
                err.shard,
                err.key,
                err.offset,
                f"{self.consecutive} consecutive unreadable ranges or samples; giving up",
            ) from err

    def substitute(self) -> dict[str, Any]:
        """A flagged repeat of the last readable sample.

        Raises:
            CorruptShardError: no sample was readable yet.
        """
        if self.last_good is None:
            raise CorruptShardError.at(
                "?", "?", 0, "no readable sample to stand in for skipped ones"
            )
        return {**self.last_good, "__padded__": True}


def read_piece(
    reader: ShardReader, piece: SampleRange, policy: ErrorPolicy, note: str = ""
) -> Chunk | None:
    """``reader.read(piece)``; ``None`` when the range is unreadable and ``policy`` skips it.

    Raises:
        CorruptShardError: the range is unreadable and the policy does not skip (or gives up).
    """
    try:
        chunk = reader.read(piece)
    except CorruptShardError as err:
        policy.failed(err, len(piece), note=note)
        return None
    policy.consecutive = 0
    return chunk


def piece_samples(
    pieces: Iterable[SampleRange], reader: ShardReader, policy: ErrorPolicy, note: str = ""
) -> Iterator[dict[str, Any]]:
    """The readable samples of ``pieces``, each piece read whole, in order (a mixture's batch).

    An unreadable range, or a sample failing its checksum, raises; under
    ``on_error="skip"`` it is left out with the policy's warning (naming the
    shard and the sample key, then ``note``): no stand-in, so fewer samples come out.
    """
    for piece in pieces:
        chunk = read_piece(reader, piece, policy, note)
        if chunk is None:
            continue
        for j in range(len(chunk)):
            try:
                sample = chunk.sample(j)
            except CorruptShardError as err:
                policy.failed(err, 1, note=note)
                continue
            policy.consecutive = 0
            yield sample


def _read_window(
    window: list[SampleRange], reader: ShardReader, policy: ErrorPolicy
) -> list[Chunk | _Substitute]:
    chunks: list[Chunk | _Substitute | SampleRange] = []
    reader.start_window(window)
    for piece in window:
        chunk = read_piece(reader, piece, policy)
        if chunk is None:
            chunks.append(piece)
            continue
        if policy.skip and policy.last_good is None:
            policy.last_good = _first_readable(chunk)
        chunks.append(chunk)
    result: list[Chunk | _Substitute] = []
    for item in chunks:
        if isinstance(item, SampleRange):
            result.append(_Substitute(policy.substitute(), len(item)))
        else:
            result.append(item)
    return result


def _first_readable(chunk: Chunk) -> dict[str, Any] | None:
    """The first sample of ``chunk`` that passes its checksum (a stand-in for skipped ones)."""
    for j in range(len(chunk)):
        try:
            return chunk.sample(j)
        except CorruptShardError:
            continue  # reported when it is handed out
    return None


def shuffled_windows(
    pieces: list[SampleRange],
    reader: ShardReader,
    *,
    shuffle: bool,
    rng_key: tuple[int, ...],
    skip: int,
    max_samples: int,
    max_bytes: int,
    policy: ErrorPolicy,
) -> Iterator[tuple[list[Chunk | _Substitute], npt.NDArray[np.int64]]]:
    """Each window read, with the positions of its samples to emit, in order, after ``skip``.

    Position ``p`` of a window is sample ``p`` of its chunks taken in turn.
    ``rng_key`` is (seed, epoch, rank, worker[, pass]); window ``k`` is emitted in
    ``window_order(rng_key, k, ...)``. Windows wholly inside ``skip`` are not read.
    """
    windows = plan_windows(pieces, reader.sample_sizes, max_samples, max_bytes)
    for number, window in enumerate(windows):
        size = sum(len(p) for p in window)
        if skip >= size:
            skip -= size  # resume: this window was consumed before; do not read it
            continue
        chunks = _read_window(window, reader, policy)
        order = window_order(rng_key, number, size, shuffle)
        yield chunks, order[skip:]
        del chunks  # before the next window is read: one window in memory, not two
        skip = 0


def sample_stream(
    windows: Iterator[tuple[list[Chunk | _Substitute], npt.NDArray[np.int64]]],
    policy: ErrorPolicy,
) -> Iterator[dict[str, Any]]:
    """The samples of ``windows`` (from :func:`shuffled_windows`), one dict each, in order.

    A sample that fails its checksum raises, or under ``on_error="skip"`` is
    replaced by a flagged repeat of a readable one.
    """
    for chunks, order in windows:
        owners = [c for c in chunks for _ in range(len(c))]
        positions = [j for c in chunks for j in range(len(c))]
        del chunks
        sample: dict[str, Any] | None = None
        for p in order.tolist():
            try:
                sample = owners[p].sample(positions[p])
            except CorruptShardError as err:  # this sample fails its checksum
                # ``sample`` is still the one yielded before: a stand-in if that one failed too
                policy.failed(err, 1, in_a_row=sample is not None and sample is policy.given)
                sample = policy.given = policy.substitute()
            yield sample
        # before the next window is read: one window in memory, not two
        del owners
