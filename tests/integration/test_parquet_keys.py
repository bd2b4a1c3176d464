"""Issue 37 item 2: Parquet keys survive a re-export of the same rows.

Spark names each part ``part-00000-<uuid>-c000.snappy.parquet`` with a new uuid on every
export; keys were ``part-00000-<uuid>-c000_snappy-000000401``, so the same rows got new keys
(and ``--resume``, dedup and joins by key broke). Exports are written with pyarrow in the
exact shapes of Spark, Ray Data and Hugging Face, and with ``datasets`` itself.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import shardprep
from shardprep.format.errors import DuplicateKeyError
from shardprep.scan.parquet_keys import stable_stems, without_run_ids
from tests.integration.test_parquet_input import shard_members
from tests.processes import run_bounded

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

UUIDS = ("3f2a9c1e-0b7d-4d4e-9a51-6c0f1e2d3b4a", "a0c4e2d1-77f0-4b1c-8d2e-19b3c5a7e901")


@pytest.mark.parametrize(
    ("name", "stable"),
    [
        (f"part-00000-{UUIDS[0]}-c000.snappy", "part-00000-c000.snappy"),  # Spark
        (f"part-00003-{UUIDS[1].upper()}.c000", "part-00003.c000"),
        ("0123456789abcdef0123456789abcdef_fedcba9876543210fedcba9876543210_000003", "000003"),
        (
            f"part-00000-tid-4066433405464214427-{UUIDS[0]}-25-1-c000.snappy",
            "part-00000-25-1-c000.snappy",
        ),
        (f"part-7-{UUIDS[0]}", "part-7"),
        ("train-00000-of-00002", "train-00000-of-00002"),  # Hugging Face: stable already
        (UUIDS[0], UUIDS[0]),  # nothing else names the file: kept
        (f"x{UUIDS[0]}", f"x{UUIDS[0]}"),  # not a token of its own
    ],
)
def test_run_ids_are_taken_out_of_file_names(name: str, stable: str) -> None:
    assert without_run_ids(name) == stable


def test_files_that_would_share_a_stable_name_keep_their_whole_names() -> None:
    names = [f"label=3/part-00000-{u}-c000" for u in UUIDS] + [f"label=4/part-00000-{UUIDS[0]}"]
    assert stable_stems(names) == [*names[:2], "label=4/part-00000"]


def _rows(label: int, part: int) -> list[dict[str, object]]:
    return [{"jpg": b"%d-%d-%d" % (label, part, i), "n": i} for i in range(2 + part)]


def spark_export(raw: Path, uuid: str) -> Path:
    """``df.repartition(2).write.partitionBy("label").parquet(raw)``: no key column."""
    for label in (3, 10):
        for part in range(2):
            path = raw / f"label={label}" / f"part-{part:05d}-{uuid}.c000.snappy.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(_rows(label, part)), path)
            (path.parent / f".{path.name}.crc").write_bytes(b"crc")
    (raw / "_SUCCESS").write_bytes(b"")
    return raw


def _samples(out: Path) -> dict[str, dict[str, bytes]]:
    return {k: v for shard in shard_members(out) for k, v in shard.items()}


def test_a_spark_export_keeps_its_keys_when_exported_again(tmp_path: Path) -> None:
    first = spark_export(tmp_path / "first", UUIDS[0])
    again = spark_export(tmp_path / "again", UUIDS[1])  # the same rows, a new uuid
    shardprep.build(str(first), str(tmp_path / "a"), shards=2, progress=False)
    samples = _samples(tmp_path / "a")
    assert samples["label_3__part-00001_c000_snappy-000000002"] == {
        "jpg": b"3-1-2",
        "json": b'{"n": 2}',
        "cls": b"3",
    }
    assert len(samples) == 10  # 2 labels x (2 + 3 rows)
    # --resume against the re-export finds the build complete: same keys, same fingerprint
    # (with the uuid in the keys it was "already holds a complete build, of other input")
    summary = shardprep.build(
        str(again), str(tmp_path / "a"), shards=2, resume=True, progress=False
    )
    assert summary.already_complete
    shardprep.build(str(again), str(tmp_path / "b"), shards=2, progress=False)
    shards = ["shard-00000.tar", "shard-00001.tar"]
    assert {n: (tmp_path / "a" / n).read_bytes() for n in shards} == {
        n: (tmp_path / "b" / n).read_bytes() for n in shards
    }


def test_spark_appends_into_one_folder_keep_unique_keys(tmp_path: Path) -> None:
    """``mode("append")`` writes part-00000 again under a new uuid beside the first."""
    raw = spark_export(tmp_path / "raw", UUIDS[0])
    spark_export(raw, UUIDS[1])
    shardprep.build(str(raw), str(tmp_path / "out"), shards=2, progress=False)
    keys = set(_samples(tmp_path / "out"))
    assert len(keys) == 20
    assert f"label_3__part-00000-{UUIDS[1]}_c000_snappy-000000001" in keys


def test_ray_data_file_names_lose_their_uuids(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    for task in range(2):
        name = f"{'ab' * 16}_{'cd' * 16}_{task:06d}.parquet"
        pq.write_table(pa.Table.from_pylist(_rows(0, task)), raw / name)
    shardprep.build(str(raw), str(tmp_path / "out"), shards=1, progress=False)
    assert sorted(_samples(tmp_path / "out")) == [
        "000000-000000000",
        "000000-000000001",
        "000001-000000000",
        "000001-000000001",
        "000001-000000002",
    ]


def test_a_datasets_export_with_an_id_column_is_keyed_by_it(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = {"id": [f"q{i:03d}" for i in range(5)], "jpg": [b"%d" % i for i in range(5)]}
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "train.parquet"))
    shardprep.build(
        str(tmp_path / "train.parquet"), str(tmp_path / "out"), shards=1, progress=False
    )
    assert _samples(tmp_path / "out") == {f"q{i:03d}": {"jpg": b"%d" % i} for i in range(5)}


@pytest.mark.parametrize(
    ("columns", "key"),
    [
        ({"uuid": ["u0", "u1"], "id": [7.0, 8.0]}, ["u0", "u1"]),  # a float id is not a key
        ({"key": ["k0", "k1"], "id": ["i0", "i1"]}, ["k0", "k1"]),  # key comes first
        ({"id": [10, 11], "uuid": ["u0", "u1"]}, ["10", "11"]),  # integers are keys too
    ],
)
def test_the_default_key_column_is_the_first_of_the_list_holding_strings_or_integers(
    columns: dict[str, list[object]], key: list[str], tmp_path: Path
) -> None:
    raw = tmp_path / "a.parquet"
    pq.write_table(pa.table({**columns, "jpg": [b"x", b"y"]}), raw)
    shardprep.build(str(raw), str(tmp_path / "out"), shards=1, progress=False)
    assert sorted(_samples(tmp_path / "out")) == key


def test_a_float_id_stays_in_the_json(tmp_path: Path) -> None:
    raw = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": [7.5], "jpg": [b"x"]}), raw)
    shardprep.build(str(raw), str(tmp_path / "out"), shards=1, progress=False)
    assert _samples(tmp_path / "out") == {"a-000000000": {"jpg": b"x", "json": b'{"id": 7.5}'}}


def test_a_default_key_column_with_repeats_is_refused_saying_how_to_number_rows(
    tmp_path: Path,
) -> None:
    raw = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": ["same", "same"], "jpg": [b"x", b"y"]}), raw)
    with pytest.raises(DuplicateKeyError) as caught:
        shardprep.build(str(raw), str(tmp_path / "out"), shards=1, progress=False)
    assert str(caught.value) == (
        "duplicate sample key 'same' from 'a.parquet:same', 'a.parquet:same'; Parquet keys "
        "come from key_column=, else from the first of key, __key__, id, uuid the files hold "
        "as strings or integers, else from the file's name and the row's number: name a column "
        "of unique values with key_column=, or pass key_column='' to key every row by its file "
        "and row number"
    )
    cli = run_bounded(
        [sys.executable, "-m", "shardprep", "build", str(raw), str(tmp_path / "cli"), "-n", "1"],
        timeout=120,
    )
    assert cli.returncode == 1
    assert "or pass --key-column '' to key every row by its file and row number" in cli.stderr
    shardprep.build(str(raw), str(tmp_path / "out"), shards=1, key_column="", progress=False)
    samples = _samples(tmp_path / "out")
    assert samples == {
        f"a-00000000{i}": {"jpg": b"xy"[i : i + 1], "json": b'{"id": "same"}'} for i in range(2)
    }
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["options"]["key_column"] == ""
