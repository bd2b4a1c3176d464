"""Issue 34 item 4: Parquet exports as Spark and Hugging Face write them are Parquet input,
whatever sidecars lie beside the parts; Hive partition folders are columns of their rows.

The files are written with pyarrow in the exact shape of the exports: Spark's
``partitionBy("label")`` (``label=3/part-00000-<uuid>.c000.snappy.parquet`` without the
partition column, a hidden ``.part-...parquet.crc`` beside each part, ``_SUCCESS`` at the top,
Databricks' ``_started_<id>`` / ``_committed_<id>`` in each folder) and a Hugging Face export
(``README.md``, ``dataset_info.json`` beside ``train-00000-of-00002.parquet``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import shardprep
from shardprep.format.errors import InputError
from shardprep.scan import InputFormat, detect_format
from tests.integration.test_parquet_input import shard_members

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

UUID = "3f2a9c1e-0b7d-4d4e-9a51-6c0f1e2d3b4a"
LABELS = (0, 1, 3, 10)  # sorted as text, label=10 comes before label=3
PER_LABEL = {0: 5, 1: 3, 3: 4, 10: 2}


def _rows(label: int) -> list[dict[str, Any]]:
    return [
        {"key": f"r{label:02d}-{i}", "jpg": b"jpeg-%d-%d" % (label, i) * (i + 1), "n": i}
        for i in range(PER_LABEL[label])
    ]


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    """One part as Spark leaves it: the file and its hidden Hadoop checksum beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)
    (path.parent / f".{path.name}.crc").write_bytes(b"crc\x00\x01")


def spark_partitioned(raw: Path, column: str = "label") -> Path:
    """``df.write.partitionBy(column).parquet(raw)``, Databricks markers included."""
    for label in LABELS:
        folder = raw / f"{column}={label}"
        _write(folder / f"part-00000-{UUID}.c000.snappy.parquet", _rows(label))
        (folder / "_started_5123").write_bytes(b"")
        (folder / "_committed_5123").write_bytes(b'{"added":[]}')
    (raw / "_SUCCESS").write_bytes(b"")
    return raw


def flat_in_hive_order(raw: Path) -> Path:
    """The same rows in one file with a ``label`` column, in the order the Hive folders sort."""
    rows = [
        {**row, "label": label}
        for label in sorted(LABELS, key=lambda x: f"label={x}")
        for row in _rows(label)
    ]
    raw.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), raw / "all.parquet", row_group_size=2)
    return raw


def hugging_face(raw: Path) -> Path:
    """A Hub export: README.md and dataset_info.json beside the train files."""
    for f in range(2):
        rows = [r for label in LABELS for r in _rows(label)][f::2]
        _write(raw / f"train-{f:05d}-of-00002.parquet", rows)
    (raw / "README.md").write_text("---\nlicense: mit\n---\n# a dataset\n")
    (raw / "dataset_info.json").write_text(json.dumps({"features": {"jpg": "binary"}}))
    return raw


