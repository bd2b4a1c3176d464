"""The feeding path measured from inside one process: what docs/benchmarks-feeding.md reports.

    python -m bench.feeding rate    OUT [--epochs 4] [--workers 0] [--samples]
    python -m bench.feeding cpu     OUT [--epochs 3]
    python -m bench.feeding memory  OUT [--samples]
    python -m bench.feeding once    OUT [--workers 0] [--samples]

``OUT`` is a shardprep build (e.g. /tmp/shardprep-bench/built/images-20000/shardprep-w1).
``rate``: samples/s and MB/s per epoch (wall) and samples per CPU-second of this process,
best epoch last; ``cpu``: CPU-seconds per GB of payload of the main process and of each
DataLoader worker (2 workers, persistent), from ``/proc/<pid>/stat``, for the last epoch;
``memory``: peak resident memory beyond ``import torch`` over one in-process epoch;
``once``: one epoch in this fresh process, timed from the dataset's construction (workers
started inside it), as ``python -m bench load`` times it, for quick A/B runs of two trees.
Compare two versions by running the same command with another tree first on ``PYTHONPATH``.
Batch 64, shuffling on, seed 0; the batch path unless ``--samples``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any


def _payload_bytes(batch: Any) -> tuple[int, int]:
    """(samples, payload bytes) of one batch of either path."""
    if isinstance(batch, tuple):  # the per-sample path: (samples, payloads), collated below
        return batch[0], sum(map(len, batch[1]))
    packed = [v for v in batch.values() if hasattr(v, "offsets")]
    return len(batch["__key__"]), sum(int(p.data.numel()) for p in packed)


def _loader(out: str, workers: int, samples: bool, persistent: bool = True) -> tuple[Any, Any]:
    from torch.utils.data import DataLoader

    from loader import ShardDataset

    if samples:
        ds = ShardDataset(out, seed=0)

        def payloads(batch: list[dict[str, Any]]) -> tuple[int, list[bytes]]:
            return len(batch), [v for s in batch for v in s.values() if isinstance(v, bytes)]

        return ds, DataLoader(ds, batch_size=64, num_workers=workers, collate_fn=payloads)
    ds = ShardDataset(out, seed=0, batch_size=64)
    return ds, DataLoader(
        ds, batch_size=None, num_workers=workers, persistent_workers=persistent and workers > 0
    )


def rate(out: str, epochs: int, workers: int, samples: bool) -> None:
    ds, dl = _loader(out, workers, samples)
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        wall, cpu, n, nbytes = time.perf_counter(), time.process_time(), 0, 0
        for batch in dl:
            a, b = _payload_bytes(batch)
            n, nbytes = n + a, nbytes + b
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(
            f"epoch {epoch}: {n / wall:,.0f} samples/s, {nbytes / wall / 1e6:,.0f} MB/s; "
            f"{n / cpu:,.0f} samples per CPU-second of this process"
        )


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu(out: str, epochs: int) -> None:
    ds, dl = _loader(out, 2, False)
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        it = iter(dl)
        pids = [w.pid for w in it._workers]
        before = {p: _cpu_s(p) for p in pids}
        main, nbytes = time.process_time(), 0
        for batch in it:
            nbytes += _payload_bytes(batch)[1]
        main = time.process_time() - main
        workers = sum(_cpu_s(p) - before[p] for p in pids)
        gb = nbytes / 1e9
        print(
            f"epoch {epoch}: main {main / gb:.2f} s/GB, workers {workers / gb:.2f} s/GB, "
            f"total {(main + workers) / gb:.2f} s/GB (2 cores: at most "
            f"{2 / ((main + workers) / gb):.2f} GB/s)"
        )


def once(out: str, workers: int, samples: bool) -> None:
    import torch.utils.data  # noqa: F401  (imports are not timed, as in ``python -m bench load``)

    import loader  # noqa: F401

    t0 = time.perf_counter()
    ds, dl = _loader(out, workers, samples, persistent=False)  # the workers' exit is timed too
    n = nbytes = 0
    ttfb = None
    for batch in dl:
        if ttfb is None:
            ttfb = time.perf_counter() - t0
        a, b = _payload_bytes(batch)
        n, nbytes = n + a, nbytes + b
    wall = time.perf_counter() - t0
    print(
        f"workers {workers}: {n / wall:,.0f} samples/s, {nbytes / wall / 1e6:,.0f} MB/s "
        f"(epoch {wall:.3f} s, first batch {ttfb or 0:.3f} s)"
    )


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return 0.0


def memory(out: str, samples: bool) -> None:
    import torch  # noqa: F401  (the baseline)

    base = _status("VmRSS")
    ds, dl = _loader(out, 0, samples)
    for _ in dl:
        pass
    print(f"peak beyond import torch: {_status('VmHWM') - base:.1f} MiB (one epoch, in process)")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.feeding", description=__doc__)
    parser.add_argument("what", choices=["rate", "cpu", "memory", "once"])
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--samples", action="store_true", help="the per-sample path")
    args = parser.parse_args()
    if args.what == "rate":
        rate(args.out, args.epochs, args.workers, args.samples)
    elif args.what == "cpu":
        cpu(args.out, args.epochs)
    elif args.what == "once":
        once(args.out, args.workers, args.samples)
    else:
        memory(args.out, args.samples)


if __name__ == "__main__":
    main()
