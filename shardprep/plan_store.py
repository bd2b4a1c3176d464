"""The plan out of core: :func:`~shardprep.plan.plan_shards`'s exact result, in bounded memory.

``plan_shards`` needs every sample's label, size and tie-break at once (a
lexsort of the whole dataset); at a billion samples that is tens of GB. Here
the same decisions are made a bounded number of samples at a time, and the
result is the same shard for every sample and the same order inside every
shard, bit for bit (tested against ``plan_shards``):

1. **runs**: chunks of (label, -size, tie-break, position) keys, each
   lexsorted and spilled to a file (the tie-breaks are drawn from the plan's
   generator chunk by chunk, which gives the same numbers as one draw);
2. **merge + deal**: a k-way merge of the runs streams the samples in
   ``plan_shards``'s order; each class is dealt in rounds and its remainder
   placed exactly as ``plan.deal_class`` does, keeping only per-shard
   counters; (position, shard) pairs are spilled by position range;
3. **shard column**: the pairs become one shard id per position, on disk;
   copies of a source are then separated (weighted builds only; they keep
   their selection in memory anyway);
4. **cut**: shards are taken in groups of at most ``limits.group`` samples;
   one pass over the positions appends each group's samples (their metadata,
   not their data) to the group's file; each group is then loaded, split
   into its shards and shuffled in shard order with the plan's generator, and
   each shard's task (its samples' columns in write order) is saved to a file.

What stays in memory: one run, the merge's blocks, one group, per-shard and
per-class counters. The write stage reads one shard's file per task
(:class:`PlannedShards`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import numpy.typing as npt

from shardprep.format.errors import PlanError
from shardprep.format.rng import derive_rng
from shardprep.format.sigint import deferred
from shardprep.inventory import Inventory, InventoryView
from shardprep.plan import remainder_targets, separate_copies, shuffle_apart
from shardprep.weighting import Selection

__all__ = ["PlanInput", "PlanLimits", "PlannedShards", "plan_input_to_files", "plan_to_files"]

IntArray = npt.NDArray[np.int64]

_KEY = np.dtype([("label", "<i8"), ("neg_size", "<i8"), ("tie", "<f8"), ("position", "<i8")])
_PAIR = np.dtype([("position", "<i8"), ("shard", "<i8")])


@dataclass(frozen=True)
class PlanLimits:
    """How many samples each step holds in memory (tests make them tiny)."""

    chunk: int = 1 << 16  # positions read per step of a pass
    run: int = 1 << 17  # keys sorted in memory per run (32 bytes each)
    merge: int = 1 << 17  # keys held by the merge, over all runs
    bucket: int = 1 << 17  # positions per spill file of the shard column
    group: int = 1 << 16  # samples loaded at once to cut per-shard files (~100 B each, twice)
    fan_in: int = 64  # runs merged at once; more are first merged into longer runs


@dataclass(frozen=True)
class PlanInput:
    """What the plan reads per written position: its inventory row, label, size and source."""

    inventory: InventoryView
    selection: Selection

    def __len__(self) -> int:
        return len(self.selection)

    def keys(self, lo: int, hi: int) -> tuple[IntArray, IntArray, IntArray]:
        """Labels, sizes in a shard (bytes) and sources of written positions ``lo`` to ``hi - 1``."""
        rows, sources = self.rows(lo, hi)
        return rows.label.astype(np.int64), rows.sample_bytes(), sources

    def rows(self, lo: int, hi: int) -> tuple[Inventory, IntArray]:
        """Inventory rows of written positions ``lo`` to ``hi - 1``, and their sources."""
        sources = self.selection.sources(np.arange(lo, hi, dtype=np.int64))
        if self.selection.source is None:
            return self.inventory.rows(lo, hi), sources
        return self.inventory.gather(sources), sources


def plan_to_files(
    inventory: InventoryView,
    selection: Selection,
    num_shards: int,
    seed: int,
    folder: str,
    limits: PlanLimits | None = None,
    shards_option: str = "--shards",
) -> PlannedShards:
    """Plan ``selection`` of ``inventory`` into ``num_shards`` shards, saved under ``folder``.

    Same result as ``plan_shards(labels, sizes, num_shards, seed, groups=sources)``
    of the selected samples. ``shards_option``: how the refusal names the option (the build's
    :class:`~shardprep.format.interface.Interface` gives ``--shards`` or ``shards=``).

    Raises:
        PlanError: ``num_shards`` is not between 1 and the number of samples.
    """
    data = PlanInput(inventory, selection)
    return plan_input_to_files(data, num_shards, seed, folder, limits, shards_option)


def plan_input_to_files(
    data: PlanInput,
    num_shards: int,
    seed: int,
    folder: str,
    limits: PlanLimits | None = None,
    shards_option: str = "--shards",
) -> PlannedShards:
    """:func:`plan_to_files` for any :class:`PlanInput` (tests give labels and sizes directly)."""
    limits = limits or PlanLimits()
    selection = data.selection
    n = len(data)
    if num_shards < 1 or num_shards > n:
        raise PlanError(
            f"cannot make {num_shards} shard(s) from {n} sample(s): "
            f"choose {shards_option} between 1 and {n}"
        )
    os.makedirs(folder, exist_ok=True)
    rng = derive_rng(seed, "plan")
    runs, class_sizes = _write_runs(data, rng, folder, limits)
    runs = _merge_down(runs, folder, limits)
    counts = _deal(runs, class_sizes, num_shards, folder, limits, n)
    for path in runs:
        os.remove(path)
    shard_of = os.path.join(folder, "shard_of")
    _assemble_shard_column(folder, shard_of, n, limits)
    if selection.source is not None:
        _separate_copies_on_disk(data, shard_of, num_shards)
    return _cut(data, shard_of, counts, rng, folder, limits)


# --- 1. runs --------------------------------------------------------------------


def _write_runs(
    data: PlanInput, rng: np.random.Generator, folder: str, limits: PlanLimits
) -> tuple[list[str], dict[int, int]]:
    """Sorted runs of keys; and the number of samples per label value."""
    n = len(data)
    selection = data.selection
    # plan_shards draws one tie-break per source (max source + 1 of them), in one go.
    drawn = None if selection.source is None else rng.random(int(selection.source.max()) + 1)
    class_sizes: dict[int, int] = {}
    runs: list[str] = []
    for run_lo in range(0, n, limits.run):
        run_hi = min(n, run_lo + limits.run)
        keys = np.empty(run_hi - run_lo, _KEY)
        for lo in range(run_lo, run_hi, limits.chunk):
            hi = min(run_hi, lo + limits.chunk)
            labels, sizes, sources = data.keys(lo, hi)
            part = keys[lo - run_lo : hi - run_lo]
            part["label"] = labels
            part["neg_size"] = -sizes
            part["tie"] = rng.random(hi - lo) if drawn is None else drawn[sources]
            part["position"] = np.arange(lo, hi)
            values, numbers = np.unique(part["label"], return_counts=True)
            for value, number in zip(values.tolist(), numbers.tolist(), strict=True):
                class_sizes[value] = class_sizes.get(value, 0) + number
        keys = keys[np.lexsort((keys["position"], keys["tie"], keys["neg_size"], keys["label"]))]
        path = os.path.join(folder, f"run-{len(runs)}")
        keys.tofile(path)
        runs.append(path)
    return runs, class_sizes


# --- 2. merge and deal ----------------------------------------------------------


def _merged(runs: list[str], limits: PlanLimits) -> Iterator[npt.NDArray[np.void]]:
    """The keys of every run in one sorted stream, as blocks (a k-way merge in numpy).

    Each run contributes a block; everything not above the smallest of the
    blocks' last keys (among runs with more to read) can be emitted, since no
    later key of any run is below it.
    """
    block = max(256, limits.merge // max(1, len(runs)))
    sizes = [os.path.getsize(path) // _KEY.itemsize for path in runs]
    read = [0] * len(runs)
    held: list[npt.NDArray[np.void]] = [np.empty(0, _KEY) for _ in runs]
    while True:
        for r, path in enumerate(runs):
            if not len(held[r]) and read[r] < sizes[r]:
                count = min(block, sizes[r] - read[r])
                held[r] = np.fromfile(path, _KEY, count, offset=read[r] * _KEY.itemsize)
                read[r] += count
        if not any(len(h) for h in held):
            return
        open_runs = [r for r in range(len(runs)) if read[r] < sizes[r] and len(held[r])]
        if open_runs:
            frontier = min(held[r][-1].item() for r in open_runs)
            taken = [h[: _count_not_above(h, frontier)] for h in held]
            held = [h[len(t) :] for h, t in zip(held, taken, strict=True)]
        else:
            taken, held = held, [np.empty(0, _KEY) for _ in runs]
        out = np.concatenate(taken)
        yield out[np.lexsort((out["position"], out["tie"], out["neg_size"], out["label"]))]


def _merge_down(runs: list[str], folder: str, limits: PlanLimits) -> list[str]:
    """Merge runs ``fan_in`` at a time into longer runs until at most ``fan_in`` are left.

    Each merge keeps its blocks large (``merge / fan_in`` keys per run), so a
    billion keys take a few passes over the disk, not a merge of thousands of
    tiny blocks.
    """
    level = 0
    while len(runs) > limits.fan_in:
        merged: list[str] = []
        for start in range(0, len(runs), limits.fan_in):
            batch = runs[start : start + limits.fan_in]
            path = os.path.join(folder, f"run-{level + 1}-{len(merged)}")
            with open(path, "wb") as out:
                for block in _merged(batch, limits):
                    with deferred():  # numpy would turn a Ctrl-C here into a TypeError
                        block.tofile(out)
            for done in batch:
                os.remove(done)
            merged.append(path)
        runs, level = merged, level + 1
    return runs


def _count_not_above(keys: npt.NDArray[np.void], bound: tuple[int, int, float, int]) -> int:
    """How many of the sorted ``keys`` are <= ``bound`` in (label, -size, tie, position) order."""
    label, neg_size, tie, position = bound
    not_above = (keys["label"] < label) | (
        (keys["label"] == label)
        & (
            (keys["neg_size"] < neg_size)
            | (
                (keys["neg_size"] == neg_size)
                & ((keys["tie"] < tie) | ((keys["tie"] == tie) & (keys["position"] <= position)))
            )
        )
    )
    return int(np.count_nonzero(not_above))


def _deal(
    runs: list[str],
    class_sizes: dict[int, int],
    num_shards: int,
    folder: str,
    limits: PlanLimits,
    n: int,
) -> IntArray:
    """Deal the merged stream class by class, as ``plan.deal_class``; returns samples per shard.

    (position, shard) pairs are appended to one file per position range.
    """
    counts = np.zeros(num_shards, dtype=np.int64)
    filled = np.zeros(num_shards, dtype=np.int64)
    label, rank, size_of_class = None, 0, 0
    lightest_first = remainder = np.zeros(0, dtype=np.int64)
    for block in _merged(runs, limits):
        start = 0
        while start < len(block):
            if label is None or rank == size_of_class:  # a new class starts here
                label = int(block["label"][start])
                rank, size_of_class = 0, class_sizes[label]
                lightest_first = np.argsort(filled, kind="stable")
                remainder = np.zeros(0, dtype=np.int64)
            stop = min(len(block), start + size_of_class - rank)
            part = block[start:stop]
            shard = np.empty(len(part), dtype=np.int64)
            ranks = np.arange(rank, rank + len(part))
            full = size_of_class // num_shards * num_shards
            in_rounds = ranks < full
            sizes = -part["neg_size"]
            shard[in_rounds] = lightest_first[ranks[in_rounds] % num_shards]
            if in_rounds.any():
                filled += np.bincount(
                    shard[in_rounds], weights=sizes[in_rounds], minlength=num_shards
                ).astype(np.int64)
            if not in_rounds.all():
                if not len(remainder):  # the class's full rounds are all dealt by now
                    counts += size_of_class // num_shards
                    remainder = remainder_targets(counts, filled, size_of_class - full)
                rest = ~in_rounds
                shard[rest] = remainder[ranks[rest] - full]
                np.add.at(counts, shard[rest], 1)
                np.add.at(filled, shard[rest], sizes[rest])
            elif stop - start + rank == size_of_class:  # a class of full rounds only
                counts += size_of_class // num_shards
            _spill_pairs(folder, part["position"], shard, limits.bucket)
            rank += len(part)
            start = stop
    if int(counts.sum()) != n:
        raise AssertionError(f"plan dealt {int(counts.sum())} of {n} samples")
    return counts


def _spill_pairs(folder: str, positions: IntArray, shards: IntArray, bucket: int) -> None:
    """Append (position, shard) pairs to the file of their position range."""
    pairs = np.empty(len(positions), _PAIR)
    pairs["position"], pairs["shard"] = positions, shards
    which = positions // bucket
    order = np.argsort(which, kind="stable")
    pairs, which = pairs[order], which[order]
    for b in np.unique(which).tolist():
        lo, hi = np.searchsorted(which, [b, b + 1])
        with open(os.path.join(folder, f"pairs-{b}"), "ab") as f:
            f.write(pairs[lo:hi].tobytes())


# --- 3. the shard column ----------------------------------------------------------


def _assemble_shard_column(folder: str, path: str, n: int, limits: PlanLimits) -> None:
    """One shard id (int64) per position, in position order, from the spilled pairs."""
    with open(path, "wb") as out:
        for b, lo in enumerate(range(0, n, limits.bucket)):
            pairs_path = os.path.join(folder, f"pairs-{b}")
            pairs = np.fromfile(pairs_path, _PAIR)
            column = np.full(min(n, lo + limits.bucket) - lo, -1, dtype=np.int64)
            column[pairs["position"] - lo] = pairs["shard"]
            if (column < 0).any():
                raise AssertionError(f"plan: position {lo + int(np.argmin(column))} not dealt")
            out.write(column.tobytes())
            os.remove(pairs_path)


def _separate_copies_on_disk(data: PlanInput, path: str, num_shards: int) -> None:
    """``plan.separate_copies`` on the whole column (weighted builds hold their selection anyway)."""
    shard_of = np.fromfile(path, np.int64)
    source = data.selection.sources(np.arange(len(data), dtype=np.int64))
    labels = np.empty(len(data), dtype=np.int64)
    sizes = np.empty(len(data), dtype=np.int64)
    for lo in range(0, len(data), 1 << 16):
        hi = min(len(data), lo + (1 << 16))
        labels[lo:hi], sizes[lo:hi], _ = data.keys(lo, hi)
    separate_copies(shard_of, labels, sizes, source, num_shards)
    shard_of.tofile(path)


# --- 4. cut per-shard files ---------------------------------------------------------


def _cut(
    data: PlanInput,
    shard_of_path: str,
    counts: IntArray,
    rng: np.random.Generator,
    folder: str,
    limits: PlanLimits,
) -> PlannedShards:
    """Per-shard task files, in write order; shuffled in shard order as ``plan_shards`` does."""
    n = len(data)
    bounds = _group_bounds(counts, limits.group)  # shards bounds[g] .. bounds[g + 1] - 1
    group_paths = [os.path.join(folder, f"group-{g}") for g in range(len(bounds) - 1)]
    for lo in range(0, n, limits.chunk):
        hi = min(n, lo + limits.chunk)
        shard = np.fromfile(shard_of_path, np.int64, hi - lo, offset=lo * 8)
        group = np.searchsorted(bounds, shard, side="right") - 1
        rows, sources = data.rows(lo, hi)
        positions = np.arange(lo, hi, dtype=np.int64)
        for g in np.unique(group).tolist():
            members = np.flatnonzero(group == g)
            with open(group_paths[g], "ab") as f:
                _save_piece(
                    f,
                    rows.subset(members),
                    {
                        "position": positions[members],
                        "shard": shard[members],
                        "source": sources[members],
                    },
                )
    os.remove(shard_of_path)
    shards = PlannedShards(folder, counts, data.inventory, data.selection)
    for g, path in enumerate(group_paths):
        inventory, arrays = _load_pieces(path)
        os.remove(path)
        order = np.argsort(arrays["shard"], kind="stable")  # positions stay ascending per shard
        first = int(bounds[g])
        cuts = np.cumsum(counts[first : int(bounds[g + 1])])[:-1]
        for offset, members in enumerate(np.split(order, cuts)):
            local = shuffle_apart(members, arrays["source"], rng)
            shards.save(first + offset, inventory.subset(local), arrays["position"][local])
    return shards


def _group_bounds(counts: IntArray, limit: int) -> IntArray:
    """Shard indices where groups start (and the shard count last): at most ``limit`` samples each."""
    bounds, total = [0], 0
    for s, count in enumerate(counts.tolist()):
        if total and total + count > limit:
            bounds.append(s)
            total = 0
        total += count
    bounds.append(len(counts))
    return np.array(bounds, dtype=np.int64)


# --- files ------------------------------------------------------------------------

_INVENTORY_ARRAYS = (
    "stem_end",
    "label",
    "container",
    "part_start",
    "part_ext",
    "part_size",
    "part_offset",
)


def _save_piece(f: BinaryIO, inventory: Inventory, arrays: dict[str, np.ndarray]) -> None:
    """Append one piece (an Inventory's columns plus named arrays) to an open file."""
    header = {
        "containers": list(inventory.containers),
        "with_meta": inventory.meta_end is not None,
        "arrays": list(arrays),
    }
    _save(f, np.frombuffer(json.dumps(header).encode(), dtype=np.uint8))
    for name in _INVENTORY_ARRAYS:
        _save(f, getattr(inventory, name))
    _save(f, np.frombuffer(inventory.stem_blob, dtype=np.uint8))
    if inventory.meta_end is not None:
        _save(f, inventory.meta_end)
        _save(f, np.frombuffer(inventory.meta_blob, dtype=np.uint8))
    for values in arrays.values():
        _save(f, values)


# numpy's reads and writes of an open file (np.save, np.load, tofile, fromfile) check whether
# it is a path with ``isinstance(f, os.PathLike)``, Python code; a Ctrl-C landing there comes
# out as ``TypeError: expected str, bytes or os.PathLike object, not BufferedReader``, the
# interrupt gone (numpy 2.4; a fault hunt saw it: a traceback and exit 1). So a Ctrl-C during
# one such call is raised after it (shardprep.format.interrupts.deferred); tested by
# tests/faults/test_disguised_interrupt.py::test_numpy_file_io_keeps_a_ctrl_c.
def _save(f: BinaryIO, values: np.ndarray) -> None:
    with deferred():
        np.save(f, values, allow_pickle=False)


def _load(f: BinaryIO) -> np.ndarray:
    with deferred():
        return np.load(f, allow_pickle=False)  # type: ignore[no-any-return]


def _load_pieces(path: str) -> tuple[Inventory, dict[str, np.ndarray]]:
    """Every piece of a file, concatenated in order."""
    pieces: list[Inventory] = []
    arrays: dict[str, list[np.ndarray]] = {}
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        while f.tell() < size:
            header = json.loads(_load(f).tobytes())
            columns = {name: _load(f) for name in _INVENTORY_ARRAYS}
            stem_blob = _load(f).tobytes()
            meta_end, meta_blob = None, b""
            if header["with_meta"]:
                meta_end = _load(f)
                meta_blob = _load(f).tobytes()
            for name in header["arrays"]:
                arrays.setdefault(name, []).append(_load(f))
            pieces.append(
                Inventory(
                    root="",
                    class_names=None,
                    exts=(),
                    containers=tuple(header["containers"]),
                    stem_blob=stem_blob,
                    meta_blob=meta_blob,
                    meta_end=meta_end,
                    **columns,
                )
            )
    return Inventory.concat(pieces), {k: np.concatenate(v) for k, v in arrays.items()}


class PlannedShards:
    """The plan on disk: one task file per shard (its samples' columns in write order)."""

    def __init__(
        self, folder: str, counts: IntArray, inventory: InventoryView, selection: Selection
    ) -> None:
        self.folder = folder
        self.counts = counts
        self.root = inventory.root
        self.class_names = inventory.class_names
        self.exts = inventory.exts
        self.selection = selection  # None-free only for weighted builds (kept in memory)

    def __len__(self) -> int:
        return len(self.counts)

    def shard_size(self, shard: int) -> int:
        """Samples in shard ``shard``."""
        return int(self.counts[shard])

    def _path(self, shard: int) -> str:
        return os.path.join(self.folder, f"shard-{shard}")

    def save(self, shard: int, rows: Inventory, positions: IntArray) -> None:
        """Save shard ``shard``'s samples (``rows``, at written ``positions``), in write order."""
        selection = self.selection
        arrays: dict[str, np.ndarray] = {"position": positions}
        if selection.copy is not None:
            arrays["copy"] = selection.copy[positions]
        if selection.multiplicity is not None:
            arrays["multiplicity"] = selection.multiplicity[positions]
        if selection.weight is not None:
            arrays["weight"] = selection.weight[selection.sources(positions)]
        with open(self._path(shard), "wb") as f:
            _save_piece(f, rows, arrays)

    def load(self, shard: int) -> tuple[IntArray, Inventory, Selection]:
        """Shard ``shard``: written positions, their inventory rows and selection, in write order."""
        rows, arrays = _load_pieces(self._path(shard))
        inventory = dataclasses.replace(
            rows, root=self.root, class_names=self.class_names, exts=self.exts
        )
        k = len(inventory)
        selection = Selection(
            np.arange(k, dtype=np.int64),
            arrays.get("copy", np.zeros(k, dtype=np.int64)),
            arrays.get("multiplicity"),
            arrays.get("weight"),
            self.selection.section,
        )
        return arrays["position"], inventory, selection