def _tree(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def _shards(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.tar"))}


def test_sidecars_beside_parquet_files_are_skipped_one_sample_per_row(tmp_path: Path) -> None:
    raw = hugging_face(tmp_path / "hf")
    (raw / "README.txt").write_text("also a readme")
    assert detect_format(str(raw)) is InputFormat.PARQUET
    summary = shardprep.build(str(raw), str(tmp_path / "out"), shards=2, progress=False)
    assert (summary.layout, summary.layout_detected) == ("parquet", True)
    assert summary.num_samples == sum(PER_LABEL.values())  # one per row, not one per file
    keys = sorted(k for shard in shard_members(tmp_path / "out") for k in shard)
    assert keys == sorted(f"r{label:02d}-{i}" for label in LABELS for i in range(PER_LABEL[label]))


def test_hub_layout_readme_beside_a_data_folder_is_parquet(tmp_path: Path) -> None:
    raw = tmp_path / "hub"
    hugging_face(raw / "data")
    (raw / "README.md").write_text("# card")
    assert detect_format(str(raw)) is InputFormat.PARQUET
    summary = shardprep.build(str(raw), str(tmp_path / "out"), shards=2, progress=False)
    assert summary.num_samples == sum(PER_LABEL.values())


def test_hive_partitions_are_the_label_column_like_one_flat_file(tmp_path: Path) -> None:
    hive = spark_partitioned(tmp_path / "hive")
    flat = flat_in_hive_order(tmp_path / "flat")
    assert detect_format(str(hive)) is InputFormat.PARQUET
    a = shardprep.build(
        str(hive), str(tmp_path / "a"), shards=3, label_column="label", progress=False
    )
    shardprep.build(str(flat), str(tmp_path / "b"), shards=3, label_column="label", progress=False)
    assert (a.layout, a.layout_detected, a.num_samples) == ("parquet", True, 14)
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    classes = [(c["index"], c["name"], c["count"]) for c in manifest["classes"]]
    assert classes == [(i, str(i), PER_LABEL.get(i, 0)) for i in range(11)]  # '10' is class 10
    # same rows, same keys: the same shard bytes (the .idx files differ by the recorded
    # sources only: 'label=3/part-...parquet:r03-0' vs 'all.parquet:r03-0')
    shards = [_shards(tmp_path / out) for out in ("a", "b")]
    assert len(shards[0]) == 3 and shards[0] == shards[1]
    assert (
        manifest["classes"] == json.loads((tmp_path / "b" / "manifest.json").read_text())["classes"]
    )


def test_the_default_label_column_is_a_partition_named_label(tmp_path: Path) -> None:
    hive = spark_partitioned(tmp_path / "hive")
    shardprep.build(str(hive), str(tmp_path / "a"), shards=3, progress=False)
    shardprep.build(str(hive), str(tmp_path / "b"), shards=3, label_column="label", progress=False)
    names = {p.name for p in (tmp_path / "a").iterdir()} - {"manifest.json"}  # (options differ)
    assert len(names) == 6
    assert {n: (tmp_path / "a" / n).read_bytes() for n in names} == {
        n: (tmp_path / "b" / n).read_bytes() for n in names
    }


def test_format_parquet_keeps_the_partition_column_in_the_json(tmp_path: Path) -> None:
    hive = spark_partitioned(tmp_path / "hive", column="split")
    summary = shardprep.build(
        str(hive), str(tmp_path / "out"), shards=2, input_format="parquet", progress=False
    )
    assert (summary.num_samples, summary.num_classes) == (14, 0)
    samples = {k: v for shard in shard_members(tmp_path / "out") for k, v in shard.items()}
    assert json.loads(samples["r03-2"]["json"]) == {"n": 2, "split": "3"}
    assert sorted(samples["r03-2"]) == ["jpg", "json"]


def test_nested_partitions_give_one_column_each_and_keys_stay_unique(tmp_path: Path) -> None:
    raw = tmp_path / "nested"
    for year in (2023, 2024):
        for label in (0, 1):
            rows = [{"jpg": b"%d-%d-%d" % (year, label, i)} for i in range(2)]
            _write(raw / f"year={year}" / f"label={label}" / "part-00000.parquet", rows)
    summary = shardprep.build(str(raw), str(tmp_path / "out"), shards=2, progress=False)
    assert (summary.num_samples, summary.num_classes) == (8, 2)
    samples = {k: v for shard in shard_members(tmp_path / "out") for k, v in shard.items()}
    # no key column: <path without .parquet>-<row>, '/' → '__' and '=' → '_' (docs/pipelines.md)
    key = "year_2024__label_1__part-00000-000000001"
    assert samples[key]["jpg"] == b"2024-1-1"
    assert (json.loads(samples[key]["json"]), samples[key]["cls"]) == ({"year": "2024"}, b"1")
    assert len(samples) == 8  # two part-00000.parquet per year: no key collides


def test_a_partition_column_also_in_the_file_must_agree(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _write(
        raw / "label=1" / "part-0.parquet", [{"jpg": b"a", "label": 1}, {"jpg": b"b", "label": 1}]
    )
    _write(
        raw / "label=2" / "part-0.parquet", [{"jpg": b"c", "label": 2}, {"jpg": b"d", "label": 5}]
    )
    with pytest.raises(InputError) as caught:
        shardprep.build(str(raw), str(tmp_path / "out"), shards=1, progress=False)
    where = raw / "label=2" / "part-0.parquet"
    assert str(caught.value) == (
        f"{where}: row 1: column 'label' holds 5 while its partition folder 'label=2' says "
        "'2'; a partition column must hold its folder's value: rewrite the file, or drop the "
        "column from it"
    )
    assert not (tmp_path / "out").exists()


def test_class_folders_named_like_partitions_holding_images_stay_class_folders(
    tmp_path: Path,
) -> None:
    raw = tmp_path / "raw"
    for label in (3, 10):
        for i in range(2):
            path = raw / f"label={label}" / f"{i}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"%d" % i)
    summary = shardprep.build(str(raw), str(tmp_path / "out"), shards=1, progress=False)
    assert (summary.layout, summary.num_samples) == ("class-folders", 4)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    names = [c["name"] for c in manifest["classes"]]
    assert names == ["label=10", "label=3"]  # the folder names, as for any class folder
