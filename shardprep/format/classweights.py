"""Class weights: the ``--class-weights`` / ``class_weights=`` spec and the apportioning it needs. Pure.

Part of the format contract: the builder (``shardprep.weighting``) and the
loader (``loader.plan.reweight``, ``loader.compose.mix``) read the same spec strings
(``balanced``, ``sqrt``, a JSON file, ``cat=2,dog=1``) into the same shares,
and split integer totals by shares the same way (largest remainders).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import numpy.typing as npt

from shardprep.format.errors import PlanError
from shardprep.format.interface import CLI, Interface

__all__ = ["apportion", "parse_class_weights"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def parse_class_weights(
    spec: str,
    class_names: tuple[str, ...],
    counts: list[int],
    allow_zero: bool = False,
    interface: Interface = CLI,
) -> FloatArray:
    """Target weight per class from ``balanced``, ``sqrt``, a JSON file, or ``cat=2,dog=1``.

    ``interface``: how refusals name the options (``--class-weights`` by default; the
    builder passes its build's, so ``shardprep.build`` is told ``class_weights=``).

    Raises:
        PlanError: fewer than two classes with samples, unknown class, negative or
            all-zero weights, a file that is not a JSON mapping, or (inline) unnamed
            classes without ``allow_zero``.
    """
    option = interface.option
    present = np.array(counts, dtype=np.float64) > 0
    if present.sum() < 2:
        held = ", ".join(repr(class_names[c]) for c in np.flatnonzero(present)) or "none"
        raise PlanError(
            f"class weights need at least two classes with samples, and this data has one "
            f"({held}): weighting would change nothing; leave out the class weights"
        )
    if spec == "balanced":
        weights = present.astype(np.float64)
    elif spec == "sqrt":
        weights = np.sqrt(np.array(counts, dtype=np.float64))
    else:
        mapping = _read_mapping(spec, interface)
        unknown = sorted(set(mapping) - set(class_names))
        if unknown:
            raise PlanError(
                f"{option('class_weights')} names unknown class(es) {', '.join(map(repr, unknown))}; "
                f"the classes are: {', '.join(class_names)}"
            )
        missing = [c for c in class_names if c not in mapping]
        if missing and not allow_zero:
            raise PlanError(
                f"{option('class_weights')} gives no weight to {', '.join(map(repr, missing))}; "
                f"name every class, or pass {option('allow_zero_weights')} to give the others "
                "weight 0"
            )
        weights = np.array([mapping.get(c, 0.0) for c in class_names], dtype=np.float64)
    if (weights < 0).any() or not np.isfinite(weights).all():
        raise PlanError(f"{option('class_weights')} must be finite and non-negative")
    if weights.sum() <= 0:
        raise PlanError(
            f"{option('class_weights')} are all zero; give at least one class a positive weight"
        )
    empty = [class_names[c] for c in np.flatnonzero((weights > 0) & ~present)]
    if empty:
        raise PlanError(f"class(es) {', '.join(map(repr, empty))} have no samples to resample from")
    normalised: FloatArray = weights / weights.sum()
    return normalised


def _read_mapping(spec: str, interface: Interface) -> dict[str, float]:
    """The class -> weight pairs of a JSON file or an inline spec."""
    given = interface.setting("class_weights", spec)  # --class-weights SPEC, class_weights='SPEC'
    option = interface.option("class_weights")
    if spec.endswith(".json") or os.path.isfile(spec):
        try:
            with open(spec, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise PlanError(f"{given}: cannot read a JSON file ({err})") from err
        if not isinstance(data, dict):
            raise PlanError(f"{given}: must be a JSON object of class name to weight")
        items: list[tuple[Any, Any]] = list(data.items())
    else:
        items = []
        for part in spec.split(","):
            name, eq, value = part.partition("=")
            if not eq or not name.strip():
                raise PlanError(
                    f"{given}: expected 'balanced', 'sqrt', a .json file, "
                    "or name=weight pairs such as 'cat=2,dog=1'"
                )
            items.append((name.strip(), value.strip()))
    result: dict[str, float] = {}
    for name, value in items:
        if str(name) in result:
            raise PlanError(f"{option} names class {name!r} twice")
        if isinstance(value, bool):
            raise PlanError(f"{option}: weight of {name!r} is not a number: {value!r}")
        try:
            result[str(name)] = float(value)
        except (TypeError, ValueError) as err:
            raise PlanError(f"{option}: weight of {name!r} is not a number: {value!r}") from err
    return result


def apportion(total: int, shares: FloatArray) -> IntArray:
    """Integers summing to ``total``, proportional to ``shares`` (largest remainders, ties by index)."""
    exact = np.asarray(shares, dtype=np.float64) * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    if short:
        order = np.lexsort((np.arange(len(exact)), -(exact - counts)))
        counts[order[:short]] += 1
    return counts
