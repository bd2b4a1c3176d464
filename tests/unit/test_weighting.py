"""Class weighting, pure parts: spec parsing, apportioning, the selection, copies in the plan,
and the loader's per-epoch reweighting draws.

Every expected count here is exact; the only tolerance anywhere is the ±1 of
rounding a share to whole samples.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loader.plan.reweight import Reweighting
from shardprep.config import BuildConfig
from shardprep.format.errors import PlanError
from shardprep.plan import plan_shards, shuffle_apart
from shardprep.scan import InputFormat, scan
from shardprep.weighting import apportion, class_targets, parse_class_weights, select_samples

NAMES = ("a", "b", "c")


# --- the spec -----------------------------------------------------------------------


def test_balanced_gives_every_present_class_the_same_weight() -> None:
    assert parse_class_weights("balanced", NAMES, [60, 30, 10]).tolist() == [1 / 3] * 3
    # A class without samples cannot be balanced up; it gets weight 0.
    assert parse_class_weights("balanced", NAMES, [60, 0, 10]).tolist() == [0.5, 0.0, 0.5]


def test_sqrt_is_proportional_to_the_square_root_of_the_class_count() -> None:
    weights = parse_class_weights("sqrt", NAMES, [64, 16, 4])  # roots 8, 4, 2
    assert weights.tolist() == pytest.approx([8 / 14, 4 / 14, 2 / 14], abs=1e-15)


def test_inline_list_is_normalised_and_tolerates_spaces() -> None:
    assert parse_class_weights(" a = 2 , b=1,c=1", NAMES, [1, 1, 1]).tolist() == [
        0.5,
        0.25,
        0.25,
    ]


def test_inline_list_must_name_every_class_unless_zeros_are_allowed() -> None:
    with pytest.raises(PlanError, match=r"no weight to 'c'.*--allow-zero-weights"):
        parse_class_weights("a=2,b=1", NAMES, [5, 5, 5])
    weights = parse_class_weights("a=2,b=1", NAMES, [5, 5, 5], allow_zero=True)
    assert weights.tolist() == [2 / 3, 1 / 3, 0.0]


def test_json_file_is_a_mapping_of_class_to_weight(tmp_path: Path) -> None:
    spec = tmp_path / "weights.json"
    spec.write_text(json.dumps({"a": 1, "b": 3, "c": 0}))
    assert parse_class_weights(str(spec), NAMES, [9, 9, 9]).tolist() == [0.25, 0.75, 0.0]
    # Any existing file is read as JSON, whatever its suffix.
    other = tmp_path / "weights.txt"
    other.write_text(json.dumps({"a": 1, "b": 1, "c": 2}))
    assert parse_class_weights(str(other), NAMES, [9, 9, 9]).tolist() == [0.25, 0.25, 0.5]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("a=1,b=1,c=1,dog=1", r"unknown class\(es\) 'dog'; the classes are: a, b, c"),
        ("a=-1,b=1,c=1", "finite and non-negative"),
        ("a=nan,b=1,c=1", "finite and non-negative"),
        ("a=inf,b=1,c=1", "finite and non-negative"),
        ("a=0,b=0,c=0", "all zero"),
        ("a=two,b=1,c=1", r"weight of 'a' is not a number: 'two'"),
        ("a", "expected 'balanced', 'sqrt', a .json file, or name=weight pairs"),
        ("balance", "expected 'balanced'"),
        ("=1", "expected 'balanced'"),
    ],
)
def test_bad_inline_specs_raise_plan_error(spec: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        parse_class_weights(spec, NAMES, [5, 5, 5])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2, 3]", "must be a JSON object of class name to weight"),
        ('"balanced"', "must be a JSON object"),
        ("{not json", "cannot read a JSON file"),
        ('{"a": "heavy", "b": 1, "c": 1}', "weight of 'a' is not a number"),
        ('{"a": 1, "b": 1, "c": 1, "d": 1}', r"unknown class\(es\) 'd'"),
        ('{"a": 1, "b": -2, "c": 1}', "non-negative"),
    ],
)
def test_bad_weight_files_raise_plan_error(tmp_path: Path, content: str, message: str) -> None:
    spec = tmp_path / "w.json"
    spec.write_text(content)
    with pytest.raises(PlanError, match=message):
        parse_class_weights(str(spec), NAMES, [5, 5, 5])


def test_missing_weight_file_raises_plan_error(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="cannot read a JSON file"):
        parse_class_weights(str(tmp_path / "nope.json"), NAMES, [5, 5, 5])


def test_a_positive_weight_on_an_empty_class_is_refused() -> None:
    with pytest.raises(PlanError, match=r"'b' have no samples to resample from"):
        parse_class_weights("a=1,b=1,c=1", NAMES, [5, 0, 5])


# --- apportioning -------------------------------------------------------------------


def test_apportion_examples() -> None:
    assert apportion(10, np.array([1 / 3] * 3)).tolist() == [4, 3, 3]  # ties by index
    assert apportion(103, np.array([1 / 3] * 3)).tolist() == [35, 34, 34]
    # 3.5 1.75 1.75: floors 3 1 1, then the two largest remainders get one more each
    assert apportion(7, np.array([0.5, 0.25, 0.25])).tolist() == [3, 2, 2]
    assert apportion(5, np.array([1.0, 0.0])).tolist() == [5, 0]


@given(
    total=st.integers(0, 10_000),
    raw=st.lists(st.integers(0, 1000), min_size=1, max_size=12).filter(lambda r: sum(r) > 0),
)
def test_apportion_sums_exactly_and_is_within_one_of_the_share(total: int, raw: list[int]) -> None:
    shares = np.array(raw, dtype=np.float64) / sum(raw)
    counts = apportion(total, shares)
    assert int(counts.sum()) == total
    assert (np.abs(counts - shares * total) < 1).all()
    assert (counts[shares == 0] == 0).all()


def test_class_targets_resample_keeps_the_total_or_takes_the_one_asked() -> None:
    balanced = np.array([1 / 3] * 3)
    assert class_targets([60, 30, 10], balanced, None, False).tolist() == [34, 33, 33]
    assert class_targets([60, 30, 10], balanced, 7, False).tolist() == [3, 2, 2]
    assert class_targets([60, 30, 10], balanced, 1000, False).tolist() == [334, 333, 333]


def test_class_targets_keep_all_is_the_smallest_total_whose_shares_hold_every_class() -> None:
    # The total is the smallest T with T * w_c >= n_c for every class: max(n_c / w_c).
    weights = np.array([0.5, 0.3, 0.2])
    assert class_targets([60, 30, 10], weights, None, True).tolist() == [60, 36, 24]  # 120
    assert class_targets([10, 30, 10], weights, None, True).tolist() == [50, 30, 20]  # 100
    balanced = np.array([1 / 3] * 3)
    assert class_targets([7, 5, 3], balanced, None, True).tolist() == [7, 7, 7]
    for k in range(1, 9):  # balanced keep-all is the largest class times the class count
        for largest in (1, 2, 3, 7, 100, 999):
            counts = [largest] + [1] * (k - 1)
            targets = class_targets(counts, np.full(k, 1 / k), None, True)
            assert targets.tolist() == [largest] * k
    assert class_targets([60, 30, 10], weights, 200, True).tolist() == [100, 60, 40]


def test_class_targets_keep_all_refusals() -> None:
    with pytest.raises(PlanError, match="--num-samples of at least 120"):
        class_targets([60, 30, 10], np.array([0.5, 0.3, 0.2]), 119, True)
    with pytest.raises(PlanError, match="--keep-all cannot give a class weight 0"):
        class_targets([60, 30, 10], np.array([0.5, 0.5, 0.0]), None, True)


# --- the selection --------------------------------------------------------------------


@pytest.fixture
def inventory(make_class_folders: Any) -> Any:
    """12 + 5 + 2 samples in classes a, b, c."""
    return scan(str(make_class_folders({"a": 12, "b": 5, "c": 2})), InputFormat.CLASS_FOLDERS)


def _config(**options: Any) -> BuildConfig:
    return BuildConfig(shards=3, **options)


def test_without_class_weights_every_sample_is_selected_once(inventory: Any) -> None:
    selection = select_samples(inventory, _config())
    assert selection.source is None  # nothing per sample: written sample i is inventory sample i
    assert len(selection) == 19
    assert selection.sources(np.arange(19)).tolist() == list(range(19))
    assert selection.copies(np.arange(19)).tolist() == [0] * 19
    assert selection.manifest_section(inventory) == {}


def test_resample_counts_copies_and_multiplicities(inventory: Any) -> None:
    selection = select_samples(inventory, _config(class_weights="balanced", seed=3))
    labels = inventory.label[selection.source]
    assert np.bincount(labels).tolist() == [7, 6, 6]  # apportion(19, 1/3 each)
    per_source = Counter(selection.source.tolist())
    for c, (members, target) in enumerate([(range(12), 7), (range(12, 17), 6), (range(17, 19), 6)]):
        m = [per_source.get(i, 0) for i in members]
        assert sum(m) == target
        assert max(m) - min(m) <= 1, f"class {c}: copies not spread evenly: {m}"
    assert sum(1 for i in range(12) if i in per_source) == 7  # a: 7 of 12 kept, none copied
    assert sorted(per_source[i] for i in range(12, 17)) == [1, 1, 1, 1, 2]
    assert [per_source[i] for i in (17, 18)] == [3, 3]
    # Copy numbers of a source are exactly 0..m-1; multiplicity is m on every copy.
    assert selection.multiplicity is not None
    seen: dict[int, list[int]] = {}
    for s, k, m in zip(selection.source, selection.copy, selection.multiplicity, strict=True):
        seen.setdefault(int(s), []).append(int(k))
        assert m == per_source[int(s)]
    assert all(sorted(ks) == list(range(len(ks))) for ks in seen.values())
    assert selection.manifest_section(inventory) == {
        "class_weighting": {
            "spec": "balanced",
            "target_weights": [0.333333333] * 3,
            "original_counts": [12, 5, 2],
            "mode": "resample",
            "realized_counts": [7, 6, 6],
            "dropped_samples": 5,
        }
    }


def test_copy_keys_are_key_dash_r_copy_number(inventory: Any) -> None:
    selection = select_samples(inventory, _config(class_weights="balanced"))
    positions = np.arange(len(selection))
    refs = selection.samples(inventory, positions)
    for ref, s, k in zip(refs, selection.source, selection.copy, strict=True):
        original = inventory.key(int(s))
        assert ref.key == (original if k == 0 else f"{original}-r{k}")
        assert ref.copy == k
    assert len({ref.key for ref in refs}) == len(refs)


def test_num_samples_sets_the_total(inventory: Any) -> None:
    selection = select_samples(inventory, _config(class_weights="a=1,b=1,c=2", num_samples=40))
    assert np.bincount(inventory.label[selection.source]).tolist() == [10, 10, 20]


def test_keep_all_keeps_every_original(inventory: Any) -> None:
    selection = select_samples(inventory, _config(class_weights="balanced", keep_all=True))
    assert sorted(set(selection.source.tolist())) == list(range(19))
    assert np.bincount(inventory.label[selection.source]).tolist() == [12, 12, 12]
    section = selection.manifest_section(inventory)["class_weighting"]
    assert (section["mode"], section["dropped_samples"]) == ("keep-all", 0)


def test_weights_only_keeps_the_data_and_weighs_each_sample(inventory: Any) -> None:
    selection = select_samples(inventory, _config(class_weights="balanced", weights_only=True))
    assert selection.source.tolist() == list(range(19))
    assert selection.weight is not None
    expected = {0: 19 / 36, 1: 19 / 15, 2: 19 / 6}  # (1/3) / (n_c / 19)
    for i in range(19):
        assert selection.weight[i] == pytest.approx(expected[int(inventory.label[i])], rel=1e-12)
    assert float(selection.weight.sum()) == pytest.approx(19)  # mean weight 1
    section = selection.manifest_section(inventory)["class_weighting"]
    assert section["mode"] == "weights-only"
    assert section["class_sample_weights"] == [0.527778, 1.26667, 3.16667]
    assert section["realized_counts"] == [12, 5, 2]
    refs = selection.samples(inventory, np.arange(19))
    assert refs[0].weight == b"0.527778" and refs[18].weight == b"3.16667"


def test_the_selection_is_a_function_of_the_seed(inventory: Any) -> None:
    def choice(seed: int) -> list[int]:
        selection = select_samples(inventory, _config(class_weights="balanced", seed=seed))
        return [int(i) for i in selection.source]

    assert choice(5) == choice(5)
    assert len({tuple(choice(seed)) for seed in range(6)}) > 1


def test_unlabelled_data_cannot_be_weighted(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(4):
        (raw / f"{i:03d}.bin").write_bytes(b"x" * i)
    inventory = scan(str(raw), InputFormat.KEYED)
    with pytest.raises(PlanError, match="needs labelled data"):
        select_samples(inventory, _config(class_weights="balanced"))


# --- copies in the plan -----------------------------------------------------------------


@st.composite
def resampled(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """(labels, sizes, groups, num_shards, seed) of a resampled selection."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    labels, sizes, groups = [], [], []
    source = 0
    for c in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 8))
        base, extra = divmod(draw(st.integers(1, 6 * n)), n)  # as weighting spreads copies
        multiplicity = np.full(n, base)
        multiplicity[rng.choice(n, extra, replace=False)] += 1
        for m in multiplicity.tolist():
            size = int(rng.integers(1, 5)) * 512
            labels += [c] * m
            sizes += [size] * m
            groups += [source] * m
            source += 1
    num_shards = draw(st.integers(1, min(8, len(labels))))
    return (
        np.array(labels),
        np.array(sizes),
        np.array(groups),
        num_shards,
        draw(st.integers(0, 1000)),
    )


