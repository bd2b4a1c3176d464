"""Reserved member names, the one label rule and the member-count limit, on every input path.

A member named as a field the loader sets itself (``__key__``, ``__padded__``...) stood in
for that field in every sample and batch; integer labels met class names and were silently
renumbered; 66,000 member columns ended in ``OverflowError: unsigned short``. Each is now an
error naming the file (column, row or member) and what to do.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardprep
from loader import ShardDataset
from shardprep.format.errors import InputError, ManifestError
from shardprep.format.shardformat import (
    LOADER_FIELDS,
    MAX_EXTENSIONS,
    decode_index,
    encode_index,
    reserved_member,
)
from shardprep.transform import MapError
from shardprep.verify import verify_output
from tests.faults.helpers import flip_page_byte
from tests.faults.shard_surgery import _update_entry

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import dataclasses  # noqa: E402
import hashlib  # noqa: E402


def _build(raw: Any, out: Path, **options: Any) -> Any:
    return shardprep.build(
        raw if not isinstance(raw, Path) else str(raw),
        str(out),
        shards=2,
        workers=1,
        progress=False,
        **options,
    )


def _refused(raw: Any, out: Path, error: type[Exception] = InputError, **options: Any) -> str:
    with pytest.raises(error) as info:
        _build(raw, out, **options)
    assert not out.exists() or not any(p.suffix == ".tar" for p in out.iterdir())
    return str(info.value)


def test_every_loader_field_is_reserved() -> None:
    assert all(reserved_member(f) for f in LOADER_FIELDS)
    assert not any(reserved_member(e) for e in ("jpg", "seg.png", "__init__.py", "a__", "_x_"))


# --- item 2: refused at scan on every input path ------------------------------------------


def test_a_parquet_binary_column_named_as_a_loader_field_is_refused(tmp_path: Path) -> None:
    raw = tmp_path / "a.parquet"
    pq.write_table(
        pa.table({"key": ["a", "b"], "jpg": [b"x", b"y"], "__padded__": [b"1", b"1"]}), raw
    )
    message = _refused(raw, tmp_path / "out")
    assert message.startswith(f"{raw}: binary column '__padded__' is a name the loader gives")
    assert "rename the column" in message


def test_a_struct_path_ending_in_a_loader_field_is_refused_naming_the_row(tmp_path: Path) -> None:
    raw = tmp_path / "a.parquet"
    images = [{"bytes": b"x", "path": "a.jpg"}, {"bytes": b"y", "path": "b.__key__"}]
    pq.write_table(pa.table({"key": ["a", "b"], "image": images}), raw)
    message = _refused(raw, tmp_path / "out")
    assert message.startswith(
        f"{raw}: row 1: the path in column 'image' gives the member extension '__key__'"
    )


def _tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("layout", ["class-folders", "keyed", "listing", "tar"])
def test_a_file_or_member_named_as_a_loader_field_is_refused(layout: str, tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    if layout == "class-folders":
        for name in ("cat/a.jpg", "cat/b.jpg", "cat/b.__padded__", "dog/c.jpg"):
            (raw / name).parent.mkdir(exist_ok=True)
            (raw / name).write_bytes(b"x")
        bad = raw / "cat" / "b.__padded__"
    elif layout == "keyed":
        for name in ("a.jpg", "b.jpg", "b.__key__"):
            (raw / name).write_bytes(b"x")
        bad = raw / "b.__key__"
    elif layout == "listing":
        for name in ("a.jpg", "b.__key__"):
            (raw / name).write_bytes(b"x")
        listing = raw / "list.jsonl"
        listing.write_text('{"path": "a.jpg"}\n{"path": "b.__key__"}\n')
        bad, raw = raw / "b.__key__", listing
    else:
        tar = _tar(raw / "in.tar", {"a.jpg": b"x", "b.jpg": b"y", "b.__padded__": b"\x01"})
        bad = Path(f"{tar}:b.__padded__")
    message = _refused(raw, tmp_path / "out")
    assert message.startswith(f"{bad}: the member extension "), message
    assert "is a name the loader gives its own field" in message


def test_a_map_returning_a_loader_field_is_refused(tmp_path: Path) -> None:
    samples = [{"__key__": f"k{i}", "jpg": b"x"} for i in range(4)]

    def adds(sample: dict[str, Any]) -> dict[str, Any]:
        return {**sample, "__padded__": b"1"}

    message = _refused(samples, tmp_path / "out", MapError, map=adds)
    assert "returned the member name '__padded__'" in message


# --- item 2: the reader and verify refuse an index that names one (other tools' shards) ------


@pytest.fixture
def forged(tmp_path: Path) -> Path:
    """An output whose member ``.pad`` the index calls ``.__padded__`` (as another tool or an
    older builder could write it); the manifest's sha256 matches the new index."""
    out = tmp_path / "forged"
    samples = [{"__key__": f"k{i}", "jpg": b"x" * (i + 1), "pad": b"P"} for i in range(8)]
    _build(samples, out)
    for shard in (0, 1):
        path = out / f"shard-{shard:05d}.idx"
        index = decode_index(path.read_bytes())
        arrays = {
            f.name: np.array(getattr(index, f.name))
            for f in dataclasses.fields(index)
            if f.name not in ("exts", "version")
        }
        exts = ["__padded__" if e == "pad" else e for e in index.exts]
        data = encode_index(exts, arrays, version=index.version)
        path.write_bytes(data)
        _update_entry(
            out, shard, index_sha256=hashlib.sha256(data).hexdigest(), index_bytes=len(data)
        )
    return out


