"""MosaicML streaming: ``MDSWriter`` to build, ``StreamingDataset`` to load.

``import streaming`` eagerly imports ``streaming.vision``, which imports
torchvision; the PyPI torchvision wheel does not load beside the CPU torch
used here (``operator torchvision::nms does not exist``). The runner therefore
puts ``bench/_stubs`` (a tiny fake ``torchvision``) first on ``sys.path`` in
MDS subprocesses only, *before* importing this module. Nothing that MDSWriter
or StreamingDataset use for raw ``bytes`` columns touches torchvision.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable
from typing import Any

from bench.generate import list_raw
from bench.peers.common import bytes_per_shard

BUILD_IMPORTS = ("streaming",)  # timed as "import s" of a build
LOAD_IMPORTS = ("streaming", "torch.utils.data")  # timed as "import s" of a load
NEEDS_TORCHVISION_STUB = True

COLUMNS = {"key": "str", "data": "bytes", "cls": "int"}


def build(raw: str, out: str, meta: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """Write MDS shards of about ``total/shards`` bytes, optionally zstd."""
    from streaming import MDSWriter

    items = list_raw(raw)
    limit = bytes_per_shard(meta["total_bytes"], len(items), params["shards"])
    comp = "zstd:3" if params.get("compression") == "zstd" else None
    with MDSWriter(out=out, columns=COLUMNS, compression=comp, size_limit=limit) as w:
        for path, cls, key in items:
            with open(path, "rb") as f:
                w.write({"key": key, "data": f.read(), "cls": cls})
    return {"files": len(glob.glob(os.path.join(out, "shard.*")))}


def loader(
    out: str,
    batch_size: int,
    num_workers: int,
    collate: Callable[[list[Any]], Any],
    params: dict[str, Any],
) -> Iterable[Any]:
    """StreamingDataset over a local folder, shuffled, + DataLoader.

    Compressed shards are read as ``remote`` into a separate ``local`` cache.
    """
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    if params.get("clean_shm", True):
        clean_stale_shared_memory()
    if params.get("remote"):  # out is an s3:// URL; boto3 reads S3_ENDPOINT_URL and AWS_*
        kw = {"remote": out, "local": params["remote"]["cache_dir"]}
    elif glob.glob(os.path.join(out, "*.zstd")):
        # compressed: treat the folder as "remote" and decompress into a cache,
        # never in place (local-only would rewrite the build output)
        kw = {"remote": out, "local": params.get("cache_dir") or out.rstrip("/") + ".cache"}
    else:
        kw = {"local": out}
    ds = StreamingDataset(
        **kw,
        shuffle=params.get("shuffle", True),
        shuffle_seed=0,
        batch_size=batch_size,
    )
    return DataLoader(ds, batch_size=batch_size, num_workers=num_workers, collate_fn=collate)
