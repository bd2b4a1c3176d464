"""What the always-on epoch counters (``loader.read.telemetry``) cost on an in-process epoch.

    python -m bench.telemetry_overhead OUT [--rounds 7] [--batch 64]

Two measures, in one process:

1. **Interleaved epochs.** Each round runs one in-process epoch
   (``DataLoader(ShardDataset(OUT, batch_size=B), batch_size=None, num_workers=0)``) with the
   counters on and one with every per-batch and per-read count taken out (the timed wrappers
   replaced by what they wrap: ``EpochStream.__next__``, ``ShardReader.read``, the gathered
   batches' timing, ``Batch.__reduce__``), in alternating order, after one warm-up epoch of
   each. Reported: CPU seconds (``time.process_time``: every thread of the process) per
   epoch, the median of each, and the median of the per-round ratios.
2. **The counting itself.** The exact operations the counters add per batch on that path (two
   clock reads and their additions in ``EpochStream``, two in the gathered-batch timing, a
   sample and batch count), timed in a loop of 1e6, as nanoseconds per batch, against the
   epoch's CPU time per batch: an upper bound that a loaded machine's noise does not hide.

On ``small`` (~1 KiB samples: the per-batch overhead is the largest share there).
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def _counters_off() -> Iterator[None]:
    """Every per-batch and per-read count of the in-process gathered path taken out."""
    import loader.core as core
    from loader.read.reader import ShardReader
    from loader.torch.batch import Batch
    from loader.torch.stream import EpochStream

    saved = (
        EpochStream.__next__,
        ShardReader.read,
        core._timed_gather,
        Batch.__reduce__,
    )

    def plain(batches: Iterator[Any], clock: Any) -> Iterator[Any]:
        return batches

    EpochStream.__next__ = EpochStream._next  # type: ignore[method-assign]
    ShardReader.read = ShardReader._read  # type: ignore[method-assign]
    core._timed_gather = plain
    Batch.__reduce__ = Batch._reduce  # type: ignore[method-assign]
    try:
        yield
    finally:
        (EpochStream.__next__, ShardReader.read, core._timed_gather, Batch.__reduce__) = saved  # type: ignore[method-assign]


def _epoch(out: str, batch: int) -> tuple[float, int, int]:
    """(CPU seconds, samples, batches) of one in-process epoch."""
    import torch.utils.data

    from loader import ShardDataset

    ds = ShardDataset(out, seed=0, batch_size=batch)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
    began = time.process_time()
    samples = batches = 0
    for b in dl:
        samples += len(b["__key__"])
        batches += 1
    return time.process_time() - began, samples, batches


def _per_batch_ns() -> float:
    """The counters' own operations for one batch of the in-process gathered path, in ns."""
    import numpy as np

    from loader.read.telemetry import ASSEMBLE, READ, ROW, Clock, LoopClock

    row = np.zeros(ROW, np.int64)
    clock, loop = Clock(row), LoopClock(row)
    perf = time.perf_counter_ns

    from loader.read.telemetry import BATCHES, COMPUTE, FIRST, SAMPLES, STAGE0, WAIT

    cells, at_read, at_assemble = clock.cells, STAGE0 + READ, STAGE0 + ASSEMBLE

    def one() -> None:
        asked = perf()  # EpochStream.__next__, inline
        if loop.last:
            cells[COMPUTE] += asked - loop.last
        began, read = perf(), cells[at_read]  # _timed_gather, inline
        cells[at_assemble] += perf() - began - (cells[at_read] - read)
        cells[SAMPLES] += 64
        cells[BATCHES] += 1
        now = perf()
        cells[WAIT] += now - asked
        if not loop.last:
            cells[FIRST] = now - loop.started
        loop.last = now

    number = 1_000_000
    return min(timeit.repeat(one, number=number, repeat=3)) / number * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.telemetry_overhead", description=__doc__)
    parser.add_argument("out", help="a shardprep build (e.g. small-200000)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    for _ in range(2):  # warm-up: page cache, imports, allocator
        _epoch(args.out, args.batch)
        with _counters_off():
            _epoch(args.out, args.batch)
    on: list[float] = []
    off: list[float] = []
    batches = 0
    for r in range(args.rounds):
        for counted in (r % 2 == 0, r % 2 == 1):
            if counted:
                cpu, _, batches = _epoch(args.out, args.batch)
                on.append(cpu)
            else:
                with _counters_off():
                    cpu, _, batches = _epoch(args.out, args.batch)
                off.append(cpu)
        print(f"round {r}: on {on[-1]:.3f} s, off {off[-1]:.3f} s CPU", flush=True)
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    print(
        f"in-process epoch, {batches} batches of {args.batch}: CPU s median on "
        f"{statistics.median(on):.3f}, off {statistics.median(off):.3f}; on/off per round "
        f"median {statistics.median(ratios):.4f} ({', '.join(f'{x:.3f}' for x in ratios)})"
    )
    ns = _per_batch_ns()
    per_batch = statistics.median(off) / batches * 1e9
    print(
        f"the counting per batch: {ns:.0f} ns, against {per_batch / 1e3:.1f} us of CPU per "
        f"batch: {ns / per_batch:.2%} of the epoch"
    )


if __name__ == "__main__":
    main()
