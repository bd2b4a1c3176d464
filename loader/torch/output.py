"""TorchOutput: the torch layer's ``loader.read.output.Output``: torch batches and image tensors.

Batches without a per-sample decode or transform are gathered straight from
the read windows (``loader.torch.assemble``); in a DataLoader worker their large
payloads go through the worker's shared-memory ring (``loader.torch.arena``), in
the main process into reused buffers (``Recycler``). Both are the process's
own: they are made on first use and never pickled to another process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from loader.torch.arena import RINGS, Arena
from loader.torch.assemble import Recycler, assemble_batches
from loader.torch.batch import Batch, collate_samples
from loader.torch.layer import worker_info

__all__ = ["TorchOutput"]


class TorchOutput:
    """Batches as ``loader.torch.batch.Batch`` (torch tensors); images as uint8 CHW tensors."""

    gathers = True

    def __init__(self) -> None:
        self._recycler: Recycler | None = None  # the main process's batch buffers
        self._arena: Arena | None = None  # a DataLoader worker's ring

    def collate(self, samples: Sequence[Mapping[str, Any]], position: dict[str, Any]) -> Batch:
        return collate_samples(samples, position)

    def gather(
        self, windows: Iterator[Any], batch_size: int, positions: Iterator[dict[str, Any]]
    ) -> Iterator[Batch]:
        if worker_info() is None:  # the main process: large payloads in reused buffers
            if self._recycler is None:
                self._recycler = Recycler()
            return assemble_batches(windows, batch_size, positions, None, self._recycler)
        return assemble_batches(windows, batch_size, positions, self.arena() if RINGS else None)

    def arena(self) -> Arena:
        """This worker process's shared-memory ring for batch payloads (made once, kept)."""
        if self._arena is None or self._arena.owner != os.getpid():
            self._arena = Arena()
        return self._arena

    def image(self, pixels: npt.NDArray[np.uint8]) -> torch.Tensor:
        return torch.from_numpy(pixels)

    def __getstate__(self) -> dict[str, Any]:
        return {"_recycler": None, "_arena": None}  # each process makes its own
