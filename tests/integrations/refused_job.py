"""A trainer whose DataLoader workers refuse to iterate (a guard), then waits to be killed.

``python -m tests.integrations.refused_job DATA GUARD REPORT`` makes a 2-worker
forkserver DataLoader that a ``loader.torch.guards`` check refuses in every worker:

* ``rebatched``: ``DataLoader(ShardDataset(batch_size=4), batch_size=2)`` (``TypeError``);
* ``resplit``: the dataset wrapped in accelerate's ``IterableDatasetShard`` over 2
  processes, as ``accelerator.prepare(dataloader)`` wraps it (``WorldMismatchError``).

It takes the refusal of each worker (so both have run ``ShardDataset.__iter__``), keeps
the iterator (its refused workers stay alive, waiting for work, as in a trainer that
logs the error before it goes), writes ``REPORT`` (``tests.faults.orphan_job.report``) and
blocks until the test kills it. Run by ``test_refused_orphans.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from loader import ShardDataset, WorldMismatchError
from tests.faults.orphan_job import WORKERS, report, wait_to_be_killed

GUARDS = {"rebatched": TypeError, "resplit": WorldMismatchError}


def refused_loader(data: str, guard: str) -> DataLoader[Any]:
    """A forkserver DataLoader whose workers' ``iter(dataset)`` raises ``GUARDS[guard]``."""
    dataset: Any
    if guard == "rebatched":
        dataset, batch_size = ShardDataset(data, batch_size=4), 2
    else:
        from accelerate.data_loader import IterableDatasetShard

        dataset = IterableDatasetShard(ShardDataset(data), batch_size=4, num_processes=2)
        batch_size = 4
    return DataLoader(
        dataset, batch_size=batch_size, num_workers=WORKERS, multiprocessing_context="forkserver"
    )


def main(argv: list[str]) -> None:
    data, guard, path = argv
    torch.set_num_threads(1)
    batches = iter(refused_loader(data, guard))
    refusals = []
    for _ in range(WORKERS):  # one refusal per worker, in worker order
        try:
            next(batches)
        except GUARDS[guard] as error:
            refusals.append(error)
    assert len(refusals) == WORKERS, refusals
    report(Path(path), [w.pid for w in batches._workers])  # type: ignore[attr-defined]
    wait_to_be_killed()


if __name__ == "__main__":
    main(sys.argv[1:])
