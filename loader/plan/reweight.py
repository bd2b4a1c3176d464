"""Reweight: read-time class weighting without a rebuild, as a seeded multiset per epoch. Pure.

Each epoch, class ``c`` contributes ``t_c`` samples (``apportion`` of the
total by the target weights), split over the shards in proportion to where
the class lives (the manifest's per-shard histograms), so every shard's
expanded size is known from the manifest alone and the partition can give
every rank exactly the same count. Inside a shard, which samples are repeated
or left out is drawn from (seed, epoch, shard) using the labels in the shard's
index; a worker still streams its ranges in order, yielding a sample as many
times as it was drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from shardprep.format.classweights import apportion, parse_class_weights
from shardprep.format.rng import derive_rng

__all__ = ["Reweighting"]

IntArray = npt.NDArray[np.int64]


class Reweighting:
    """Targets per (shard, class) for one dataset and spec; per-epoch draws of sample ids."""

    def __init__(
        self,
        spec: str,
        class_names: tuple[str, ...],
        shard_class_counts: Sequence[Sequence[int]],
        total: int | None = None,
    ) -> None:
        counts = np.array(shard_class_counts, dtype=np.int64).reshape(len(shard_class_counts), -1)
        per_class = counts.sum(axis=0)
        self.weights = parse_class_weights(spec, class_names, per_class.tolist())
        targets = apportion(int(total if total is not None else per_class.sum()), self.weights)
        self.shard_targets = np.zeros_like(counts)
        for c in range(counts.shape[1]):
            if per_class[c]:
                share = counts[:, c] / per_class[c]
                self.shard_targets[:, c] = apportion(int(targets[c]), share)
        actual = per_class / max(1, per_class.sum())
        self.class_weight = np.divide(
            self.weights, actual, out=np.zeros_like(self.weights), where=actual > 0
        )

    def shard_sizes(self) -> list[int]:
        """Samples each shard contributes per epoch after reweighting."""
        sizes: list[int] = self.shard_targets.sum(axis=1).tolist()
        return sizes

    def sample_ids(
        self, labels: npt.NDArray[np.integer], shard: int, seed: int, epoch: int
    ) -> IntArray:
        """The shard's expanded sequence: raw sample ids in order, each repeated as drawn."""
        rng = derive_rng(seed, "reweight", epoch, shard)
        multiplicity = np.zeros(len(labels), dtype=np.int64)
        for c, target in enumerate(self.shard_targets[shard].tolist()):
            members = np.flatnonzero(labels == c)
            if not len(members) or not target:
                continue
            base, extra = divmod(target, len(members))
            multiplicity[members] = base
            multiplicity[members[rng.choice(len(members), size=extra, replace=False)]] += 1
        return np.repeat(np.arange(len(labels), dtype=np.int64), multiplicity)
