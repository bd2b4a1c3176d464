"""Object names on an S3 prefix (a real moto server) that used to be skipped or mixed without
a word: a key with a ``.`` or ``..`` segment is refused naming it (never skipped as hidden),
two splits of a Parquet export are refused, OS junk files are skipped as locally."""

from __future__ import annotations

import io
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardprep
from shardprep.format.errors import InputError
from tests.s3 import S3Server


def _parquet(n: int) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(pa.table({"jpg": pa.array([b"img%d" % i for i in range(n)])}), buffer)
    return buffer.getvalue()


def _put(s3: S3Server, objects: dict[str, bytes]) -> None:
    fs: Any = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
    for key, data in objects.items():
        fs.pipe_file(key, data)


def _refused(s3: S3Server, url: str, tmp: Any) -> str:
    with pytest.raises(InputError) as info:
        shardprep.build(
            url, str(tmp / "out"), shards=1, storage_options=s3.storage_options(), progress=False
        )
    assert not (tmp / "out").exists()
    return str(info.value)


DOT_REFUSAL = (
    "the object's key has a '.' or '..' path segment, which no folder can hold (it is not "
    "hidden, and a local copy would lose or move it); rename the object or leave it out of "
    "the input"
)


def test_a_parquet_object_with_a_dot_segment_is_refused(
    s3: S3Server, bucket: str, tmp_path: Any
) -> None:
    _put(
        s3,
        {
            f"{bucket}/x/a/../b.parquet": _parquet(1),
            f"{bucket}/x/c.parquet": _parquet(1),
            f"{bucket}/x/d/./e.parquet": _parquet(1),
        },
    )
    message = _refused(s3, f"s3://{bucket}/x", tmp_path)
    assert message == f"s3://{bucket}/x/a/../b.parquet: {DOT_REFUSAL}"


def test_a_class_folder_object_with_a_dot_segment_is_refused(
    s3: S3Server, bucket: str, tmp_path: Any
) -> None:
    _put(
        s3,
        {
            f"{bucket}/x/cat/1.jpg": b"c1",
            f"{bucket}/x/cat/../2.jpg": b"c2",
            f"{bucket}/x/dog/1.jpg": b"d1",
        },
    )
    message = _refused(s3, f"s3://{bucket}/x", tmp_path)  # (the detection lists x/cat/)
    assert message == (
        f"s3://{bucket}/x/cat/../: the keys of the objects under it have a '.' or '..' path "
        "segment, which no folder can hold (it is not hidden, and a local copy would lose or "
        "move it); rename the objects or leave them out of the input"
    )
    # given the layout, the walk of each class folder names the object itself
    with pytest.raises(InputError) as info:
        shardprep.build(
            f"s3://{bucket}/x",
            str(tmp_path / "out"),
            shards=1,
            input_format="class-folders",
            storage_options=s3.storage_options(),
            progress=False,
        )
    assert str(info.value) == (
        f"1 input problem(s), nothing was written:\n  s3://{bucket}/x/cat/../2.jpg: {DOT_REFUSAL}"
    )


def test_two_splits_of_a_parquet_export_on_a_prefix_are_refused(
    s3: S3Server, bucket: str, tmp_path: Any
) -> None:
    _put(
        s3,
        {
            f"{bucket}/hub/README.md": b"# card",
            f"{bucket}/hub/data/train-00000-of-00001.parquet": _parquet(4),
            f"{bucket}/hub/data/test-00000-of-00001.parquet": _parquet(3),
        },
    )
    url = f"s3://{bucket}/hub"
    message = _refused(s3, url, tmp_path)
    assert message.startswith(
        f"{url}: holds 2 dataset splits: test ({url}/data/test-00000-of-00001.parquet), train "
        f"({url}/data/train-00000-of-00001.parquet); a build makes one dataset"
    ), message


def test_os_junk_objects_are_skipped_on_a_prefix(s3: S3Server, bucket: str, tmp_path: Any) -> None:
    _put(
        s3,
        {
            f"{bucket}/cf/cat/1.jpg": b"c1",
            f"{bucket}/cf/cat/Thumbs.db": b"thumbs",
            f"{bucket}/cf/dog/1.jpg": b"d1",
            f"{bucket}/cf/dog/desktop.ini": b"ini",
            f"{bucket}/cf/Thumbs.db": b"thumbs",
        },
    )
    summary = shardprep.build(
        f"s3://{bucket}/cf",
        str(tmp_path / "out"),
        shards=1,
        storage_options=s3.storage_options(),
        progress=False,
    )
    assert (summary.layout, summary.num_samples, summary.num_classes) == ("class-folders", 2, 2)
