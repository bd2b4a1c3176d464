"""Class weighting end to end: ``build --class-weights`` (resample, --keep-all, --weights-only),
its manifest and index records, its errors, ``inspect`` (and ``--plot``), and read-time
reweighting with ``ShardDataset(class_weights=...)``.

The input is 40 + 12 + 5 = 57 samples in classes a, b, c (``payload`` bytes, so
every copy can be checked against its source). Expected counts are exact.
"""

from __future__ import annotations

import json
import re
import sys
import tarfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.utils.data
from click.testing import CliRunner, Result

import shardprep
from loader import IncompatibleStateError, ShardDataset
from shardprep.cli import cli
from shardprep.format.errors import DuplicateKeyError, PlanError
from shardprep.format.manifest import read_manifest
from shardprep.format.shardformat import decode_index
from shardprep.verify import verify_output
from shardprep.weighting import apportion
from tests.conftest import payload
from tests.processes import run_bounded

COUNTS = {"a": 40, "b": 12, "c": 5}
CLASSES = {"a": 0, "b": 1, "c": 2}
SHARDS = 4


@pytest.fixture
def raw(make_class_folders: Callable[..., Path]) -> Path:
    return make_class_folders(COUNTS)


def _build(raw: Path, out: Path, **options: Any) -> Path:
    options = {"shards": SHARDS, "workers": 1, "progress": False, **options}
    shardprep.build(str(raw), str(out), **options)
    return out


def _invoke(*args: str) -> Result:
    result = CliRunner().invoke(cli, list(args))
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


@dataclass
class Written:
    """One written sample, from the shard index and the tar."""

    shard: int
    position: int
    key: str
    label: int
    copy: int
    multiplicity: int
    source: str
    members: dict[str, bytes] = field(default_factory=dict)


def _read(out: Path) -> list[list[Written]]:
    """Every shard's samples in order, with their index columns and tar members."""
    shards = []
    for s, entry in enumerate(read_manifest(str(out)).shards):
        index = decode_index((out / entry.index_file).read_bytes())
        samples = [
            Written(
                s,
                i,
                index.key(i),
                int(index.label[i]),
                int(index.copy[i]),
                int(index.multiplicity[i]),
                index.source(i),
            )
            for i in range(index.num_samples)
        ]
        with tarfile.open(out / entry.file) as tar:
            members = [(m.name, tar.extractfile(m).read()) for m in tar]  # type: ignore[union-attr]
        position = -1
        previous = None
        for name, data in members:
            key, ext = name.split(".", 1)
            if key != previous:
                position, previous = position + 1, key
            assert samples[position].key == key
            samples[position].members[ext] = data
        assert position + 1 == len(samples)
        shards.append(samples)
    return shards


def _original(sample: Written) -> tuple[str, int]:
    """(class, index) of the raw file a written sample comes from."""
    cls, name = sample.source.split("/")
    return cls, int(name.split(".")[0])


def _check_balance(out: Path, realized: list[int]) -> list[list[Written]]:
    """Shard totals ±1, each class floor/ceil of its share per shard, copies apart; the shards."""
    shards = _read(out)
    sizes = [len(s) for s in shards]
    assert sorted(sizes) == sorted(apportion(sum(realized), np.full(SHARDS, 1 / SHARDS)).tolist())
    for samples in shards:
        held = np.bincount([w.label for w in samples], minlength=3)
        for c, total in enumerate(realized):
            assert total // SHARDS <= held[c] <= -(-total // SHARDS), (c, held.tolist())
        sources = [w.source for w in samples]
        assert all(a != b for a, b in zip(sources, sources[1:], strict=False)), "side by side"
    where: dict[str, list[int]] = {}
    for samples in shards:
        for w in samples:
            where.setdefault(w.source, []).append(w.shard)
    for source, shard_list in where.items():
        if len(shard_list) <= SHARDS:
            assert len(set(shard_list)) == len(shard_list), f"{source}: copies share a shard"
    manifest = read_manifest(str(out))
    assert list(manifest.class_counts) == realized
    assert [list(e.class_counts) for e in manifest.shards] == [
        np.bincount([w.label for w in s], minlength=3).tolist() for s in shards
    ]
    assert verify_output(str(out), progress=False).problems == []
    return shards


# --- resample (the default mode) -------------------------------------------------------


