"""webdataset: ``ShardWriter`` to build, ``WebDataset`` + DataLoader to load."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable
from typing import Any

from bench.generate import list_raw
from bench.peers.common import per_shard

BUILD_IMPORTS = ("webdataset",)  # timed as "import s" of a build
LOAD_IMPORTS = ("webdataset", "torch.utils.data")  # timed as "import s" of a load


def build(raw: str, out: str, meta: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """Write ``params['shards']`` tar shards with ``<key>.<ext>`` + ``<key>.cls``."""
    import webdataset as wds

    items = list_raw(raw)
    ext = meta["ext"]
    os.makedirs(out, exist_ok=True)
    pattern = os.path.join(out, "shard-%05d.tar")
    with wds.ShardWriter(
        pattern, maxcount=per_shard(len(items), params["shards"]), maxsize=1 << 40, verbose=0
    ) as sink:
        for path, cls, key in items:
            with open(path, "rb") as f:
                data = f.read()
            sink.write({"__key__": key, ext: data, "cls": str(cls).encode()})
    return {"files": len(glob.glob(os.path.join(out, "*.tar")))}


def shards(out: str) -> list[str]:
    """Sorted shard paths of a built output folder."""
    return sorted(glob.glob(os.path.join(out, "*.tar")))


def loader(
    out: str,
    batch_size: int,
    num_workers: int,
    collate: Callable[[list[Any]], Any],
    params: dict[str, Any],
) -> Iterable[Any]:
    """WebDataset with node/worker splitting, shard shuffle and a 1000-sample buffer."""
    import webdataset as wds
    from torch.utils.data import DataLoader

    shuffle = params.get("shuffle", True)
    ds = wds.WebDataset(
        shards(out),
        shardshuffle=len(shards(out)) if shuffle else False,
        nodesplitter=wds.split_by_node,
        workersplitter=wds.split_by_worker,
        empty_check=False,
        seed=0,
    )
    if shuffle:
        ds = ds.shuffle(1000)
    return DataLoader(ds, batch_size=batch_size, num_workers=num_workers, collate_fn=collate)
