"""Output: what a stream yields, as a seam: how samples become a batch, and what a decoded image is.

A stream (``loader.core.ShardStream``, ``loader.compose.mix.MixedStream``,
``loader.compose.groups.GroupedStream``) is given an ``Output`` when it is made and
never decides its array type itself. ``NumpyOutput`` (the default, here, no
torch) gives dicts of NumPy arrays (``loader.read.npbatch``) and decodes images to
``uint8`` arrays of shape (channels, height, width); the torch layer gives
``loader.torch.output.TorchOutput``: torch batches gathered straight from the
read windows, and images as torch tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from loader.read.npbatch import collate_numpy

__all__ = ["NumpyOutput", "Output"]


class Output(Protocol):
    """How a stream's samples are handed out."""

    #: whether ``gather`` makes batches from raw read windows (no per-sample dicts)
    gathers: bool

    def collate(self, samples: Sequence[Mapping[str, Any]], position: dict[str, Any]) -> Any:
        """One batch from sample dicts; ``position`` is stored under ``__position__``."""
        ...

    def gather(
        self, windows: Iterator[Any], batch_size: int, positions: Iterator[dict[str, Any]]
    ) -> Iterator[Any]:
        """Batches straight from read windows (``loader.read.samples.shuffled_windows``); only if ``gathers``."""
        ...

    def image(self, pixels: npt.NDArray[np.uint8]) -> Any:
        """A decoded image from its (channels, height, width) ``uint8`` array."""
        ...


class NumpyOutput:
    """Batches as dicts of NumPy arrays, images as NumPy arrays: no torch."""

    gathers = False

    def collate(self, samples: Sequence[Mapping[str, Any]], position: dict[str, Any]) -> Any:
        return collate_numpy(samples, position)

    def gather(
        self, windows: Iterator[Any], batch_size: int, positions: Iterator[dict[str, Any]]
    ) -> Iterator[Any]:
        raise NotImplementedError("NumpyOutput collates sample dicts (gathers is False)")

    def image(self, pixels: npt.NDArray[np.uint8]) -> Any:
        return pixels
