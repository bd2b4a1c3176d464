"""Parquet input (--format parquet): rows become samples, byte for byte, on every engine.

The data is written by pyarrow as a Hugging Face image dataset is: several files of
several row groups, an ``image`` struct column ``{bytes, path}`` holding real PNG bytes,
string labels, a ``__key__`` column, a binary column with nulls and scalar columns.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import shardprep
from loader import ShardDataset
from shardprep.scan import InputFormat, detect_format
from shardprep.scan import parquet as parquet_scan
from tests.processes import run_bounded

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
Image = pytest.importorskip("PIL.Image")

CLASSES = ("zebra", "ant", "cat", "bee")  # sorted: ant=0, bee=1, cat=2, zebra=3
ROWS = (40, 25, 31)  # three files
SHARDS = 5
IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _png(i: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (3 + i % 5, 2 + i % 3), (i % 256, (7 * i) % 256, 99)).save(out, "PNG")
    return out.getvalue()


def _label(i: int) -> str:
    return CLASSES[0] if i % 7 == 0 else CLASSES[1 + i % 3]


def expected_sample(i: int) -> dict[str, bytes]:
    """The members row ``i`` must become (extension → bytes), ``.cls`` as written."""
    members = {"png": _png(i)}  # a row without a path too: its bytes are a PNG
    if i % 4:
        members["thumb"] = b"thumb-%d" % i * (i % 9)
    members["json"] = json.dumps({"caption": f"photo {i}", "score": i / 4}, sort_keys=True).encode()
    members["cls"] = b"%d" % sorted(CLASSES).index(_label(i))
    return members


def write_parquet(raw: Path, rows: tuple[int, ...] = ROWS, key: bool = True) -> list[int]:
    """One file per entry of ``rows``, row groups of 8 rows; returns every row's number."""
    raw.mkdir(parents=True)
    numbers, start = [], 0
    for f, count in enumerate(rows):
        ids = list(range(start, start + count))
        start += count
        columns: dict[str, Any] = {
            "score": [i / 4 for i in ids],
            "image": pa.array(
                [{"bytes": _png(i), "path": f"photos/{i}.PNG" if i % 10 else None} for i in ids],
                IMAGE_TYPE,
            ),
            "label": [_label(i) for i in ids],
            "thumb": pa.array([b"thumb-%d" % i * (i % 9) if i % 4 else None for i in ids]),
            "caption": [f"photo {i}" for i in ids],
        }
        if key:
            columns["__key__"] = [f"s{i:05d}" for i in ids]
        pq.write_table(
            pa.table(columns), raw / f"train-{f:05d}-of-{len(rows):05d}.parquet", row_group_size=8
        )
        numbers += ids
    (raw / "_SUCCESS").write_bytes(b"")  # what Spark leaves beside its files
    return numbers