@given(resampled())
def test_copies_are_balanced_spread_over_shards_and_never_adjacent(
    case: tuple[np.ndarray, np.ndarray, np.ndarray, int, int],
) -> None:
    labels, sizes, groups, num_shards, seed = case
    plan = plan_shards(labels, sizes, num_shards, seed, groups=groups)
    assert sorted(np.concatenate(plan).tolist()) == list(range(len(labels)))
    counts = [len(p) for p in plan]
    assert max(counts) - min(counts) <= 1
    per_class = np.bincount(labels)
    for part in plan:
        held = np.bincount(labels[part], minlength=len(per_class))
        assert ((held == per_class // num_shards) | (held == -(-per_class // num_shards))).all()
    copies = np.bincount(groups)
    shard_of = np.empty(len(labels), dtype=np.int64)
    for shard, part in enumerate(plan):
        shard_of[part] = shard
        order = groups[part]
        touching = int((order[1:] == order[:-1]).sum())
        # None, unless one source holds k > half of the shard: then the fewest possible.
        assert touching == max(0, 2 * int(np.bincount(order).max()) - len(order) - 1), shard
    for g in np.flatnonzero((copies > 1) & (copies <= num_shards)):
        where = shard_of[groups == g].tolist()
        assert len(set(where)) == len(where), f"source {g} twice on one shard: {where}"


def test_a_source_straddling_a_round_and_the_remainder_still_gets_distinct_shards() -> None:
    # Two sources of 2 copies over 3 shards: the first round deals A A B, the
    # remainder (the second B) goes to the lightest shard, the one B is on.
    groups = np.array([0, 0, 1, 1])
    sizes = np.array([2, 2, 1, 1]) * 512
    for seed in range(10):
        plan = plan_shards(np.zeros(4, dtype=np.int64), sizes, 3, seed, groups=groups)
        assert sorted(len(p) for p in plan) == [1, 1, 2]
        for part in plan:
            assert len(set(groups[part].tolist())) == len(part), f"seed {seed}: {plan}"


class _Identity:
    """A stand-in generator whose permutation keeps the order (to pin down the shuffle)."""

    def permutation(self, x: np.ndarray) -> np.ndarray:
        return np.array(x, dtype=np.int64)


@pytest.mark.parametrize(
    "groups",
    [
        [7, 3, 3],  # the twins at the very end: only an earlier sample can separate them
        [0, 1, 1],
        [1, 2, 0, 0, 1],
        [1, 0, 1, 0, 0, 1, 0, 1],  # two sources of 4 in 8: only a full interleave works
        [3, 4, 3, 2, 4, 3, 1, 4, 3, 4, 4],
        [5, 5, 5, 1, 2],  # 3 of 5: the only way is 5 ? 5 ? 5
    ],
)
def test_shuffle_apart_separates_every_separable_shard(groups: list[int]) -> None:
    source = np.array(groups)
    order = shuffle_apart(np.arange(len(groups)), source, _Identity())  # type: ignore[arg-type]
    assert sorted(order.tolist()) == list(range(len(groups)))
    placed = source[order]
    assert not (placed[1:] == placed[:-1]).any(), placed.tolist()


# --- read-time reweighting (loader.plan.reweight) ---------------------------------------------


SHARD_COUNTS = [[5, 1, 0], [5, 1, 1], [4, 2, 1]]  # per shard, classes a, b, c: 14, 4, 2


def _labels(counts: list[int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(len(counts)), counts))


def test_reweighting_targets_are_apportioned_by_class_then_by_shard() -> None:
    reweighting = Reweighting("balanced", NAMES, SHARD_COUNTS)
    # 20 samples, 1/3 each -> 7, 7, 6; each class split over the shards it lives in.
    assert reweighting.shard_targets.sum(axis=0).tolist() == [7, 7, 6]
    assert reweighting.shard_targets.tolist() == [[3, 2, 0], [2, 2, 3], [2, 3, 3]]
    assert reweighting.shard_sizes() == [5, 7, 8]
    assert reweighting.class_weight.tolist() == pytest.approx([20 / 42, 20 / 12, 20 / 6])
    total = Reweighting("a=1,b=1,c=2", NAMES, SHARD_COUNTS, total=40)
    assert total.shard_targets.sum(axis=0).tolist() == [10, 10, 20]


def test_reweighting_draws_exact_counts_in_stream_order_and_new_ones_each_epoch() -> None:
    reweighting = Reweighting("balanced", NAMES, SHARD_COUNTS)
    draws: dict[int, list[list[int]]] = {}
    for shard, counts in enumerate(SHARD_COUNTS):
        labels = _labels(counts, shard)
        for epoch in range(4):
            ids = reweighting.sample_ids(labels, shard, seed=1, epoch=epoch)
            assert (np.diff(ids) >= 0).all()  # still one sequential pass over the shard
            held = np.bincount(labels[ids], minlength=3).tolist()
            assert held == reweighting.shard_targets[shard].tolist()
            for c in range(3):
                m = np.bincount(ids, minlength=len(labels))[labels == c]
                if len(m):
                    assert m.max() - m.min() <= 1  # repeats spread evenly within a class
            assert ids.tolist() == reweighting.sample_ids(labels, shard, 1, epoch).tolist()
            draws.setdefault(shard, []).append(ids.tolist())
    # Shard 0 keeps 3 of its 5 "a" samples: the choice changes between epochs.
    assert len({tuple(d) for d in draws[0]}) > 1


def test_shuffle_apart_spreads_a_source_that_cannot_be_separated() -> None:
    source = np.array([0, 0, 0, 0, 1, 2])  # 4 of 6: at least one pair must touch
    placed = source[shuffle_apart(np.arange(6), source, _Identity())]  # type: ignore[arg-type]
    assert placed.tolist() == [0, 1, 0, 2, 0, 0]  # one touching pair: the fewest possible


@pytest.mark.parametrize("spec", ["a=1,a=2", "b=1, b =3"])
def test_inline_spec_naming_a_class_twice_is_refused(spec: str) -> None:
    with pytest.raises(PlanError, match="twice"):
        parse_class_weights(spec, ("a", "b"), [3, 4])


def test_json_booleans_are_not_weights(tmp_path: Path) -> None:
    spec = tmp_path / "w.json"
    spec.write_text('{"a": true, "b": 1}')
    with pytest.raises(PlanError, match="not a number"):
        parse_class_weights(str(spec), ("a", "b"), [3, 4])