def test_balanced_resample_follows_the_weights_and_records_everything(
    raw: Path, tmp_path: Path
) -> None:
    out = _build(raw, tmp_path / "out", class_weights="balanced")
    manifest = read_manifest(str(out))
    assert manifest.extra["class_weighting"] == {
        "spec": "balanced",
        "target_weights": [0.333333333, 0.333333333, 0.333333333],
        "original_counts": [40, 12, 5],
        "mode": "resample",
        "realized_counts": [19, 19, 19],
        "dropped_samples": 21,
    }
    shards = _check_balance(out, [19, 19, 19])
    samples = [w for s in shards for w in s]
    assert len(samples) == 57  # the total defaults to the input's sample count
    by_source = Counter(w.source for w in samples)
    for w in samples:
        cls, index = _original(w)
        original_key = f"{cls}__{index:05d}"
        assert w.key == (original_key if w.copy == 0 else f"{original_key}-r{w.copy}")
        assert w.label == CLASSES[cls]
        assert w.members["bin"] == payload(CLASSES[cls], index)  # a copy holds its source's bytes
        assert w.members["cls"] == str(CLASSES[cls]).encode()
        assert "weight" not in w.members
        assert w.multiplicity == by_source[w.source]
    assert len({w.key for w in samples}) == 57
    for source, m in by_source.items():
        assert sorted(w.copy for w in samples if w.source == source) == list(range(m))
    # a: 19 of 40 kept once; b: 12 -> 19 (7 twice); c: 5 -> 19 (4 four times, 1 three times)
    per_class = {c: sorted(m for s, m in by_source.items() if s.startswith(c)) for c in COUNTS}
    assert per_class == {"a": [1] * 19, "b": [1] * 5 + [2] * 7, "c": [3] + [4] * 4}


def test_num_samples_and_an_inline_spec_set_the_counts(raw: Path, tmp_path: Path) -> None:
    out = _build(raw, tmp_path / "out", class_weights="a=2,b=1,c=1", num_samples=101)
    section = read_manifest(str(out)).extra["class_weighting"]
    assert section["target_weights"] == [0.5, 0.25, 0.25]
    assert section["realized_counts"] == [51, 25, 25]  # 50.5, 25.25, 25.25
    assert section["dropped_samples"] == 0  # 51 > 40: every a is kept, some twice
    _check_balance(out, [51, 25, 25])


def test_a_smaller_total_undersamples_every_class(raw: Path, tmp_path: Path) -> None:
    out = _build(raw, tmp_path / "out", class_weights="sqrt", num_samples=20)
    section = read_manifest(str(out)).extra["class_weighting"]
    roots = np.sqrt([40, 12, 5])
    assert section["target_weights"] == [round(float(r), 9) for r in roots / roots.sum()]
    assert section["realized_counts"] == apportion(20, roots / roots.sum()).tolist() == [10, 6, 4]
    shards = _check_balance(out, [10, 6, 4])
    assert all(w.copy == 0 and w.multiplicity == 1 for s in shards for w in s)
    assert section["dropped_samples"] == 37


def test_keep_all_loses_no_original_sample(raw: Path, tmp_path: Path) -> None:
    out = _build(raw, tmp_path / "out", class_weights="balanced", keep_all=True)
    section = read_manifest(str(out)).extra["class_weighting"]
    assert (section["mode"], section["realized_counts"], section["dropped_samples"]) == (
        "keep-all",
        [40, 40, 40],
        0,
    )
    shards = _check_balance(out, [40, 40, 40])
    originals = {w.key for s in shards for w in s if w.copy == 0}
    assert originals == {f"{c}__{i:05d}" for c, i in _all_inputs()}
    # c: 5 samples x 8 copies > 4 shards, so two per shard, still never side by side.
    assert Counter(w.multiplicity for s in shards for w in s if w.label == 2) == {8: 40}


def test_keep_all_with_a_total_too_small_is_a_usage_error(raw: Path, tmp_path: Path) -> None:
    result = _invoke(
        "build", str(raw), str(tmp_path / "out"), "-n", "4", "-j", "1", "-q",
        "--class-weights", "balanced", "--keep-all", "--num-samples", "119",
    )  # fmt: skip
    assert result.exit_code == 2
    assert "--keep-all needs --num-samples of at least 120" in result.output
    with pytest.raises(PlanError, match="^keep_all= needs num_samples= of at least 120 "):
        _build(raw, tmp_path / "api", class_weights="balanced", keep_all=True, num_samples=119)
    out = _build(raw, tmp_path / "ok", class_weights="balanced", keep_all=True, num_samples=150)
    assert read_manifest(str(out)).extra["class_weighting"]["realized_counts"] == [50, 50, 50]