@pytest.mark.parametrize("batch_size", [None, 3])
def test_the_loader_refuses_a_member_that_would_shadow_its_field(
    forged: Path, batch_size: int | None
) -> None:
    with pytest.raises(ManifestError) as info:
        list(ShardDataset(str(forged), seed=0, batch_size=batch_size))
    message = str(info.value)
    assert "shard-0000" in message and ".idx: sample 'k" in message
    assert "its member .__padded__ is named as a field the loader sets itself" in message


def test_verify_refuses_a_member_that_would_shadow_a_loader_field(forged: Path) -> None:
    report = verify_output(str(forged))
    assert len(report.problems) == 2
    assert all("its member .__padded__ is named as a field" in p for p in report.problems)


# --- item 3: one label rule for every input path ----------------------------------------


def test_parquet_integer_labels_and_names_in_two_files_are_refused(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    pq.write_table(
        pa.table({"key": ["a", "b"], "jpg": [b"x", b"y"], "label": [5, 7]}), raw / "0.parquet"
    )
    pq.write_table(pa.table({"key": ["c"], "jpg": [b"z"], "label": ["cat"]}), raw / "1.parquet")
    message = _refused(raw, tmp_path / "out")
    assert message.startswith(
        f"{raw / '0.parquet'}: row 0 (key 'a') has an integer label (a class index) and "
        f"{raw / '1.parquet'}: row 0 (key 'c') a string class name"
    ), message


@pytest.mark.parametrize("name", [" cat", "cat "])
def test_parquet_names_with_whitespace_are_not_merged(name: str, tmp_path: Path) -> None:
    raw = tmp_path / "a.parquet"
    pq.write_table(pa.table({"key": ["a", "b"], "jpg": [b"x", b"y"], "label": ["cat", name]}), raw)
    message = _refused(raw, tmp_path / "out")
    assert message.startswith(
        f"{raw}: row 1 (key 'b'): label {name!r} in column 'label' has whitespace before or after"
    )


def test_a_jsonl_listing_with_integer_labels_and_names_is_refused(tmp_path: Path) -> None:
    for name in ("a.jpg", "b.jpg"):
        (tmp_path / name).write_bytes(b"x")
    listing = tmp_path / "list.jsonl"
    listing.write_text('{"path": "a.jpg", "label": 5}\n{"path": "b.jpg", "label": "cat"}\n')
    message = _refused(listing, tmp_path / "out", label_column="label")
    assert message.startswith(f"{listing}:1: 'label' has an integer label"), message
    assert f"{listing}:2: 'label' a string class name" in message


def test_a_tar_cls_with_whitespace_is_refused_and_a_line_end_is_not(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    _tar(raw / "in.tar", {"a.jpg": b"x", "a.cls": b"cat\n", "b.jpg": b"y", "b.cls": b" cat\n"})
    message = _refused(raw, tmp_path / "out")
    assert message.startswith(f"{raw / 'in.tar'}:b.cls: label ' cat' has whitespace"), message
    ok = tmp_path / "ok"
    ok.mkdir()
    _tar(ok / "in.tar", {"a.jpg": b"x", "a.cls": b"cat\n", "b.jpg": b"y", "b.cls": b"cat\r\n"})
    assert _build(ok, tmp_path / "built").num_classes == 1


# --- item 8: the member-count limit -------------------------------------------------------


def test_more_member_columns_than_a_build_holds_is_refused_before_writing(tmp_path: Path) -> None:
    raw = tmp_path / "wide.parquet"
    n = MAX_EXTENSIONS + 1
    table = pa.Table.from_arrays([pa.array([b"x"])] * n, names=[f"c{i}" for i in range(n)])
    pq.write_table(table, raw)
    message = _refused(raw, tmp_path / "out")
    assert message.startswith(f"{raw}: 65,537 member columns (binary or {{bytes, path}}); a build")
    assert "at most 65,536 distinct member extensions" in message


def test_a_map_returning_more_members_than_a_sample_holds_is_refused(tmp_path: Path) -> None:
    samples = [{"__key__": "k0", "jpg": b"x"}, {"__key__": "k1", "jpg": b"y"}]

    def explode(sample: dict[str, Any]) -> dict[str, Any]:
        return {"__key__": sample["__key__"], **{f"m{i}": b"" for i in range(MAX_EXTENSIONS + 1)}}

    message = _refused(samples, tmp_path / "out", MapError, map=explode)
    assert "returned 65,537 members; a sample holds at most 65,536" in message


def test_keyed_files_past_the_extension_limit_are_refused_naming_the_file(tmp_path: Path) -> None:
    """The sink's own check (every scanner's samples pass it), exercised without 65,537 files:
    a builder that already numbers MAX_EXTENSIONS extensions refuses one more."""
    from shardprep.inventory import InventoryBuilder

    builder = InventoryBuilder(str(tmp_path))
    for i in range(MAX_EXTENSIONS):
        builder.add(f"s{i}", -1, [(f"e{i}", 1, -1)])
    with pytest.raises(InputError) as info:
        builder.add("last", -1, [("one_more", 1, -1)])
    assert str(info.value).startswith(
        f"{tmp_path}/last.one_more: the member extension 'one_more' brings the number of "
        "distinct member extensions to 65,537"
    )
    assert len(builder) == MAX_EXTENSIONS  # nothing of the refused sample was recorded


# --- item 8: NaN in a Parquet row's .json, a damaged page ----------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nan_or_infinity_in_a_json_column_is_refused_naming_column_and_row(
    bad: float, tmp_path: Path
) -> None:
    raw = tmp_path / "n.parquet"
    table = {"key": ["a", "b", "c"], "jpg": [b"x", b"y", b"z"], "score": [0.5, 1.0, bad]}
    pq.write_table(pa.table(table | {"note": ["p", "q", "r"]}), raw)
    message = _refused(raw, tmp_path / "out")
    assert message.startswith(f"{raw}: row 2 (key 'c'): column 'score' holds NaN or an infinity")


def test_a_damaged_page_names_its_row_group_on_one_line(tmp_path: Path) -> None:
    """Damage in rows 50-99 (row group 1) was reported as 'row 0 onwards' in three lines."""
    raw = tmp_path / "d.parquet"
    rows = 150
    table = pa.table(
        {"key": [f"k{i:03d}" for i in range(rows)], "bin": [bytes([i]) * 2000 for i in range(rows)]}
    )
    pq.write_table(
        table,
        raw,
        row_group_size=50,
        write_page_checksum=True,
        use_dictionary=False,
        compression="none",
    )
    flip_page_byte(raw, row_group=1, column=1)
    message = _refused(raw, tmp_path / "out")
    assert "\n" not in message
    assert message.startswith(f"{raw}: row group 1 (rows 50-99) cannot be read (")
    assert message.endswith(
        "rows 50-99 would be lost: rewrite the file from its source, or remove it"
    )