def tree(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def shard_members(out: Path) -> list[dict[str, dict[str, bytes]]]:
    """Per shard: key → {extension: bytes}, read with tarfile."""
    shards = []
    for path in sorted(out.glob("shard-*.tar")):
        samples: dict[str, dict[str, bytes]] = {}
        with tarfile.open(path) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                data = tar.extractfile(member)
                assert data is not None
                samples.setdefault(key, {})[ext] = data.read()
        shards.append(samples)
    return shards


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("parquet") / "raw"
    write_parquet(folder)
    return folder


@pytest.fixture(scope="module")
def reference(raw: Path) -> Path:
    """The build with one worker; every other build must equal it byte for byte."""
    out = raw.parent / "out-1"
    summary = shardprep.build(str(raw), str(out), shards=SHARDS, workers=1, progress=False)
    assert (summary.layout, summary.layout_detected) == ("parquet", True)
    return out


def test_every_row_becomes_its_sample_with_exact_members_and_classes(reference: Path) -> None:
    shards = shard_members(reference)
    got = {key: members for shard in shards for key, members in shard.items()}
    assert got == {f"s{i:05d}": expected_sample(i) for i in range(sum(ROWS))}
    counts = [len(shard) for shard in shards]
    assert sum(counts) == 96 and max(counts) - min(counts) <= 1
    per_class = [Counter(m["cls"] for m in shard.values()) for shard in shards]
    for cls in (b"0", b"1", b"2", b"3"):  # stratified: each class spread over shards ±1
        spread = [c[cls] for c in per_class]
        assert max(spread) - min(spread) <= 1, (cls, spread)
    manifest = json.loads((reference / "manifest.json").read_text())
    assert [c["name"] for c in manifest["classes"]] == sorted(CLASSES)


def test_two_workers_and_the_cli_write_the_same_bytes(raw: Path, reference: Path) -> None:
    out = raw.parent / "out-cli-2"
    result = run_bounded(
        [
            sys.executable,
            "-m",
            "shardprep",
            "build",
            str(raw),
            str(out),
            "-n",
            str(SHARDS),
            "--workers",
            "2",
            "--quiet",
        ],
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    assert tree(out) == tree(reference)


def test_batches_of_one_row_write_the_same_bytes(
    raw: Path, reference: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(parquet_scan, "BATCH_BYTES", 1)  # one row per read, across row groups
    out = raw.parent / "out-rowwise"
    shardprep.build(str(raw), str(out), shards=SHARDS, workers=1, progress=False)
    assert tree(out) == tree(reference)


def test_the_loader_reads_back_every_sample_exactly(reference: Path) -> None:
    seen = {}
    for sample in ShardDataset(str(reference), shuffle=False):
        key = sample.pop("__key__")
        assert sample.pop("__padded__") is False
        seen[key] = sample
    assert seen == {f"s{i:05d}": expected_sample(i) for i in range(sum(ROWS))}


def test_rows_are_numbered_without_a_key_column_and_int_labels_are_indices(tmp_path: Path) -> None:
    table = pa.table(
        {
            "jpg": [b"j%d" % i for i in range(12)],
            "target": [i % 3 * 2 for i in range(12)],  # 0, 2, 4: classes "0".."4"
            "id": [f"row.{i}" for i in range(12)],
        }
    )
    path = tmp_path / "part.0.parquet"
    pq.write_table(table, path, row_group_size=5)
    out = tmp_path / "out"  # key_column="": numbered, though an "id" column is there
    shardprep.build(
        str(path), str(out), shards=2, label_column="target", key_column="", progress=False
    )
    got = {k: m for shard in shard_members(out) for k, m in shard.items()}
    assert got == {
        f"part_0-{i:09d}": {
            "jpg": b"j%d" % i,
            "json": json.dumps({"id": f"row.{i}"}).encode(),
            "cls": b"%d" % (i % 3 * 2),
        }
        for i in range(12)
    }
    manifest = json.loads((out / "manifest.json").read_text())
    assert [c["name"] for c in manifest["classes"]] == ["0", "1", "2", "3", "4"]
    out2 = tmp_path / "out-keyed"
    shardprep.build(
        str(path), str(out2), shards=2, label_column="target", key_column="id", progress=False
    )
    keys = {k for shard in shard_members(out2) for k in shard}
    assert keys == {f"row_{i}" for i in range(12)}  # keys.py's rule: '.' becomes '_'
    assert json.loads((out2 / "manifest.json").read_text())["options"]["key_column"] == "id"
    out3 = tmp_path / "out-default"  # "id" is a default key column (scan/parquet_keys.py)
    shardprep.build(str(path), str(out3), shards=2, label_column="target", progress=False)
    assert {n: (out3 / n).read_bytes() for n in ("shard-00000.tar", "shard-00001.tar")} == {
        n: (out2 / n).read_bytes() for n in ("shard-00000.tar", "shard-00001.tar")
    }


def test_a_folder_of_two_parquet_files_is_parquet_not_two_keyed_samples(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    write_parquet(raw, rows=(9, 14), key=False)
    assert detect_format(str(raw)) is InputFormat.PARQUET
    summary = shardprep.build(str(raw), str(tmp_path / "out"), shards=3, progress=False)
    assert summary.num_samples == 23 and summary.layout == "parquet"
    keys = {k for shard in shard_members(tmp_path / "out") for k in shard}
    assert keys == {f"train-00000-of-00002-{i:09d}" for i in range(9)} | {
        f"train-00001-of-00002-{i:09d}" for i in range(14)
    }


def test_a_parquet_prefix_on_s3_builds_the_same_bytes(raw: Path, reference: Path) -> None:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    import fsspec

    from tests.s3 import S3Server

    with S3Server() as s3:
        s3.create_bucket("data")
        options = s3.storage_options()
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        for path in sorted(raw.iterdir()):
            fs.put(str(path), f"data/hf/{path.name}")
        out = raw.parent / "out-s3"
        summary = shardprep.build(
            "s3://data/hf/", str(out), shards=SHARDS, storage_options=options, progress=False
        )
    assert summary.layout == "parquet"
    assert tree(out) == tree(reference)


def test_ray_engine_writes_the_same_bytes(raw: Path, reference: Path) -> None:
    pytest.importorskip("ray")
    out = raw.parent / "out-ray"
    script = (
        "import sys, ray, shardprep\n"
        "ray.init(address='local', num_cpus=2, include_dashboard=False, log_to_driver=False)\n"
        "try:\n"
        f"    shardprep.build(sys.argv[1], sys.argv[2], shards={SHARDS}, engine='ray', progress=False)\n"
        "finally:\n"
        "    ray.shutdown()\n"
    )
    env = {**os.environ, "RAY_ADDRESS": ""}
    result = run_bounded([sys.executable, "-c", script, str(raw), str(out)], timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert tree(out) == tree(reference)