def _all_inputs() -> list[tuple[str, int]]:
    index, result = 0, []
    for cls, count in sorted(COUNTS.items()):
        for _ in range(count):
            result.append((cls, index))
            index += 1
    return result


# --- weights-only -------------------------------------------------------------------------


def test_weights_only_keeps_the_data_and_writes_each_samples_weight(
    raw: Path, tmp_path: Path
) -> None:
    out = _build(raw, tmp_path / "out", class_weights="balanced", weights_only=True)
    section = read_manifest(str(out)).extra["class_weighting"]
    assert section == {
        "spec": "balanced",
        "target_weights": [0.333333333, 0.333333333, 0.333333333],
        "original_counts": [40, 12, 5],
        "mode": "weights-only",
        "class_sample_weights": [0.475, 1.58333, 3.8],  # (1/3) / (n_c / 57)
        "realized_counts": [40, 12, 5],
    }
    shards = _check_balance(out, [40, 12, 5])
    samples = [w for s in shards for w in s]
    assert sorted(w.key for w in samples) == sorted(f"{c}__{i:05d}" for c, i in _all_inputs())
    expected = {0: b"0.475", 1: b"1.58333", 2: b"3.8"}
    for w in samples:
        assert (w.copy, w.multiplicity) == (0, 1)
        assert w.members["weight"] == expected[w.label]
        assert re.fullmatch(rb"[0-9]+(\.[0-9]+)?", w.members["weight"])  # plain decimal text
    assert sum(float(w.members["weight"]) for w in samples) == pytest.approx(57, abs=1e-3)


# --- determinism ---------------------------------------------------------------------------


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.mark.parametrize(
    "options",
    [
        {"class_weights": "balanced"},
        {"class_weights": "a=1,b=2,c=3", "keep_all": True, "compression": "zstd"},
        {"class_weights": "sqrt", "weights_only": True},
    ],
)
def test_rebuilds_are_byte_identical_with_one_or_two_workers(
    raw: Path, tmp_path: Path, options: dict[str, Any]
) -> None:
    one = _files(_build(raw, tmp_path / "one", workers=1, seed=7, **options))
    two = _files(_build(raw, tmp_path / "two", workers=2, seed=7, **options))
    assert one.keys() == two.keys() and len(one) == 2 * SHARDS + 1
    assert one == two


def test_the_seed_chooses_which_samples_are_dropped_and_copied(raw: Path, tmp_path: Path) -> None:
    def chosen(seed: int, name: str) -> Counter[str]:
        out = _build(raw, tmp_path / name, class_weights="balanced", seed=seed)
        return Counter(w.source for s in _read(out) for w in s)

    first = chosen(0, "first")
    assert chosen(0, "again") == first
    assert chosen(1, "other") != first


# --- specs and errors ----------------------------------------------------------------------


def test_cli_reads_a_json_weight_file(raw: Path, tmp_path: Path) -> None:
    spec = tmp_path / "weights.json"
    spec.write_text(json.dumps({"a": 1, "b": 1, "c": 2}))
    out = tmp_path / "out"
    result = _invoke(
        "build", str(raw), str(out), "-n", "4", "-j", "1", "-q", "--class-weights", str(spec)
    )
    assert result.exit_code == 0, result.output
    section = read_manifest(str(out)).extra["class_weighting"]
    assert (section["target_weights"], section["realized_counts"]) == (
        [0.25, 0.25, 0.5],
        [14, 14, 29],  # 14.25, 14.25, 28.5: the largest remainder gets the one left
    )


