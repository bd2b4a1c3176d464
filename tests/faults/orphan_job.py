"""A training process for tests/faults/test_orphans.py: starts DataLoader workers, then waits to die.

``python -m tests.faults.orphan_job DATA START LOADER PERSISTENT REPORT`` iterates a
ShardDataset over ``DATA`` with 2 workers started by ``START`` (fork, forkserver, spawn)
through ``LOADER`` (``torch``: DataLoader, ``stateful``: torchdata's StatefulDataLoader,
``lightning``: a Lightning ``Trainer.fit`` over a DataLoader). Once a batch from each worker
has arrived it writes ``REPORT`` (JSON: its own pid, its workers' pids, every other
process of its session) and blocks until the test kills it.

``LOADER`` ``wrapped``: a DataLoader over a user's dataset around the ShardDataset
(:class:`UserWrapper`), whose iteration never reaches the ShardDataset; each worker's
``worker_init_fn`` appends its pid to ``REPORT`` as it starts, and the trainer blocks at once.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from loader import ShardDataset
from tests.processes import session_processes

__all__ = ["WORKERS", "UserWrapper", "announce", "main", "session_processes"]

WORKERS = 2


def report(path: Path, workers: list[int]) -> None:
    """Write what the test needs to know, atomically (the test polls for the file)."""
    me = os.getpid()
    others = [p for p in session_processes(os.getsid(0)) if p != me]
    text = json.dumps({"trainer": me, "workers": workers, "session": others})
    part = path.with_suffix(".part")
    part.write_text(text)
    part.rename(path)


def wait_to_be_killed() -> None:
    threading.Event().wait()


def plain(data: str, start: str, stateful: bool, persistent: bool, path: Path) -> None:
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader

        make: Any = StatefulDataLoader
    else:
        make = DataLoader
    loader = make(
        ShardDataset(data, batch_size=4),
        batch_size=None,
        num_workers=WORKERS,
        multiprocessing_context=start,
        persistent_workers=persistent,
    )
    batches = iter(loader)
    for _ in range(WORKERS):  # one batch from each worker: all of them are iterating
        next(batches)
    report(path, [w.pid for w in batches._workers])
    wait_to_be_killed()


class UserWrapper(IterableDataset[Any]):
    """A user's dataset around a ShardDataset, as trainers write them: its generator
    ``__iter__`` reaches the ShardDataset only at its first ``next``, after user code (a
    download, a wait) that here never ends, so the ShardDataset's own ``__iter__`` never runs
    in the workers."""

    def __init__(self, inner: ShardDataset) -> None:
        self.inner = inner

    def __iter__(self) -> Iterator[Any]:
        threading.Event().wait()
        yield from self.inner


def announce(path: str, worker: int) -> None:
    """A ``worker_init_fn``: append this worker's pid to ``path`` (one short write: one line)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()}\n")


def wrapped(data: str, start: str, path: Path) -> None:
    """Start the workers of a DataLoader over a :class:`UserWrapper`, then wait to be killed."""
    from tests.faults import orphan_job  # pickled by its module's name, not as __main__

    loader = DataLoader(
        orphan_job.UserWrapper(ShardDataset(data, batch_size=4)),
        batch_size=None,
        num_workers=WORKERS,
        multiprocessing_context=start,
        worker_init_fn=functools.partial(orphan_job.announce, str(path)),
    )
    batches = iter(loader)  # starts the workers; kept so that they are not stopped
    wait_to_be_killed()
    del batches


def lightning(data: str, start: str, persistent: bool, path: Path) -> None:
    import lightning as L

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(
                ShardDataset(data, batch_size=4),
                batch_size=None,
                num_workers=WORKERS,
                multiprocessing_context=start,
                persistent_workers=persistent,
            )

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            if index == WORKERS - 1:
                combined = self.trainer.fit_loop._combined_loader  # lightning's own
                assert combined is not None
                report(path, sorted(_loader_workers(combined._iterator)))
                wait_to_be_killed()
            return (self.weight - 1.0).pow(2).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model())


def _loader_workers(iterator: Any) -> list[int]:
    """The worker pids of the DataLoader iterator(s) under Lightning's combined iterator."""
    found: list[int] = []
    for inner in getattr(iterator, "iterators", []):
        found += [w.pid for w in getattr(inner, "_workers", [])]
    return found


def main(argv: list[str]) -> None:
    data, start, kind, persistent, path = argv
    torch.set_num_threads(1)
    if kind == "lightning":
        lightning(data, start, persistent == "1", Path(path))
    elif kind == "wrapped":
        wrapped(data, start, Path(path))
    else:
        plain(data, start, kind == "stateful", persistent == "1", Path(path))


if __name__ == "__main__":
    main(sys.argv[1:])
