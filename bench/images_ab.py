"""Side-by-side epochs of the ``images`` cell: shardprep, LitData and ``cat``, round-robin.

    python -m bench.images_ab --sp OUT --ld LITDATA_OUT [--base TREE] [--rounds 3]
        [--workers 0,2] [--litdata-python /tmp/parquet-bench-venv/bin/python]

Each round runs every system once per worker count, in an order rotated from round to round,
each epoch in a fresh subprocess: torch, the library and the dataset's imports are done, and
``gc.collect()`` run (the collection the imports owe: not inside any system's epoch), before
the timer starts; the timer covers making the dataset and DataLoader and one full epoch
(batch 64, shuffle on, seed 0; with workers, their start and exit). Right before each run the
system's own files are read to ``/dev/null`` (``cat``), so every system starts with its files in
the page cache (``cat`` of the shardprep shards, timed, is the floor). Per run: MB/s of payload,
CPU-seconds per GB (the process and its reaped children: ``os.times``, steadier than wall time on
a shared machine), the 1-minute load average and ``MemAvailable`` before it, and the CPU the
rest of the VM used and the hypervisor's steal while it ran (``/proc/stat``). ``--base TREE``
adds ``shardprep-base``: the same epoch with ``TREE`` first on ``PYTHONPATH`` (an older
checkout, for before/after in one run). ``--memory OUT``: peak memory of one in-process epoch
beyond ``import torch``, as anonymous memory and mapped file pages
(``SHARDPREP_MMAP=0`` for the ``read()`` path). shardprep runs the batch path
(``ShardDataset(batch_size=64)``, ``DataLoader(batch_size=None)``), LitData its
``StreamingDataset`` + ``StreamingDataLoader`` with the shared bytes collate
(``bench.peers.litdata_``), as ``python -m bench load`` does.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _files(out: str) -> list[str]:
    return sorted(
        os.path.join(out, n) for n in os.listdir(out) if os.path.isfile(os.path.join(out, n))
    )


def _mem_available_mib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _warm(out: str) -> float:
    """Read every file of ``out`` to /dev/null with ``cat``; the seconds it took."""
    t = time.perf_counter()
    subprocess.run(["cat", *_files(out)], stdout=subprocess.DEVNULL, check=True, timeout=300)
    return time.perf_counter() - t


def child(system: str, out: str, workers: int) -> None:
    """One epoch in this process, imports before the timer; prints one JSON line."""
    import torch  # noqa: F401
    import torch.utils.data  # noqa: F401

    if system.startswith("shardprep"):
        from torch.utils.data import DataLoader

        from loader import ShardDataset  # (lazy in ``loader``: imported here, untimed)
    else:
        import cloudpickle  # noqa: F401  (LitData imports these two inside its first epoch)
        import litdata  # noqa: F401
        import pyarrow  # noqa: F401

        from bench.peers import litdata_
        from bench.peers.common import collate
    gc.collect()  # the imports' garbage, before the timer, for every system (docs/benchmarks.md)
    t0, c0 = time.perf_counter(), os.times()
    n = nbytes = 0
    if system.startswith("shardprep"):
        ds = ShardDataset(out, seed=0, batch_size=64)
        for batch in DataLoader(ds, batch_size=None, num_workers=workers):
            packed = batch["jpg"]
            n += len(batch["__key__"])
            nbytes += int(packed.data.numel())
    else:
        for batch in litdata_.loader(out, 64, workers, collate, {}):
            n += len(batch)
            nbytes += sum(map(len, batch))
    wall, c1 = time.perf_counter() - t0, os.times()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    cpu += (c1.children_user - c0.children_user) + (c1.children_system - c0.children_system)
    print(json.dumps({"samples": n, "bytes": nbytes, "wall": wall, "cpu": cpu}))


def _rss() -> dict[str, float]:
    """This process's RssAnon, RssFile (mapped file pages) and VmRSS, in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name = line.split(":", 1)[0]
            if name in ("RssAnon", "RssFile", "RssShmem", "VmRSS", "VmHWM"):
                out[name] = int(line.split()[1]) / 1024
    return out


def memory(out: str) -> None:
    """Peak resident memory of one in-process epoch beyond ``import torch``, split into
    anonymous memory and mapped file pages (sampled every 2 ms by a thread; VmHWM is the
    kernel's own peak of their sum)."""
    import threading

    import torch  # noqa: F401  (the baseline, as ``python -m bench.feeding memory``)
    from torch.utils.data import DataLoader

    from loader import ShardDataset

    base = _rss()
    peak = dict(base)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            for name, value in _rss().items():
                peak[name] = max(peak[name], value)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for _ in DataLoader(ShardDataset(out, seed=0, batch_size=64), batch_size=None):
        pass
    done.set()
    sampler.join()
    print(
        f"beyond import torch (MiB): VmHWM {_rss()['VmHWM'] - base['VmRSS']:.1f}, peaks sampled: "
        + ", ".join(f"{k} {peak[k] - base[k]:.1f}" for k in ("RssAnon", "RssFile", "RssShmem"))
        + f" (SHARDPREP_MMAP={os.environ.get('SHARDPREP_MMAP', '1')})"
    )


