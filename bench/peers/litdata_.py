"""LitData: ``optimize()`` to build, ``StreamingDataset``/``StreamingDataLoader`` to load.

Notes (checked on litdata 0.2.76):

* ``compression="zstd"`` alone defaults to in-file "batch" framing, which
  needs pyarrow to read back; we pass ``compression_level="chunk"`` (whole
  chunk file compressed), which reads back with the ``zstd`` package only.
* Reading compressed chunks straight from their folder decompresses and
  deletes them in place, so compressed outputs are read through a separate
  ``cache_dir``.
* Samples come back as memoryviews; the shared collate turns them into bytes
  inside the workers (memoryviews cannot be pickled to the main process).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable
from typing import Any

from bench.generate import list_raw
from bench.peers.common import bytes_per_shard

BUILD_IMPORTS = ("litdata",)  # timed as "import s" of a build
LOAD_IMPORTS = ("litdata",)  # timed as "import s" of a load


def _sample(item: tuple[str, int, str]) -> dict[str, Any]:
    """optimize() callback: read one raw file into a sample dict."""
    path, cls, key = item
    with open(path, "rb") as f:
        return {"key": key, "data": f.read(), "cls": cls}


def build(raw: str, out: str, meta: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """Run ``litdata.optimize`` with ``params['workers']`` worker processes."""
    from litdata import optimize

    items = list_raw(raw)
    kw: dict[str, Any] = {}
    if params.get("compression") == "zstd":
        kw = {"compression": "zstd:3", "compression_level": "chunk"}
    if params.get("chunk_size"):
        kw["chunk_size"] = params["chunk_size"]
    else:
        kw["chunk_bytes"] = bytes_per_shard(meta["total_bytes"], len(items), params["shards"])
    optimize(
        fn=_sample,
        inputs=items,
        output_dir=out,
        num_workers=params.get("workers", 1),
        reorder_files=False,
        mode="overwrite",
        verbose=False,
        # litdata's default start method (spawn outside notebooks): workers
        # re-import torch + litdata, which is what users get
        start_method=params.get("start_method"),
        **kw,
    )
    return {"files": len(glob.glob(os.path.join(out, "*.bin*")))}


def loader(
    out: str,
    batch_size: int,
    num_workers: int,
    collate: Callable[[list[Any]], Any],
    params: dict[str, Any],
) -> Iterable[Any]:
    """StreamingDataset over the local folder, shuffled (compressed: via a cache dir)."""
    from litdata import StreamingDataLoader, StreamingDataset

    compressed = bool(glob.glob(os.path.join(out, "*.zstd*")))
    kw: dict[str, Any] = {}
    src = os.path.abspath(out)
    remote = params.get("remote")
    if remote:  # out is an s3:// URL (bench.remote)
        from litdata.streaming import downloader

        # obstore refuses a plain-http endpoint unless its client options allow it; litdata
        # 0.2.76 builds them from this module dict and has no argument for it
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"  # type: ignore[index]
        src = out
        kw = {"cache_dir": remote["cache_dir"], "storage_options": remote["boto3_options"]}
    elif compressed:  # copy+decompress into a cache instead of in place
        cache = params.get("cache_dir") or src.rstrip("/") + ".cache"
        os.makedirs(cache, exist_ok=True)
        src, kw = f"local:{src}", {"cache_dir": cache}
    ds = StreamingDataset(
        input_dir=src,
        **kw,
        shuffle=params.get("shuffle", True),
        seed=0,
    )
    dl: Iterable[Any] = StreamingDataLoader(
        ds, batch_size=batch_size, num_workers=num_workers, collate_fn=collate
    )
    return dl
