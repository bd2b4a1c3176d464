"""Functions run on each gloo rank of the remote tests (imported by ``tests.distributed.rank_main``)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch.utils.data

from loader import ReadOptions, RemoteOptions, ShardDataset
from tests.distributed.ranks import OPTIONS, epoch_batches


def read_s3(
    rank: int, world_size: int, url: str, storage_options: dict[str, Any], cache_dir: str
) -> dict[str, Any]:
    """Two epochs from s3 with read-ahead and a cache shared by both ranks; [key, sha1] per sample."""
    remote = RemoteOptions(
        storage_options=storage_options, request_bytes=64 << 10, cache_dir=cache_dir
    )
    ds = ShardDataset(url, batch_size=16, read=ReadOptions(remote=remote), **OPTIONS)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, multiprocessing_context="forkserver"
    )
    epochs = []
    for _ in range(2):
        batches = []
        for batch in loader:
            batches.append(
                [
                    [str(k), hashlib.sha1(p).hexdigest()]
                    for k, p in zip(batch["__key__"], batch["bin"].tolist(), strict=True)
                ]
            )
        epochs.append(batches)
    result: dict[str, Any] = {"len": len(ds), "epochs": epochs}
    result["synced"] = epoch_batches(ds, loader=loader)[0]  # epoch 2, all_reduce at every step
    return result
