"""Subprocess entry point: runs ONE measured task and prints its result.

``python -m bench.runner '<json spec>'`` - the driver starts a fresh
interpreter per run so that peak memory is per system and each system pays
its own import cost. The last stdout line is ``@@RESULT@@ <json>``.

Timings taken here (in-process, ``time.perf_counter``):

* ``import_s`` - importing the system's modules (torch included where the
  system imports it); excluded from throughput, reported separately.
* ``build_s`` - the build call only.
* ``ttfb_s``  - dataset + DataLoader construction to the first batch.
* ``epoch_s`` - dataset + DataLoader construction to the end of the epoch
  (worker start-up included).
"""

from __future__ import annotations

import gc
import importlib
import json
import sys
import tarfile
import time
import traceback
from pathlib import Path
from typing import Any

MARK = "@@RESULT@@"


def _own_pss() -> int:
    try:
        with open("/proc/self/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _import_peer(system: str, phase: str) -> tuple[Any, float]:
    """Import the peer module and its libraries for ``phase`` (build|load)."""
    from bench.peers import PEERS

    t = time.perf_counter()
    mod = importlib.import_module(PEERS[system])
    for name in mod.BUILD_IMPORTS if phase == "build" else mod.LOAD_IMPORTS:
        importlib.import_module(name)
    return mod, time.perf_counter() - t


def task_build(spec: dict[str, Any]) -> dict[str, Any]:
    """Build shards from ``spec['raw']`` into ``spec['out']``."""
    mod, import_s = _import_peer(spec["system"], "build")
    meta = json.loads(Path(spec["meta"]).read_text())
    pss0 = _own_pss()
    t = time.perf_counter()
    info = mod.build(spec["raw"], spec["out"], meta, spec["params"])
    build_s = time.perf_counter() - t
    return {"import_s": import_s, "build_s": build_s, "pss_after_import": pss0, **info}


def _epoch(batches: Any, t0: float) -> dict[str, Any]:
    n = nbytes = steps = 0
    ttfb = None
    for batch in batches:
        if ttfb is None:
            ttfb = time.perf_counter() - t0
        steps += 1
        if hasattr(batch, "offsets"):  # shardprep's packed payload column: (data, offsets)
            n += len(batch.offsets) - 1
            nbytes += batch.data.numel()
            continue
        n += len(batch)
        nbytes += sum(len(b) for b in batch)
    return {
        "epoch_s": time.perf_counter() - t0,
        "ttfb_s": ttfb,
        "samples": n,
        "bytes": nbytes,
        "steps": steps,
    }


def task_load(spec: dict[str, Any]) -> dict[str, Any]:
    """One epoch over ``spec['out']`` with the shared collate."""
    from bench.peers.common import collate

    if spec["system"] == "tarfile":
        return task_tarloop(spec)
    mod, import_s = _import_peer(spec["system"], "load")
    t = time.perf_counter()
    for name in spec.get("imports", ()):  # e.g. the object-storage client a remote read uses
        importlib.import_module(name)
    import_s += time.perf_counter() - t
    pss0 = _own_pss()
    gc.collect()  # the imports' garbage, before the timer, for every system (docs/benchmarks.md)
    t0 = time.perf_counter()
    make = mod.batch_loader if spec["params"].get("batches") else mod.loader
    dl = make(spec["out"], spec["batch_size"], spec["num_workers"], collate, spec["params"])
    res = _epoch(dl, t0)
    return {"import_s": import_s, "pss_after_import": pss0, **res}


def task_tarloop(spec: dict[str, Any]) -> dict[str, Any]:
    """Reference reader: stream every tar shard with ``tarfile`` and group
    members into samples by key, batching 64 like the loaders (no torch)."""
    pss0 = _own_pss()
    gc.collect()  # the imports' garbage, before the timer, for every system (docs/benchmarks.md)
    t0 = time.perf_counter()
    shards = sorted(str(p) for p in Path(spec["out"]).glob("*.tar"))

    def samples() -> Any:
        for shard in shards:
            cur_key: str | None = None
            cur: dict[str, bytes] = {}
            with tarfile.open(shard, mode="r|") as tf:
                for m in tf:
                    if not m.isfile():
                        continue
                    key, _, ext = m.name.partition(".")
                    if key != cur_key and cur:
                        yield cur
                        cur = {}
                    cur_key = key
                    f = tf.extractfile(m)
                    cur[ext] = f.read() if f else b""
            if cur:
                yield cur

    def batches() -> Any:
        from bench.peers.common import collate

        buf: list[Any] = []
        for s in samples():
            buf.append(s)
            if len(buf) == spec["batch_size"]:
                yield collate(buf)
                buf = []
        if buf:
            yield collate(buf)

    res = _epoch(batches(), t0)
    return {"import_s": 0.0, "pss_after_import": pss0, **res}


def task_ddp_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of a gloo/CPU DDP run: one epoch, record payload hashes."""
    import torch.distributed as dist

    from bench.peers.common import collate_ident

    rank, world = spec["rank"], spec["world"]
    mod, import_s = _import_peer(spec["system"], "load")
    dist.init_process_group(
        "gloo", init_method=f"file://{spec['init_file']}", rank=rank, world_size=world
    )
    params = dict(spec["params"])
    if spec["system"] == "mds":
        # collective: local rank 0 cleans leaked shm, every rank joins a barrier
        from streaming.base.util import clean_stale_shared_memory

        params["clean_shm"] = False
        clean_stale_shared_memory()
    dist.barrier()
    dl = mod.loader(spec["out"], spec["batch_size"], spec["num_workers"], collate_ident, params)
    try:
        declared = len(getattr(dl, "dataset"))  # noqa: B009 (peers return Any-typed loaders)
    except Exception:
        declared = None
    steps = 0
    ids: list[tuple[str, bool]] = []
    for batch in dl:
        steps += 1
        ids.extend(batch)
    dist.barrier()
    dist.destroy_process_group()
    return {
        "rank": rank,
        "steps": steps,
        "samples": len(ids),
        "len": declared,
        "hashes": [h for h, _ in ids],
        "padded": [p for _, p in ids],
        "import_s": import_s,
    }


def task_get_floor(spec: dict[str, Any]) -> dict[str, Any]:
    """Reference for remote reads: whole-object GETs of ``spec['urls']``, ``spec['concurrency']``
    at a time, through s3fs (one GET each), bytes discarded."""
    from concurrent.futures import ThreadPoolExecutor

    t = time.perf_counter()
    if spec.get("client") == "obstore":  # the same GETs in Rust (loader.io.obstore_backend's store)
        import obstore

        from loader.io.obstore_backend import ObstoreBackend

        store, _ = ObstoreBackend("s3", spec["storage_options"], 10, 30)._store("s3://bench/x")

        def get(url: str) -> int:
            return len(obstore.get(store, url.split("/", 1)[1]).bytes())

    else:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **spec["storage_options"])

        def get(url: str) -> int:
            return len(fs.cat_file(url))

    import_s = time.perf_counter() - t
    t0 = time.perf_counter()
    with ThreadPoolExecutor(spec["concurrency"]) as pool:
        sizes = list(pool.map(get, spec["urls"]))
    return {
        "import_s": import_s,
        "epoch_s": time.perf_counter() - t0,
        "ttfb_s": None,
        "samples": spec["samples"],
        "bytes": spec["payload_bytes"],
        "object_bytes": sum(sizes),
    }


TASKS = {
    "build": task_build,
    "load": task_load,
    "ddp_rank": task_ddp_rank,
    "get_floor": task_get_floor,
}


def main() -> int:
    spec = json.loads(sys.argv[1])
    if spec.get("watchdog_s"):  # dump every thread's stack, then exit, if hung
        import faulthandler

        faulthandler.dump_traceback_later(spec["watchdog_s"], exit=True)
    try:
        res = TASKS[spec["task"]](spec)
        rc = 0
    except BaseException as e:  # report, never hang the driver
        traceback.print_exc()
        res = {"error": f"{type(e).__name__}: {e}"[:300]}
        rc = 1
    if spec.get("result_file"):
        Path(spec["result_file"]).write_text(json.dumps(res))
    else:
        print(MARK, json.dumps(res), flush=True)
    sys.stdout.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
