"""Weighting: choose which samples (and how many copies of each) the shards will hold. Pure.

Without ``--class-weights`` every sample is selected once. With it:

* **resample** (default): class counts follow the target weights. A class
  above its target is undersampled (a seeded choice without replacement); a
  class below it is oversampled: every sample gets ``floor(t/n)`` copies and a
  seeded choice of ``t mod n`` samples one more. The total defaults to the
  input's sample count (``--num-samples`` to choose).
* **keep-all**: as resample, but the total is the smallest one at which no
  class must drop a sample, so every original is kept.
* **weights-only**: every sample once, each carrying ``weight = p_c / q_c``
  (target share over actual share of its class; mean weight 1) for a weighted
  loss.

Copy 0 of a sample keeps its key; copy k > 0 is ``<key>-r<k>`` and the index
records its copy number. Which samples are copied or dropped depends only on
the seed. The spec syntax is parsed by ``shardprep.format.classweights`` (the loader reads it too).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from shardprep.config import BuildConfig
from shardprep.format.classweights import apportion, parse_class_weights
from shardprep.format.errors import DuplicateKeyError, PlanError
from shardprep.format.interface import CLI, Interface
from shardprep.format.rng import derive_rng
from shardprep.inventory import Inventory, InventoryView, SampleRef

__all__ = ["Selection", "apportion", "class_targets", "parse_class_weights", "select_samples"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Selection:
    """The samples to write: ``source[i]`` is an inventory index, ``copy[i]`` its copy number.

    ``Selection.every(n)`` (no weighting) holds no per-sample array: written
    sample ``i`` is inventory sample ``i``, once.
    """

    source: IntArray | None  # None: every inventory sample once, in order
    copy: IntArray | None
    multiplicity: IntArray | None = None  # per written sample: copies of its source (None: all 1)
    weight: FloatArray | None = None  # per inventory sample, for --weights-only
    section: dict[str, Any] | None = None  # what the manifest records about the weighting
    count: int = 0  # the number of samples when ``source`` is None

    @classmethod
    def every(cls, n: int) -> Selection:
        """Every one of ``n`` inventory samples, once, in inventory order."""
        return cls(None, None, count=n)

    def __len__(self) -> int:
        return self.count if self.source is None else len(self.source)

    def sources(self, positions: IntArray) -> IntArray:
        """The inventory index of each written sample at ``positions``."""
        if self.source is None:
            return np.asarray(positions, dtype=np.int64)
        return self.source[positions]

    def copies(self, positions: IntArray) -> IntArray:
        """The copy number of each written sample at ``positions``."""
        if self.copy is None:
            return np.zeros(len(positions), dtype=np.int64)
        return self.copy[positions]

    def samples(self, inventory: Inventory, positions: IntArray) -> list[SampleRef]:
        """SampleRefs of written samples ``positions`` (a copy gets its own key: ``<key>-r<copy>``)."""
        refs = inventory.samples(self.sources(positions))
        if self.section is None:
            return refs  # no weighting: nothing to adjust
        copies = self.copies(positions).tolist()
        multiplicity = (
            self.multiplicity[positions].tolist() if self.multiplicity is not None else None
        )
        weight = self.weight[self.sources(positions)] if self.weight is not None else None
        for k, ref in enumerate(refs):
            changes: dict[str, Any] = {}
            if copies[k]:
                changes.update(key=f"{ref.key}-r{copies[k]}", copy=copies[k])
            if multiplicity is not None:
                changes["multiplicity"] = multiplicity[k]
            if weight is not None:
                changes["weight"] = f"{weight[k]:.6g}".encode()
            if changes:
                refs[k] = ref._replace(**changes)
        return refs

    def subset(self, positions: IntArray) -> Selection:
        """Written samples ``positions`` as a selection of ``inventory.subset(source[positions])``.

        Its sample ``k`` is this selection's sample ``positions[k]``, with
        the same copy number, multiplicity and weight.
        """
        k = len(positions)
        return Selection(
            np.arange(k, dtype=np.int64),
            self.copies(positions),
            self.multiplicity[positions] if self.multiplicity is not None else None,
            self.weight[self.sources(positions)] if self.weight is not None else None,
            self.section,
        )

    def manifest_section(self, inventory: InventoryView) -> dict[str, Any]:
        """Extra manifest fields (empty when nothing was reweighted)."""
        return {"class_weighting": self.section} if self.section else {}


def class_targets(
    counts: list[int],
    weights: FloatArray,
    total: int | None,
    keep_all: bool,
    interface: Interface = CLI,
) -> IntArray:
    """Samples per class after resampling (``interface``: how refusals name the options).

    Raises:
        PlanError: ``keep_all`` with a zero weight on a non-empty class, or a
            ``total`` too small to keep every sample.
    """
    n = np.array(counts, dtype=np.int64)
    if not keep_all:
        return apportion(total if total is not None else int(n.sum()), weights)
    if ((weights == 0) & (n > 0)).any():
        raise PlanError(
            f"{interface.option('keep_all')} cannot give a class weight 0: its samples would be "
            "dropped"
        )
    needed = max(math.ceil(c / w) for c, w in zip(n, weights, strict=True) if w > 0)
    while (apportion(needed, weights) < n).any():
        needed += 1
    if total is not None and total < needed:
        raise PlanError(
            f"{interface.option('keep_all')} needs {interface.option('num_samples')} of at least "
            f"{needed} for these weights"
        )
    return apportion(total if total is not None else needed, weights)


def select_samples(inventory: InventoryView, config: BuildConfig) -> Selection:
    """Every sample once, or the class-weighted selection that ``config`` asks for.

    Without weighting this holds nothing per sample. With it, the selection
    and the label column are in memory (about 30 bytes per sample).

    Raises:
        PlanError: a bad ``--class-weights`` spec, or weighting unlabelled data.
    """
    n = len(inventory)
    if config.class_weights is None:
        return Selection.every(n)
    if inventory.class_names is None:
        raise PlanError(
            f"{config.interface.option('class_weights')} needs labelled data, but this input "
            "has no labels"
        )
    counts = inventory.class_counts()
    labels = inventory.column("label")
    weights = parse_class_weights(
        config.class_weights,
        inventory.class_names,
        counts,
        config.allow_zero_weights,
        config.interface,
    )
    section: dict[str, Any] = {
        "spec": config.class_weights,
        "target_weights": [round(float(w), 9) for w in weights],
        "original_counts": counts,
    }
    if config.weights_only:
        actual = np.array(counts, dtype=np.float64) / n
        per_class = np.divide(weights, actual, out=np.zeros_like(weights), where=actual > 0)
        section.update(
            mode="weights-only",
            class_sample_weights=[float(f"{w:.6g}") for w in per_class],
            realized_counts=counts,
        )
        return Selection(
            np.arange(n, dtype=np.int64),
            np.zeros(n, dtype=np.int64),
            weight=per_class[labels],
            section=section,
        )
    targets = class_targets(counts, weights, config.num_samples, config.keep_all, config.interface)
    rng = derive_rng(config.seed, "weights")
    sources, copies, multiplicities = [], [], []
    for c, target in enumerate(targets.tolist()):
        members = np.flatnonzero(labels == c)
        multiplicity = _multiplicities(len(members), target, rng)
        sources.append(np.repeat(members, multiplicity))
        copies.append(_copy_numbers(multiplicity))
        multiplicities.append(np.repeat(multiplicity, multiplicity))
    section.update(
        mode="keep-all" if config.keep_all else "resample",
        realized_counts=[int(t) for t in targets],
    )
    source, copy = np.concatenate(sources), np.concatenate(copies)
    _check_copy_keys(inventory, source, copy)
    section["dropped_samples"] = n - len(np.unique(source))
    return Selection(
        source,
        copy,
        multiplicity=np.concatenate(multiplicities),
        section=section,
    )


_COPY_SUFFIX = re.compile(rb"-r[1-9][0-9]*")


def _check_copy_keys(inventory: InventoryView, source: IntArray, copy: IntArray) -> None:
    """Raise DuplicateKeyError if a copy's key ``<key>-r<k>`` is the key of an input sample.

    Only keys that end like a copy's (``-r<k>``, found in the name blob) are
    looked at, a chunk of the inventory at a time.
    """
    suffixed: dict[str, int] = {}  # a suffixed key -> its sample
    for lo, rows in inventory.chunks(1 << 16):
        ends = rows.stem_end.astype(np.int64)
        starts = np.concatenate([[0], ends[:-1]])
        for match in _COPY_SUFFIX.finditer(rows.stem_blob):
            i = int(np.searchsorted(ends, match.end()))
            if i < len(ends) and ends[i] == match.end() and starts[i] <= match.start():
                suffixed[rows.key(i)] = lo + i
    if not suffixed:
        return
    bases: dict[str, list[str]] = {}  # a base key -> the suffixed keys built on it
    for key in suffixed:
        bases.setdefault(key.rpartition("-r")[0], []).append(key)
    originals: dict[str, int] = {}  # a base key -> the sample that has it
    for lo, rows in inventory.chunks(1 << 16):
        for i in range(len(rows)):
            key = rows.key(i)
            if key in bases:
                originals[key] = lo + i
    copied = {(int(s), int(c)) for s, c in zip(source, copy, strict=True) if c}
    for base, original in originals.items():
        for key in bases[base]:
            k = key.rpartition("-r")[2]
            if (original, int(k)) in copied:
                raise DuplicateKeyError(
                    key,
                    [
                        inventory.sample(suffixed[key]).source,
                        f"copy {k} of {inventory.sample(original).source}",
                    ],
                )


def _multiplicities(n: int, target: int, rng: np.random.Generator) -> IntArray:
    """Copies of each of ``n`` samples so that they add up to ``target`` (as even as possible)."""
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    base, extra = divmod(target, n)
    multiplicity = np.full(n, base, dtype=np.int64)
    multiplicity[rng.choice(n, size=extra, replace=False)] += 1
    return multiplicity


def _copy_numbers(multiplicity: IntArray) -> IntArray:
    """0, 1, ..., m-1 for each sample with multiplicity m, concatenated."""
    total = int(multiplicity.sum())
    starts = np.repeat(np.cumsum(multiplicity) - multiplicity, multiplicity)
    return np.arange(total, dtype=np.int64) - starts
