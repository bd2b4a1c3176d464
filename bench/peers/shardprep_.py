"""shardprep: ``shardprep.build`` to build, ``loader.ShardDataset`` to load.

A failing call makes the runner report ``n/a: error ...`` instead of a figure.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable
from typing import Any

from bench.peers.common import PAYLOAD_KEYS

BUILD_IMPORTS = ("shardprep",)  # timed as "import s" of a build
# timed as "import s" of a load: what ``from loader import ShardDataset`` imports
LOAD_IMPORTS = ("loader", "loader.torch.dataset", "torch.utils.data")


def build(raw: str, out: str, meta: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """``shardprep.build(raw, out, shards=N, workers=K, compression=...[, engine=...])``."""
    import shardprep

    opts: dict[str, Any] = {
        "shards": params["shards"],
        "workers": params.get("workers", 1),
        "compression": params.get("compression") or "none",
        "progress": False,  # like the CLI's --quiet; peers print nothing either
    }
    if params.get("engine"):
        opts["engine"] = params["engine"]
    shardprep.build(raw, out, **opts)
    return {"files": len(glob.glob(os.path.join(out, "shard-*.tar*")))}


def loader(
    out: str,
    batch_size: int,
    num_workers: int,
    collate: Callable[[list[Any]], Any],
    params: dict[str, Any],
) -> Iterable[Any]:
    """``ShardDataset(out, seed=0, shuffle=True[, uneven=...])`` + DataLoader."""
    from torch.utils.data import DataLoader

    from loader import ShardDataset

    kw: dict[str, Any] = {}
    if params.get("uneven"):
        kw["uneven"] = params["uneven"]
    ds = ShardDataset(out, seed=0, shuffle=params.get("shuffle", True), **kw, **_remote(params))
    return DataLoader(ds, batch_size=batch_size, num_workers=num_workers, collate_fn=collate)


def batch_loader(
    out: str,
    batch_size: int,
    num_workers: int,
    collate: Callable[[list[Any]], Any],
    params: dict[str, Any],
) -> Iterable[Any]:
    """``ShardDataset(out, batch_size=B)`` + ``DataLoader(batch_size=None)``: whole batches
    made in the workers, payloads packed in shared memory. Yields each batch's payload
    column (a ``loader.torch.batch.Packed``); ``collate`` is not used, the batch is already made."""
    from torch.utils.data import DataLoader

    from loader import ShardDataset

    ds = ShardDataset(
        out,
        seed=0,
        shuffle=params.get("shuffle", True),
        batch_size=batch_size,
        **_remote(params),
    )
    dl = DataLoader(ds, batch_size=None, num_workers=num_workers)
    return (next(batch[k] for k in PAYLOAD_KEYS if k in batch) for batch in dl)


def _remote(params: dict[str, Any]) -> dict[str, Any]:
    """``read=ReadOptions(remote=RemoteOptions(...))`` from ``params["remote"]`` (bench.remote)."""
    remote = params.get("remote")
    if not remote:
        return {}
    from loader import ReadOptions, RemoteOptions

    options = RemoteOptions(
        storage_options=remote["storage_options"],
        cache_dir=remote.get("cache_dir"),
        backend=remote.get("backend", "auto"),
        **remote.get("options", {}),  # e.g. request_bytes, max_requests (bench.remote A/B rows)
    )
    return {"read": ReadOptions(remote=options)}
