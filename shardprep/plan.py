"""Plan: decide which sample goes into which shard, and in what order. Pure; no I/O.

Guarantees, for any labels, sizes and ``1 <= num_shards <= num_samples``:

* every sample is in exactly one shard;
* shard sample counts differ by at most 1;
* for every class, each shard holds ``floor(n_c / N)`` or ``ceil(n_c / N)`` of it;
* shard byte totals are even: within one sample's size per class (see below);
* copies of one source sample (``groups``) go to different shards while there
  are at most N of them, and are never adjacent inside a shard;
* the order inside a shard is a seeded shuffle, not grouped by class;
* the result depends only on (labels, sizes, groups, num_shards, seed).

How, on an example: N = 3 shards, class A has 7 samples of sizes
9 8 7 6 5 4 3 (sorted largest first, ties broken randomly). The first 6 are
dealt in rounds over the shards ordered lightest first, say (s0, s1, s2):
9 8 7 then 6 5 4, so s0 gets 15, s1 13, s2 11 bytes and 2 samples each; since
sizes fall, the lightest shard's head start is at most the largest size minus
the smallest. The remainder (3) goes to the shard with the fewest samples so
far, ties broken by fewest bytes: s2. Full rounds keep every class within ±1
per shard; giving each remainder to the least-filled shards keeps the totals
within ±1. Dealing in plain rounds (not back and forth) means any N
consecutive samples of the sorted order, such as the copies of one source,
land on N different shards.
"""

from __future__ import annotations

import itertools

import numpy as np
import numpy.typing as npt

from shardprep.format.errors import PlanError
from shardprep.format.rng import derive_rng

__all__ = ["plan_shards", "remainder_targets", "separate_copies", "shuffle_apart"]

IntArray = npt.NDArray[np.int64]


def plan_shards(
    labels: npt.NDArray[np.integer],
    sizes: npt.NDArray[np.integer],
    num_shards: int,
    seed: int,
    groups: npt.NDArray[np.integer] | None = None,
) -> list[IntArray]:
    """Assign samples to ``num_shards`` shards; returns each shard's sample indices in write order.

    ``labels[i]`` is the class of sample i (all -1 for unlabelled data, which is
    then one group); ``sizes[i]`` its size in bytes; ``groups[i]`` the source
    sample it copies (default: every sample is its own source).

    Raises:
        PlanError: ``num_shards`` is not between 1 and the number of samples.
    """
    n = len(labels)
    if num_shards < 1 or num_shards > n:
        raise PlanError(
            f"cannot make {num_shards} shard(s) from {n} sample(s): "
            f"choose --shards between 1 and {n}"
        )
    rng = derive_rng(seed, "plan")
    label: IntArray = np.asarray(labels, dtype=np.int64)
    size: IntArray = np.asarray(sizes, dtype=np.int64)
    group: IntArray = np.arange(n) if groups is None else np.asarray(groups, dtype=np.int64)
    tiebreak = rng.random(int(group.max()) + 1)[group]
    # Largest first within each class; random among equal sizes; copies of a source together.
    order = np.lexsort((np.arange(n), tiebreak, -size, label))
    class_bounds = np.flatnonzero(np.diff(label[order])) + 1
    shard_of = np.empty(n, dtype=np.int64)
    counts = np.zeros(num_shards, dtype=np.int64)
    filled = np.zeros(num_shards, dtype=np.int64)
    for members in np.split(order, class_bounds):
        _deal_class(members, size, shard_of, counts, filled)
    separate_copies(shard_of, label, size, group, num_shards)
    by_shard = np.argsort(shard_of, kind="stable")
    bounds = np.cumsum(counts)[:-1]
    return [shuffle_apart(part, group, rng) for part in np.split(by_shard, bounds)]


def _deal_class(
    members: IntArray, sizes: IntArray, shard_of: IntArray, counts: IntArray, filled: IntArray
) -> None:
    """Assign one class's samples (sorted largest first), updating counts and bytes in place."""
    num_shards = len(counts)
    rounds, remainder = divmod(len(members), num_shards)
    full = members[: rounds * num_shards]
    if rounds:
        lightest_first = np.argsort(filled, kind="stable")
        targets = lightest_first[np.arange(len(full)) % num_shards]
        shard_of[full] = targets
        counts += rounds
        filled += np.bincount(targets, weights=sizes[full], minlength=num_shards).astype(np.int64)
    if remainder:
        rest = members[rounds * num_shards :]
        targets = remainder_targets(counts, filled, remainder)
        shard_of[rest] = targets
        counts[targets] += 1
        filled[targets] += sizes[rest]


def remainder_targets(counts: IntArray, filled: IntArray, remainder: int) -> IntArray:
    """The shards that take a class's last ``remainder`` samples (sorted largest first), in order.

    Fewest samples first (keeps totals within ±1), then fewest bytes; the
    lightest of them takes the largest sample.
    """
    targets = np.lexsort((filled, counts))[:remainder]
    return targets[np.argsort(filled[targets], kind="stable")]


