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

import sys

import torch.utils.data

from loader.errors import WorldMismatchError

__all__ = ["REBATCH", "check_not_rebatched", "check_not_resplit"]

REBATCH = (
    "ShardDataset(batch_size=...) already yields whole batches, and this DataLoader was "
    "given a batch_size too (it would batch batches, and len(loader) would be wrong): "
    "create it with DataLoader(dataset, batch_size=None, ...)"
)
_FETCH = "torch.utils.data._utils.fetch"  # where DataLoader (and torchdata's) call iter(dataset)


def check_not_rebatched(batch_size: int | None) -> None:
    """Raise if a DataLoader with a batch size of its own iterates a batching dataset.

    Call it from ``__iter__``. torch's fetcher calls ``iter(dataset)`` with
    ``auto_collation`` true exactly when the DataLoader batches; whatever its
    ``collate_fn``, it would then put ``batch_size`` of our batches in each of
    its own. (With the default collate, ``loader.torch.batch`` refuses too.)

    Raises:
        TypeError: a batching dataset under a batching DataLoader.
    """
    if batch_size is None:
        return
    caller = sys._getframe(2)  # the caller of __iter__
    if (
        caller.f_code.co_name == "__init__"
        and caller.f_globals.get("__name__") == _FETCH
        and caller.f_locals.get("auto_collation") is True
    ):
        raise TypeError(REBATCH)


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
