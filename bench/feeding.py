"""The feeding path measured from inside one process: what docs/benchmarks-feeding.md reports.

    python -m bench.feeding rate    OUT [--epochs 4] [--workers 0] [--samples]
    python -m bench.feeding cpu     OUT [--epochs 3]
    python -m bench.feeding memory  OUT [--samples]
    python -m bench.feeding once    OUT [--workers 0] [--samples]
    python -m bench.feeding bandwidth   [--workers 2]
    python -m bench.feeding floor       [--items 313] [--workers 2]
    python -m bench.feeding threads OUT [--epochs 3]

``OUT`` is a shardprep build (e.g. /tmp/shardprep-bench/built/images-20000/shardprep-w1).
``rate``: samples/s and MB/s per epoch (wall) and samples per CPU-second of this process,
best epoch last; ``cpu``: CPU-seconds per GB of payload of the main process and of each
DataLoader worker (2 workers, persistent), from ``/proc/<pid>/stat``, for the last epoch;
``memory``: peak resident memory beyond ``import torch`` over one in-process epoch;
``once``: one epoch in this fresh process, timed from the dataset's construction (workers
started inside it), as ``python -m bench load`` times it, for quick A/B runs of two trees;
it also splits the epoch into its fixed costs (the first batch; the workers' exit after the
last) and the rate in between. ``bandwidth``: what this machine's memory copies, in GB/s,
from one process and from ``--workers`` processes copying at once (64 MiB arrays, larger
than any cache): on a machine where K processes copy no more than one, K workers cannot
deliver more bytes than one process, whatever the loader does. ``floor``: torch's own cost of a
DataLoader epoch of ``--items`` trivial items, in process and with workers (start and exit
included). ``threads``: per thread, the samples read and CPU-seconds spent reading them in an
in-process epoch of the large-sample batch path, beside the iterating thread's CPU in all.
Compare two versions by running the same command with another tree first on ``PYTHONPATH``.
Batch 64, shuffling on, seed 0; the batch path unless ``--samples``.
"""

from __future__ import annotations

import argparse
import gc
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

    from loader import ShardDataset  # noqa: F401  (lazy in ``loader``: imported here, untimed)

    gc.collect()  # the imports' garbage, before the timer, for every system (docs/benchmarks.md)
    t0 = time.perf_counter()
    ds, dl = _loader(out, workers, samples, persistent=False)  # the workers' exit is timed too
    n = nbytes = 0
    first = last = 0.0
    first_bytes = 0
    for batch in dl:
        a, b = _payload_bytes(batch)
        last = time.perf_counter() - t0
        if not n:
            first, first_bytes = last, b
        n, nbytes = n + a, nbytes + b
    wall = time.perf_counter() - t0
    between = (nbytes - first_bytes) / max(last - first, 1e-9)
    print(
        f"workers {workers}: {n / wall:,.0f} samples/s, {nbytes / wall / 1e6:,.0f} MB/s "
        f"(epoch {wall:.3f} s: first batch {first * 1e3:.1f} ms, then {between / 1e6:,.0f} MB/s, "
        f"{(wall - last) * 1e3:.1f} ms after the last batch)"
    )


def floor(items: int, workers: int, rounds: int = 3) -> None:
    """torch's own cost of a DataLoader epoch: a trivial dataset yielding ``items`` tiny dicts
    (``batch_size=None``), in process and through ``workers`` workers, their start and exit
    included; what any loader's epoch pays on top of its own work."""
    import torch.utils.data
    from torch.utils.data import DataLoader, IterableDataset

    class Trivial(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            info = torch.utils.data.get_worker_info()
            worker, count = (info.id, info.num_workers) if info else (0, 1)
            return ({"i": i} for i in range(worker, items, count))

    for _ in range(rounds):
        for w in sorted({0, workers}):
            t, c = time.perf_counter(), os.times()
            n = sum(1 for _ in DataLoader(Trivial(), batch_size=None, num_workers=w))
            wall, c1 = time.perf_counter() - t, os.times()
            cpu = c1.user - c.user + c1.system - c.system + c1.children_user - c.children_user
            cpu += c1.children_system - c.children_system
            print(f"workers {w}: {n} items in {wall * 1e3:.1f} ms, {cpu:.3f} CPU-s")


def threads(out: str, epochs: int) -> None:
    """Where the reads of an in-process epoch of the large-sample batch path go
    (``loader.torch.scatter``): per thread, the samples it read and the CPU-seconds it spent reading
    them, beside the iterating thread's CPU-seconds in all."""
    import collections
    import threading

    import loader.torch.scatter as scatter

    counts: collections.Counter[str] = collections.Counter()
    spent: collections.defaultdict[str, float] = collections.defaultdict(float)
    real = scatter._read_checked

    def counted(reads: Any, claim: Any) -> bool:
        name = threading.current_thread().name

        def each() -> Any:
            for i in claim:
                counts[name] += 1
                yield i

        start = time.thread_time()
        try:
            return real(reads, each())
        finally:
            spent[name] += time.thread_time() - start

    scatter._read_checked = counted
    ds, dl = _loader(out, 0, False)
    for epoch in range(epochs):
        counts.clear()
        spent.clear()
        t, c = time.perf_counter(), time.thread_time()
        for _ in dl:
            pass
        wall, mine = time.perf_counter() - t, time.thread_time() - c
        split = ", ".join(f"{k}: {counts[k]} samples, {spent[k]:.3f} CPU-s" for k in counts)
        print(f"epoch {epoch}: {wall:.3f} s; iterating thread {mine:.3f} CPU-s in all; {split}")


def _copy_rate(barrier: Any, results: Any, size: int, rounds: int) -> None:
    import numpy as np

    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # page faults out of the timing
    barrier.wait()
    t = time.perf_counter()
    for _ in range(rounds):
        np.copyto(dst, src)
    results.put(size * rounds / (time.perf_counter() - t))


def bandwidth(workers: int, size: int = 64 << 20, rounds: int = 40) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    for k in sorted({1, workers}):
        barrier, results = ctx.Barrier(k), ctx.Queue()
        procs = [
            ctx.Process(target=_copy_rate, args=(barrier, results, size, rounds)) for _ in range(k)
        ]
        for p in procs:
            p.start()
        try:
            rates = [results.get(timeout=120) for _ in procs]
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        print(
            f"{k} process{'es' if k > 1 else ''} copying at once: {sum(rates) / 1e9:.1f} GB/s "
            f"in all ({', '.join(f'{r / 1e9:.1f}' for r in rates)})"
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
    parser.add_argument(
        "what", choices=["rate", "cpu", "memory", "once", "bandwidth", "floor", "threads"]
    )
    parser.add_argument("--items", type=int, default=313, help="floor: items per epoch")
    parser.add_argument("out", nargs="?", help="a shardprep build (all but bandwidth)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--samples", action="store_true", help="the per-sample path")
    args = parser.parse_args()
    if args.what == "bandwidth":
        bandwidth(max(args.workers, 2))
        return
    if args.what == "floor":
        floor(args.items, max(args.workers, 2))
        return
    if args.out is None:
        parser.error(f"{args.what} needs OUT, a shardprep build")
    if args.what == "rate":
        rate(args.out, args.epochs, args.workers, args.samples)
    elif args.what == "cpu":
        cpu(args.out, args.epochs)
    elif args.what == "once":
        once(args.out, args.workers, args.samples)
    elif args.what == "threads":
        threads(args.out, args.epochs)
    else:
        memory(args.out, args.samples)


if __name__ == "__main__":
    main()
