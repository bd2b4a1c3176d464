"""Guards: refuse wrappers that would split a rank's share of the data a second time.

A ShardDataset already gives each rank its own share. Hugging Face accelerate's
``accelerator.prepare(dataloader)`` with ``dispatch_batches=False`` wraps an
IterableDataset in ``accelerate.data_loader.IterableDatasetShard``, which
splits again inside every DataLoader worker: each rank then trains on roughly
a quarter of the data (with 2 ranks), padded by wrap-around, and nothing fails.
Inside a worker the wrapper is visible as ``get_worker_info().dataset``;
``check_not_resplit()`` raises there. (With ``num_workers=0`` there is no
worker info and the wrapper cannot be seen.)
"""

from __future__ import annotations

import torch.utils.data

from loader.errors import WorldMismatchError

__all__ = ["check_not_resplit"]


def check_not_resplit() -> None:
    """Raise if this DataLoader worker iterates a ShardDataset through accelerate's rank splitter.

    Raises:
        WorldMismatchError: the worker's dataset is an ``IterableDatasetShard``
            over more than one process.
    """
    info = torch.utils.data.get_worker_info()
    if info is None:
        return
    outer = type(info.dataset)
    if (
        outer.__name__ == "IterableDatasetShard"
        and outer.__module__.startswith("accelerate.")
        and getattr(info.dataset, "num_processes", 1) > 1
    ):
        raise WorldMismatchError(
            "accelerator.prepare() wrapped this ShardDataset's DataLoader in accelerate's "
            "IterableDatasetShard, which splits every rank's share again (each rank would train "
            "on about 1/world_size of its share): ShardDataset already splits by rank, so do not "
            "pass its DataLoader to accelerator.prepare(); prepare the model and optimizer only "
            "and move batches with accelerate.utils.send_to_device(batch, accelerator.device)"
        )