def _cpu_jiffies() -> tuple[int, int]:
    """The machine's busy CPU time (user, nice, system, irq, softirq, steal) and its steal time
    alone, in clock ticks since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, f.readline().split()[1:9]
        )
    return user + nice + system + irq + softirq + steal, steal


def _run(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    """One child's epoch; with ``others``: the CPU-seconds the rest of the machine was busy
    while the child ran (the machine's busy time less the child's and its workers' own), and
    ``steal``: the time the hypervisor ran something else on this VM's CPUs (``/proc/stat``,
    10 ms ticks: a disturbed round shows, not its cause)."""
    busy0, steal0 = _cpu_jiffies()
    t0 = os.times()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    t1 = os.times()
    busy1, steal1 = _cpu_jiffies()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    tick = os.sysconf("SC_CLK_TCK")
    result["steal"] = (steal1 - steal0) / tick
    own = (t1.children_user - t0.children_user) + (t1.children_system - t0.children_system)
    result["others"] = max((busy1 - busy0) / tick - own, 0.0)  # the child's whole run, imports too
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.images_ab", description=__doc__)
    parser.add_argument("--sp", help="the shardprep build (uncompressed)")
    parser.add_argument("--ld", help="the LitData build of the same tree")
    parser.add_argument("--base", help="an older checkout: adds 'shardprep-base'")
    parser.add_argument("--tree", help="the checkout 'shardprep' runs (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--litdata-python", default="/tmp/parquet-bench-venv/bin/python")
    parser.add_argument("--only", default="", help="comma-separated systems to run")
    parser.add_argument("--child", nargs=3, metavar=("SYSTEM", "OUT", "WORKERS"))
    parser.add_argument("--memory", metavar="OUT", help="peak memory of one epoch of OUT")
    args = parser.parse_args()
    if args.memory:
        memory(args.memory)
        return
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    if not (args.sp and args.ld):
        parser.error("--sp and --ld are required")
    env = dict(os.environ)
    systems: list[tuple[str, str, list[str], dict[str, str]]] = []
    # run by path, not ``-m``: ``-m`` puts the working directory (this checkout) first on
    # ``sys.path``, ahead of PYTHONPATH, so ``--base`` would silently import this loader
    me = [sys.executable, os.path.join(HERE, "bench", "images_ab.py"), "--child"]
    path = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH", "")) if p)
    tree = os.pathsep.join([args.tree, HERE]) if args.tree else path
    systems.append(("shardprep", args.sp, me, {**env, "PYTHONPATH": tree}))
    if args.base:
        base = os.pathsep.join([args.base, HERE])  # the older loader, this bench
        systems.append(("shardprep-base", args.sp, me, {**env, "PYTHONPATH": base}))
    ld = [args.litdata_python, "-m", "bench.images_ab", "--child"]
    systems.append(("litdata", args.ld, ld, {**env, "PYTHONPATH": path}))
    if args.only:
        keep = set(args.only.split(","))
        systems = [s for s in systems if s[0] in keep]
    counts = [int(w) for w in args.workers.split(",")]
    results: dict[str, list[dict[str, Any]]] = {}
    print(f"load average at start: {os.getloadavg()}; MemAvailable {_mem_available_mib():.0f} MiB")
    for r in range(args.rounds):
        size = sum(os.path.getsize(f) for f in _files(args.sp))
        cat_s = min(_warm(args.sp), _warm(args.sp))  # the second is the warm one
        results.setdefault("cat", []).append(
            {"mbps": size / cat_s / 1e6, "cpu_gb": float("nan"), "load": os.getloadavg()[0]}
        )
        runs = [(s, w) for s in systems for w in counts]
        shift = r % len(runs)
        for (name, out, cmd, e), w in runs[shift:] + runs[:shift]:
            _warm(out)
            load, avail = os.getloadavg()[0], _mem_available_mib()
            got = _run([*cmd, name, out, str(w)], e)
            row = {
                "mbps": got["bytes"] / got["wall"] / 1e6,
                "cpu_gb": got["cpu"] / (got["bytes"] / 1e9),
                "load": load,
                "avail": avail,
                "samples": got["samples"],
            }
            results.setdefault(f"{name} w{w}", []).append(row)
            print(
                f"round {r} {name} w{w}: {row['mbps']:,.0f} MB/s, {row['cpu_gb']:.2f} CPU-s/GB, "
                f"load {load:.2f}, MemAvailable {avail:.0f} MiB, {got['samples']} samples; "
                f"others' CPU {got['others']:.2f} s, steal {got['steal']:.2f} s",
                flush=True,
            )
        print(f"round {r} cat: {results['cat'][-1]['mbps']:,.0f} MB/s", flush=True)
    print(f"\nload average at end: {os.getloadavg()}")
    print(f"{'system':<20} {'median MB/s':>12} {'min-max MB/s':>16} {'CPU-s/GB (median)':>18}")
    for name, rows in results.items():
        mbps = [x["mbps"] for x in rows]
        cpu = [x["cpu_gb"] for x in rows]
        print(
            f"{name:<20} {statistics.median(mbps):>12,.0f} "
            f"{min(mbps):>7,.0f}-{max(mbps):<8,.0f} {statistics.median(cpu):>18.2f}"
        )
    print("command: " + " ".join([sys.executable, "-m", "bench.images_ab", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