def separate_copies(
    shard_of: IntArray, labels: IntArray, sizes: IntArray, groups: IntArray, num_shards: int
) -> None:
    """Move copies of a source (with at most ``num_shards`` copies) off shards holding another.

    Dealing in rounds spreads a source's copies, except one that straddles a
    class's last full round and its remainder. Each such copy swaps shards
    with a sample of the same class (closest in size) on a shard without a
    copy of that source, so shard and class counts do not change.
    """
    copies = np.bincount(groups)
    _, first, repeats = np.unique(
        groups * num_shards + shard_of, return_index=True, return_counts=True
    )
    clashing = np.unique(groups[first[repeats > 1]])
    clashing = clashing[copies[clashing] <= num_shards]
    if not len(clashing):
        return
    by_group = np.argsort(groups, kind="stable")
    group_start = np.concatenate([[0], np.cumsum(copies)])
    by_label = np.argsort(labels, kind="stable")
    sorted_labels = labels[by_label]
    for g in clashing:
        members = by_group[group_start[g] : group_start[g + 1]]
        lo, hi = np.searchsorted(sorted_labels, [labels[members[0]], labels[members[0]] + 1])
        same_class = by_label[lo:hi]
        for x in members:
            if np.count_nonzero(shard_of[members] == shard_of[x]) < 2:
                continue
            s = shard_of[x]
            candidates = same_class[~np.isin(shard_of[same_class], shard_of[members])]
            on_s = groups[same_class[shard_of[same_class] == s]]
            # A candidate's own source must have no copy on s (unless it has too many anyway).
            fits = (copies[groups[candidates]] > num_shards) | ~np.isin(groups[candidates], on_s)
            candidates = candidates[fits]
            if not len(candidates):
                continue
            y = candidates[np.argmin(np.abs(sizes[candidates] - sizes[x]))]
            shard_of[x], shard_of[y] = shard_of[y], s


def shuffle_apart(part: IntArray, groups: IntArray, rng: np.random.Generator) -> IntArray:
    """A seeded shuffle of one shard's samples in which no two copies of a source are adjacent.

    After the shuffle, each sample that follows a copy of its own source is
    swapped with the first later sample that fits between different
    neighbours, else with its next neighbour, else it or its twin with an
    earlier sample; if that leaves copies adjacent, the samples are
    interleaved instead. A source holding more than half the shard gets the
    fewest adjacent pairs possible. (Deterministic: the plan stays a pure function.)
    """
    shuffled = rng.permutation(part)
    source = groups[shuffled]
    n = len(shuffled)
    most = int(np.unique(source, return_counts=True)[1].max()) if n else 0
    if most <= 1:
        return shuffled
    if most > (n + 1) // 2:  # some copies must touch: as few pairs of them as possible
        return _around_dominant(shuffled, source)
    for i in range(1, n):
        if source[i] != source[i - 1]:
            continue
        # Move sample i to a later place, else next door, else move either one earlier.
        candidates = itertools.chain(
            ((i, j) for j in range(i + 2, n)),
            ((i, j) for j in range(i + 1, min(i + 2, n))),
            ((p, j) for p in (i, i - 1) for j in range(i - 1) if j != p),
        )
        for a, b in candidates:
            if _swap_fits(source, a, b):
                shuffled[[a, b]] = shuffled[[b, a]]
                source[[a, b]] = source[[b, a]]
                break
    if (source[1:] == source[:-1]).any():  # no single swap fitted: interleave instead
        return _interleave(shuffled, source)
    return shuffled


def _interleave(shuffled: IntArray, source: IntArray) -> IntArray:
    """The samples grouped by source, most copies first, dealt to positions 0, 2, 4, ..., 1, 3, ....

    No two copies of a source end up adjacent when none has more than half the
    samples (rounded up). Ties keep the shuffled order, so the result is still seeded.
    """
    _, first, inverse, counts = np.unique(
        source, return_index=True, return_inverse=True, return_counts=True
    )
    order = np.lexsort((np.arange(len(source)), first[inverse], -counts[inverse]))
    slots = np.concatenate([np.arange(0, len(source), 2), np.arange(1, len(source), 2)])
    result = np.empty_like(shuffled)
    result[slots] = shuffled[order]
    return result


def _around_dominant(shuffled: IntArray, source: IntArray) -> IntArray:
    """The other samples at positions 1, 3, 5, ..., the dominant source's copies everywhere else.

    For a source with k > n/2 copies this leaves 2k - n - 1 adjacent pairs, the fewest possible.
    """
    dominant = np.bincount(source).argmax()
    others = source != dominant
    slots = np.arange(1, 2 * int(others.sum()), 2)
    result = np.empty_like(shuffled)
    result[slots] = shuffled[others]
    rest = np.ones(len(shuffled), dtype=bool)
    rest[slots] = False
    result[rest] = shuffled[~others]
    return result


def _swap_fits(source: IntArray, a: int, b: int) -> bool:
    """Whether swapping positions ``a`` and ``b`` leaves both next to different sources."""
    source[[a, b]] = source[[b, a]]
    last = len(source) - 1
    fits = all(source[k] != source[k + 1] for k in {a - 1, a, b - 1, b} if 0 <= k < last)
    source[[a, b]] = source[[b, a]]
    return fits