def test_allow_zero_weights_leaves_unnamed_classes_out(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = _invoke(
        "build", str(raw), str(out), "-n", "4", "-j", "1", "-q",
        "--class-weights", "a=1,b=1", "--allow-zero-weights",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    shards = _check_balance(out, [29, 28, 0])
    assert not any(w.label == 2 for s in shards for w in s)
    manifest = read_manifest(str(out))
    assert manifest.class_names == ("a", "b", "c")  # the class is still listed, with 0 samples


BAD_SPECS = [
    (["--class-weights", "a=1,b=1,c=1,dog=1"], r"unknown class\(es\) 'dog'"),
    (["--class-weights", "a=1,b=-1,c=1"], "finite and non-negative"),
    (["--class-weights", "a=0,b=0,c=0"], "all zero"),
    (["--class-weights", "a=2,b=1"], r"no weight to 'c'.*--allow-zero-weights"),
    (["--class-weights", "heavy"], "expected 'balanced', 'sqrt'"),
    (["--class-weights", "{file}"], "must be a JSON object of class name to weight"),
    (["--num-samples", "10"], "need --class-weights"),
    (["--keep-all"], "need --class-weights"),
    (["--weights-only"], "need --class-weights"),
    (["--class-weights", "balanced", "--keep-all", "--weights-only"], "exclude each other"),
    (["--class-weights", "balanced", "--weights-only", "--num-samples", "9"], "exclude each other"),
    (["--class-weights", "balanced", "--keep-all", "--num-samples", "5"], "at least 120"),
    (["--class-weights", "a=1,b=1", "--allow-zero-weights", "--keep-all"], "weight 0"),
    (["--class-weights", "balanced", "--num-samples", "3"], "cannot make 4 shard"),
]


@pytest.mark.parametrize(("args", "message"), BAD_SPECS)
def test_bad_specs_are_usage_errors_before_any_output(
    raw: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2, 3]")
    args = [a.replace("{file}", str(listing)) for a in args]
    out = tmp_path / "out"
    result = _invoke("build", str(raw), str(out), "-n", "4", "-j", "1", "-q", *args)
    assert result.exit_code == 2, result.output
    assert re.search(message, result.output), result.output
    assert not out.exists()


@pytest.mark.parametrize(
    "options",
    [
        {"class_weights": "a=1,b=1,c=1,dog=1"},
        {"class_weights": "a=-1,b=1,c=1"},
        {"class_weights": "a=0,b=0,c=0"},
        {"class_weights": "[1]"},
        {"keep_all": True},
        {"class_weights": "balanced", "weights_only": True, "num_samples": 9},
    ],
)
def test_bad_specs_raise_plan_error_from_the_api(
    raw: Path, tmp_path: Path, options: dict[str, Any]
) -> None:
    with pytest.raises(PlanError):
        _build(raw, tmp_path / "out", **options)


def test_class_weights_on_unlabelled_data_is_a_usage_error(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(8):
        (raw / f"{i:03d}.bin").write_bytes(payload(0, i))
    result = _invoke(
        "build", str(raw), str(tmp_path / "out"), "-n", "2", "-j", "1", "-q",
        "--format", "keyed", "--class-weights", "balanced",
    )  # fmt: skip
    assert result.exit_code == 2
    assert "--class-weights needs labelled data" in result.output
    with pytest.raises(PlanError, match="^class_weights= needs labelled data"):
        _build(raw, tmp_path / "api", shards=2, input_format="keyed", class_weights="balanced")


@pytest.mark.parametrize("spec", ["balanced", "sqrt", "only=2"])
def test_class_weights_on_one_class_are_a_usage_error(
    make_class_folders: Callable[..., Path], tmp_path: Path, spec: str
) -> None:
    raw = make_class_folders({"only": 6})
    result = _invoke(
        "build", str(raw), str(tmp_path / "out"), "-n", "2", "-j", "1", "-q",
        "--class-weights", spec,
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert (
        "class weights need at least two classes with samples, and this data has one ('only'): "
        "weighting would change nothing; leave out the class weights"
    ) in result.output
    assert not (tmp_path / "out").exists()
    with pytest.raises(PlanError, match="at least two"):
        _build(raw, tmp_path / "api", shards=2, class_weights=spec)


def test_a_copy_key_that_an_input_already_has_is_refused(
    make_class_folders: Callable[..., Path], tmp_path: Path
) -> None:
    raw = make_class_folders({"a": 6, "b": 1})  # b/00006.bin; its copy 1 is b__00006-r1
    (raw / "b" / "00006-r1.bin").write_bytes(b"clash")  # b now has 2 samples, so 2 copies each
    with pytest.raises(DuplicateKeyError, match="b__00006-r1"):
        _build(raw, tmp_path / "out", shards=2, class_weights="balanced", num_samples=12)
    assert not (tmp_path / "out").exists()
    # Without copies (an undersampled b) nothing clashes.
    _build(raw, tmp_path / "ok", shards=2, class_weights="a=1,b=0", allow_zero_weights=True)


# --- inspect ----------------------------------------------------------------------------------


def test_inspect_shows_before_and_after(raw: Path, tmp_path: Path) -> None:
    out = _build(raw, tmp_path / "out", class_weights="balanced")
    result = _invoke("inspect", str(out))
    assert result.exit_code == 0
    assert "class weighting: resample" in result.output
    assert "original counts: [40, 12, 5]" in result.output
    assert "realized counts: [19, 19, 19]" in result.output
    data = json.loads(_invoke("inspect", "--json", str(out)).output)
    assert data["class_weighting"]["realized_counts"] == [19, 19, 19]
    assert [s["class_counts"] for s in data["shards"]] == [
        list(e.class_counts) for e in read_manifest(str(out)).shards
    ]


def test_inspect_plot_draws_a_png(raw: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    weighted = _build(raw, tmp_path / "weighted", class_weights="balanced")
    plain = _build(raw, tmp_path / "plain")
    for out in (weighted, plain):
        png = tmp_path / f"{out.name}.png"
        result = _invoke("inspect", str(out), "--plot", str(png))
        assert result.exit_code == 0, result.output
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert 2_000 < len(data) < 200_000
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        # before + after panels side by side when reweighted, one panel otherwise
        assert (width, height) == ((1200, 400) if out is weighted else (600, 400))


def test_inspect_plot_of_unlabelled_data_is_an_error(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(4):
        (raw / f"{i:03d}.bin").write_bytes(payload(0, i))
    out = _build(raw, tmp_path / "out", shards=2, input_format="keyed")
    result = _invoke("inspect", str(out), "--plot", str(tmp_path / "x.png"))
    assert result.exit_code == 1
    assert "unlabelled data has no class histogram" in result.output
    assert not (tmp_path / "x.png").exists()


ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_figure_is_small_and_its_script_runs(tmp_path: Path) -> None:
    assert 2_000 < (ROOT / "docs" / "class-weights.png").stat().st_size < 200_000
    pytest.importorskip("matplotlib")
    png = tmp_path / "figure.png"
    script = ROOT / "docs" / "make_class_weights_plot.py"
    done = run_bounded(
        [sys.executable, str(script), "--out", str(png), "--samples", "200", "--shards", "4"],
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "original counts: [109, 51, 24, 11, 5]" in done.stdout
    assert "realized counts: [40, 40, 40, 40, 40]" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- read-time reweighting ---------------------------------------------------------------------


@pytest.fixture
def plain(raw: Path, tmp_path: Path) -> Path:
    """The input built without weighting: 57 samples, classes 40/12/5."""
    return _build(raw, tmp_path / "plain")


def _epoch(ds: ShardDataset, workers: int = 0) -> list[dict[str, Any]]:
    loader = torch.utils.data.DataLoader(
        ds, batch_size=4, num_workers=workers, collate_fn=lambda b: b
    )
    return [s for batch in loader for s in batch]


def _class_counts(samples: list[dict[str, Any]]) -> list[int]:
    return [int(c) for c in np.bincount([int(s["cls"]) for s in samples], minlength=3)]


def test_read_time_reweighting_hits_the_targets_exactly_each_epoch(plain: Path) -> None:
    ds = ShardDataset(str(plain), class_weights="balanced", shuffle_buffer=8, block_size=4)
    assert ds.num_samples == 57
    epochs = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        samples = _epoch(ds, workers=2)
        assert len(samples) == 57
        assert _class_counts(samples) == [19, 19, 19]  # one process: exactly the targets
        for s in samples:
            cls, index = s["__key__"].split("__")
            assert s["bin"] == payload(CLASSES[cls], int(index))
        keys = Counter(s["__key__"] for s in samples)
        assert len([k for k in keys if k.startswith("a")]) == 19  # a undersampled: no repeats
        assert max(keys.values()) == 4  # c: 5 samples drawn 19 times -> 3 or 4 each
        epochs.append(keys)
        # The multiset of an epoch does not depend on the number of DataLoader workers.
        assert Counter(s["__key__"] for s in _epoch(ds, workers=0)) == keys
    assert epochs[0] != epochs[1] != epochs[2]
    # Deterministic: a fresh dataset draws the same epoch in the same order.
    first, second = (
        ShardDataset(str(plain), class_weights="balanced", shuffle_buffer=8, block_size=4)
        for _ in range(2)
    )
    assert [s["__key__"] for s in _epoch(first)] == [s["__key__"] for s in _epoch(second)]


def test_read_time_reweighting_gives_every_rank_the_same_count(plain: Path) -> None:
    # 4 ranks, uneven="drop": 57 // 4 = 14 each, one sample of the epoch left out.
    ranks = [
        ShardDataset(str(plain), class_weights="balanced", rank=r, world_size=4, block_size=4)
        for r in range(4)
    ]
    per_rank = [_epoch(ds) for ds in ranks]
    assert [ds.num_samples for ds in ranks] == [len(s) for s in per_rank] == [14] * 4
    union = _class_counts([s for samples in per_rank for s in samples])
    assert sum(union) == 56
    assert all(t - 1 <= u <= t for u, t in zip(union, [19, 19, 19], strict=True))


def test_read_time_draw_does_not_depend_on_the_world_size(plain: Path) -> None:
    """The multiset an epoch draws is the same at 1, 2 or 4 ranks: with uneven="pad" the real
    (unpadded) samples of all ranks together are exactly the one-rank epoch's draw."""
    options: dict[str, Any] = {"class_weights": "sqrt", "block_size": 4, "uneven": "pad"}
    for epoch in (0, 1):
        one = ShardDataset(str(plain), **options)
        one.set_epoch(epoch)
        drawn = Counter(s["__key__"] for s in _epoch(one))
        assert sum(drawn.values()) == 57 and max(drawn.values()) > 1  # repeats were drawn
        for world_size in (2, 4):
            union: Counter[str] = Counter()
            for rank in range(world_size):
                ds = ShardDataset(str(plain), rank=rank, world_size=world_size, **options)
                ds.set_epoch(epoch)
                union.update(s["__key__"] for s in _epoch(ds) if not s["__padded__"])
            assert union == drawn, (epoch, world_size)


def test_read_time_weights_only_exposes_weight(plain: Path) -> None:
    ds = ShardDataset(str(plain), class_weights="a=1,b=1,c=2", resample=False)
    samples = _epoch(ds, workers=2)
    assert sorted(s["__key__"] for s in samples) == sorted(
        f"{c}__{i:05d}" for c, i in _all_inputs()
    )
    expected = {0: 0.25 / (40 / 57), 1: 0.25 / (12 / 57), 2: 0.5 / (5 / 57)}
    for s in samples:
        assert s["__weight__"] == pytest.approx(expected[int(s["cls"])], rel=1e-12)


def test_read_time_reweighting_resumes_mid_epoch(plain: Path) -> None:
    options: dict[str, Any] = {"class_weights": "sqrt", "shuffle_buffer": 8, "block_size": 4}
    ds = ShardDataset(str(plain), batch_size=5, **options)
    ds.set_epoch(2)
    batches = list(torch.utils.data.DataLoader(ds, batch_size=None))
    resumed = ShardDataset(str(plain), batch_size=5, **options)
    resumed.resume(ds.state_after(batches[3]))
    rest = [list(b["__key__"]) for b in torch.utils.data.DataLoader(resumed, batch_size=None)]
    assert rest == [list(b["__key__"]) for b in batches[4:]]
    other = ShardDataset(str(plain), batch_size=5, **{**options, "class_weights": "balanced"})
    with pytest.raises(IncompatibleStateError, match="class_weights"):
        other.resume(ds.state_after(batches[3]))


def test_read_time_errors(plain: Path, tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"unknown class\(es\) 'dog'"):
        ShardDataset(str(plain), class_weights="dog=1,a=1,b=1,c=1")
    raw = tmp_path / "unlabelled"
    raw.mkdir()
    for i in range(4):
        (raw / f"{i:03d}.bin").write_bytes(payload(0, i))
    out = _build(raw, tmp_path / "u", shards=2, input_format="keyed")
    with pytest.raises(ValueError, match="needs a labelled dataset"):
        ShardDataset(str(out), class_weights="balanced")
