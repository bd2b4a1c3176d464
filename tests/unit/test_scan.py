"""Scan: every raw layout, its errors, duplicate keys and auto-detection (shardprep.scan)."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest

import shardprep
from shardprep.format.errors import DuplicateKeyError, InputError
from shardprep.inventory import Inventory
from shardprep.scan import InputFormat, detect_format, scan, walk
from tests.conftest import payload


def _write(path: Path, data: bytes | str = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)
    return path


def _samples(inv: Inventory) -> dict[str, tuple[int, tuple[tuple[str, str, int], ...]]]:
    """key -> (label, ((ext, path relative to the root, size), ...))."""
    out = {}
    for i in range(len(inv)):
        ref = inv.sample(i)
        parts = tuple((p.ext, os.path.relpath(p.path, inv.root), p.size) for p in ref.parts)
        out[ref.key] = (ref.label, parts)
    return out


def _ticks(raw: Path, fmt: InputFormat = InputFormat.AUTO, **kw: object) -> tuple[Inventory, int]:
    counted: list[int] = []
    inv = scan(str(raw), fmt, tick=counted.append, **kw)  # type: ignore[arg-type]
    return inv, sum(counted)


# --- class folders ------------------------------------------------------------------


def test_class_folders_nested_and_hidden(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _write(raw / "dog" / "b.jpg", b"bb")
    _write(raw / "cat" / "a.jpg", b"a")
    _write(raw / "cat" / "sub" / "deep" / "c.png", b"ccc")
    _write(raw / "cat" / "x.y.jpg", b"xy")  # class folders split at the LAST dot
    _write(raw / "cat" / ".DS_Store", b"junk")
    _write(raw / "cat" / ".ipynb_checkpoints" / "a-checkpoint.jpg", b"junk")
    _write(raw / ".git" / "HEAD", b"junk")  # hidden top-level folder is not a class
    _write(raw / "dog" / "sub" / ".hidden.jpg", b"junk")
    assert detect_format(str(raw)) is InputFormat.CLASS_FOLDERS
    inv, ticked = _ticks(raw)
    assert ticked == len(inv) == 4
    assert inv.class_names == ("cat", "dog")
    assert inv.class_counts() == [3, 1]
    assert _samples(inv) == {
        "cat__a": (0, (("jpg", "cat/a.jpg", 1),)),
        "cat__x_y": (0, (("jpg", "cat/x.y.jpg", 2),)),
        "cat__sub__deep__c": (0, (("png", "cat/sub/deep/c.png", 3),)),
        "dog__b": (1, (("jpg", "dog/b.jpg", 2),)),
    }
    # sorted: files of a folder before its sub-folders, classes in name order
    assert [inv.stem(i) for i in range(4)] == ["cat/a", "cat/x.y", "cat/sub/deep/c", "dog/b"]
    assert inv.sample(0).source == "cat/a.jpg"
    assert inv.sample(0).meta is None


def test_class_folders_sample_bytes(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _write(raw / "a" / "0.bin", b"")
    _write(raw / "a" / "1.bin", b"1" * 512)
    _write(raw / "b" / "2.bin", b"2" * 513)
    inv = scan(str(raw))
    # header 512 + padded data, + 1024 for the .cls member
    assert inv.sample_bytes().tolist() == [512 + 1024, 1024 + 1024, 1536 + 1024]


def test_empty_class_folder_is_an_error(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _write(raw / "cat" / "a.jpg")
    (raw / "dog").mkdir()
    _write(raw / "eel" / ".only-hidden")
    with pytest.raises(InputError) as info:
        scan(str(raw))
    message = str(info.value)
    assert "2 input problem(s)" in message
    assert f"{raw / 'dog'}: class folder has no files" in message
    assert f"{raw / 'eel'}: class folder has no files" in message


def test_file_without_extension_is_an_error(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _write(raw / "cat" / "a.jpg")
    _write(raw / "cat" / "README")
    _write(raw / "dog" / "sub" / "noext")
    with pytest.raises(InputError) as info:
        scan(str(raw), InputFormat.CLASS_FOLDERS)
    message = str(info.value)
    assert f"{raw / 'cat' / 'README'}: file has no extension" in message
    assert f"{raw / 'dog' / 'sub' / 'noext'}: file has no extension" in message


def test_broken_symlink_is_an_error_naming_the_file(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _write(raw / "cat" / "a.jpg")
    _write(tmp_path / "elsewhere.jpg", b"target")
    (raw / "cat" / "good.jpg").symlink_to(tmp_path / "elsewhere.jpg")
    (raw / "cat" / "dangling.jpg").symlink_to(tmp_path / "gone.jpg")
    with pytest.raises(InputError) as info:
        scan(str(raw))
    assert f"{raw / 'cat' / 'dangling.jpg'}: broken symlink" in str(info.value)
    assert info.value.path == str(raw / "cat" / "dangling.jpg")
    os.remove(raw / "cat" / "dangling.jpg")
    inv = scan(str(raw))  # a symlink to a file is followed
    assert _samples(inv)["cat__good"] == (0, (("jpg", "cat/good.jpg", 6),))


def test_class_folders_refuse_loose_files(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _write(raw / "cat" / "a.jpg")
    _write(raw / "stray.txt")
    with pytest.raises(InputError, match="stray.txt"):
        scan(str(raw), InputFormat.CLASS_FOLDERS)


def test_many_problems_are_reported_together(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for i in range(13):
        _write(raw / "cat" / f"noext{i:02d}")
    with pytest.raises(InputError) as info:
        scan(str(raw), InputFormat.CLASS_FOLDERS)
    message = str(info.value)
    assert message.startswith("14 input problem(s), nothing was written:")
    assert "noext09" in message and "noext10" not in message
    assert "... and 4 more" in message


# --- duplicate keys ------------------------------------------------------------------


def test_same_name_with_two_extensions_is_a_duplicate_key(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _write(raw / "cat" / "a.jpg")
    _write(raw / "cat" / "a.png")
    _write(raw / "cat" / "b.jpg")
    with pytest.raises(DuplicateKeyError) as info:
        scan(str(raw), InputFormat.CLASS_FOLDERS)
    err = info.value
    assert err.key == "cat__a"
    assert sorted(err.paths) == ["cat/a.jpg", "cat/a.png"]
    assert "'cat/a.jpg'" in str(err) and "'cat/a.png'" in str(err)
    assert isinstance(err, InputError)


def test_names_that_map_to_one_key_are_duplicates(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _write(raw / "cat" / "a b.jpg")
    _write(raw / "cat" / "a_b.jpg")
    with pytest.raises(DuplicateKeyError) as info:
        scan(str(raw))
    assert info.value.key == "cat__a_b"
    assert sorted(info.value.paths) == ["cat/a b.jpg", "cat/a_b.jpg"]


def test_folder_and_file_name_collision_is_a_duplicate(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _write(raw / "a" / "x" / "y.bin")  # stem a/x/y -> a__x__y
    _write(raw / "a" / "x__y.bin")  # stem a/x__y -> a__x__y
    with pytest.raises(DuplicateKeyError) as info:
        scan(str(raw))
    assert sorted(info.value.paths) == ["a/x/y.bin", "a/x__y.bin"]


# --- keyed files --------------------------------------------------------------------


def test_keyed_files_group_by_first_dot_stem_at_any_depth(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _write(raw / "0001.jpg", b"j1")
    _write(raw / "0001.seg.png", b"s1")
    _write(raw / "0001.json", b"{}")
    _write(raw / "0002.jpg", b"j2")
    _write(raw / "0002.cls", "7")  # a .cls part is the label, not a data part
    _write(raw / "part" / "deep" / "0003.jpg", b"j3")
    _write(raw / "part" / "deep" / "0003.txt", b"t3")
    _write(raw / ".DS_Store", b"junk")
    _write(raw / "part" / ".hidden.jpg", b"junk")
    with pytest.raises(InputError) as info:  # labels on some samples only
        scan(str(raw))
    assert "no .cls label, while other samples have one (2 such samples)" in str(info.value)
    assert str(raw / "0001") in str(info.value)
    os.remove(raw / "0002.cls")
    # top-level files beside a folder, and no .cls: ambiguous (class folders plus a stray file?)
    with pytest.raises(InputError, match="ambiguous layout.*pass --format keyed"):
        detect_format(str(raw))
    inv, ticked = _ticks(raw, InputFormat.KEYED)
    assert ticked == len(inv) == 3
    assert inv.class_names is None
    assert inv.label.tolist() == [-1, -1, -1]
    assert inv.class_counts() == []
    assert _samples(inv) == {
        "0001": (
            -1,
            (("jpg", "0001.jpg", 2), ("json", "0001.json", 2), ("seg.png", "0001.seg.png", 2)),
        ),
        "0002": (-1, (("jpg", "0002.jpg", 2),)),
        "part__deep__0003": (
            -1,
            (("jpg", "part/deep/0003.jpg", 2), ("txt", "part/deep/0003.txt", 2)),
        ),
    }
    assert inv.sample(0).source == "0001"  # several parts: the stem
    assert inv.sample(1).source == "0002.jpg"  # one part: the file


def test_keyed_integer_labels_keep_their_value(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for stem, label in [("a", "3"), ("b", "0\n"), ("c", "7"), ("d", "3")]:
        _write(raw / f"{stem}.jpg", stem.encode())
        _write(raw / f"{stem}.cls", label)
    inv = scan(str(raw))
    assert inv.class_names == ("0", "1", "2", "3", "4", "5", "6", "7")
    assert {inv.key(i): int(inv.label[i]) for i in range(len(inv))} == {
        "a": 3,
        "b": 0,
        "c": 7,
        "d": 3,
    }
    assert inv.class_counts() == [1, 0, 0, 2, 0, 0, 0, 1]


def test_keyed_text_labels_are_sorted(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for stem, label in [("a", "zebra"), ("b", "apple"), ("c", "mango\n"), ("d", "apple")]:
        _write(raw / "x" / f"{stem}.jpg", stem.encode())
        _write(raw / "x" / f"{stem}.cls", label)
    assert detect_format(str(raw)) is InputFormat.KEYED  # keyed files in a sub-folder
    inv = scan(str(raw))
    assert inv.class_names == ("apple", "mango", "zebra")
    labels = {inv.key(i): int(inv.label[i]) for i in range(len(inv))}
    assert labels == {"x__a": 2, "x__b": 0, "x__c": 1, "x__d": 0}


def test_keyed_decimal_and_text_labels_are_refused(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for stem, label in [("a", "10"), ("b", "2"), ("c", "cat")]:
        _write(raw / f"{stem}.jpg")
        _write(raw / f"{stem}.cls", label)
    # numbering them as names would make '10' class 0 and '2' class 1: never silently
    with pytest.raises(InputError, match="a.cls has a decimal label .*c.cls a string class"):
        scan(str(raw))


def test_keyed_errors(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _write(raw / "a.jpg")
    _write(raw / "a.cls", "cat")
    _write(raw / "b.cls", "dog")  # label without data
    _write(raw / "c.jpg")
    _write(raw / "c.cls", "  ")  # empty label
    _write(raw / "d", b"no extension")
    with pytest.raises(InputError) as info:
        scan(str(raw), InputFormat.KEYED)
    message = str(info.value)
    assert f"{raw / 'b'}: sample has a label but no data parts" in message
    assert f"{raw / 'c.cls'}: empty .cls label file" in message
    assert f"{raw / 'd'}: file has no extension" in message


# --- listings --------------------------------------------------------------------------


def _listing_files(root: Path, n: int = 4) -> None:
    for i in range(n):
        _write(root / "img" / f"{i}.jpg", payload(0, i))


def test_csv_listing_with_label_and_extra_columns(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    _listing_files(root)
    rows = ["path,label,caption,width"] + [
        f"img/{i}.jpg,{'dog' if i % 2 else 'cat'},hello {i},{10 * i}" for i in range(4)
    ]
    listing = _write(root / "train.csv", "\n".join(rows) + "\n")
    assert detect_format(str(listing)) is InputFormat.LISTING
    inv, ticked = _ticks(listing)
    assert ticked == len(inv) == 4
    assert inv.class_names == ("cat", "dog")
    assert inv.label.tolist() == [0, 1, 0, 1]
    ref = inv.sample(1)
    assert ref.key == "img__1"
    assert ref.source == "img/1.jpg"
    assert [(p.ext, p.path, p.size) for p in ref.parts] == [
        ("jpg", str(root / "img" / "1.jpg"), len(payload(0, 1)))
    ]
    assert json.loads(ref.meta) == {"caption": "hello 1", "width": "10"}


def test_jsonl_listing_with_custom_columns(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    _listing_files(root)
    lines = [
        json.dumps({"file": f"img/{i}.jpg", "y": i % 3, "label": "ignored", "box": [i, i]})
        for i in range(4)
    ]
    listing = _write(root / "list.jsonl", "\n".join(lines) + "\n\n")  # blank line ignored
    inv = scan(str(listing), path_column="file", label_column="y")
    assert inv.class_names == ("0", "1", "2")  # integer labels keep their value
    assert inv.label.tolist() == [0, 1, 2, 0]
    assert json.loads(inv.sample(3).meta) == {"label": "ignored", "box": [3, 3]}


def test_listing_without_labels_or_extras(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    _listing_files(root, 2)
    listing = _write(root / "l.tsv", "path\nimg/0.jpg\nimg/1.jpg\n")
    inv = scan(str(listing))
    assert inv.class_names is None
    assert inv.label.tolist() == [-1, -1]
    assert inv.sample(0).meta == b""  # no extra columns: no .json member


def test_listing_extra_columns_become_a_json_member(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    _listing_files(root, 3)
    _write(root / "img" / "3.json", b'{"own": 1}')  # a sample's own .json part
    rows = ["path,label,note"] + [f"img/{i}.jpg,c{i % 2},n{i}" for i in range(3)]
    rows.append("img/3.json,c1,n3")
    listing = _write(root / "l.csv", "\n".join(rows) + "\n")
    out = tmp_path / "out"
    shardprep.build(str(listing), str(out), shards=1, workers=1, progress=False)
    with tarfile.open(out / "shard-00000.tar") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar}
    for i in range(3):
        assert members[f"img__{i}.jpg"] == payload(0, i)
        assert json.loads(members[f"img__{i}.json"]) == {"note": f"n{i}"}
        assert members[f"img__{i}.cls"] == str(i % 2).encode()
    # the metadata member does not clobber a .json data part
    assert members["img__3.json"] == b'{"own": 1}'
    assert json.loads(members["img__3.meta.json"]) == {"note": "n3"}
    assert len(members) == 3 * 3 + 3


@pytest.mark.parametrize(
    ("content", "kwargs", "expected"),
    [
        ("file,label\nimg/0.jpg,a\n", {}, "no 'path' column"),
        ("path,label\nimg/0.jpg,a\n", {"path_column": "file"}, "no 'file' column"),
        ("path,label\nimg/0.jpg,a\n", {"label_column": "cls"}, "no label column 'cls'"),
        ("path\n", {}, "the listing has no rows"),
        (
            "path,label\nimg/0.jpg,a\nimg/1.jpg,\n",
            {},
            "bad.csv:3: no label, while line 2 has one (1 row(s) without)",
        ),
        ("path\n../ds/img/0.jpg\n", {}, "outside the listing's folder"),
        ("path\nimg/../../x.jpg\n", {}, "outside the listing's folder"),
        ("path\n/etc/hostname\n", {}, "outside the listing's folder"),
        ("path\n\n", {}, None),  # csv skips blank lines: no rows
        ("path\nimg/missing.jpg\n", {}, "cannot stat"),
        ("path\nimg\n", {}, "has no extension"),
    ],
)
def test_bad_csv_listings(
    tmp_path: Path, content: str, kwargs: dict[str, str], expected: str | None
) -> None:
    root = tmp_path / "ds"
    _listing_files(root, 2)
    listing = _write(root / "bad.csv", content)
    with pytest.raises(InputError) as info:
        scan(str(listing), **kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert str(listing) in message
    if expected:
        assert expected in message
    if "missing" in content:
        assert str(root / "img" / "missing.jpg") in message


@pytest.mark.parametrize(
    ("line", "expected"), [("{not json", "bad.jsonl:2: invalid JSON"), ("[1, 2]", "JSON object")]
)
def test_bad_jsonl_listings(tmp_path: Path, line: str, expected: str) -> None:
    root = tmp_path / "ds"
    _listing_files(root, 1)
    listing = _write(root / "bad.jsonl", '{"path": "img/0.jpg"}\n' + line + "\n")
    with pytest.raises(InputError, match=expected.replace("[", r"\[")):
        scan(str(listing))


def test_listing_duplicate_rows_are_duplicate_keys(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    _listing_files(root, 2)
    listing = _write(root / "l.csv", "path\nimg/0.jpg\nimg/1.jpg\nimg/./0.jpg\n")
    with pytest.raises(DuplicateKeyError) as info:
        scan(str(listing))
    assert info.value.paths == ("img/0.jpg", "img/0.jpg")


# --- existing tar shards ---------------------------------------------------------------


def _tar_bytes(members: list[tuple[str, bytes]], dirs: tuple[str, ...] = ()) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_tar_written_with_tarfile(tmp_path: Path) -> None:
    raw = tmp_path / "tars"
    first = [
        ("train/0001.jpg", b"J1" * 300),
        ("train/0001.cls", b"zebra"),
        ("train/0001.txt", b"T1"),
        ("__index__", b"{}"),  # WebDataset metadata member (its skip_meta): skipped
        ("train/0002.jpg", b"J2"),
        ("train/0002.cls", b"apple\n"),
        ("L" * 120 + ".jpg", b"long"),  # GNU long name
        ("L" * 120 + ".cls", b"apple"),
    ]
    second = [("x.jpg", b"XY"), ("x.cls", b"mango")]
    _write(raw / "b.tar", _tar_bytes(second))
    _write(raw / "a.tar", _tar_bytes(first, dirs=("train/",)))
    assert detect_format(str(raw)) is InputFormat.TAR
    inv, ticked = _ticks(raw)
    assert ticked == len(inv) == 4
    assert inv.class_names == ("apple", "mango", "zebra")
    samples = {inv.key(i): inv.sample(i) for i in range(len(inv))}
    assert list(samples) == ["train__0001", "train__0002", "L" * 120, "x"]
    assert [s.label for s in samples.values()] == [2, 0, 0, 1]
    ref = samples["train__0001"]
    assert ref.label == 2
    assert ref.source == "a.tar:train/0001"
    assert [(p.ext, p.size) for p in ref.parts] == [("jpg", 600), ("txt", 2)]
    blob = (raw / "a.tar").read_bytes()
    for p in ref.parts:
        assert p.path == str(raw / "a.tar")
    assert blob[ref.parts[0].offset : ref.parts[0].offset + 600] == b"J1" * 300
    assert blob[ref.parts[1].offset : ref.parts[1].offset + 2] == b"T1"


def test_tar_labels_on_some_samples_only(tmp_path: Path) -> None:
    raw = tmp_path / "tars"
    _write(
        raw / "a.tar",
        _tar_bytes([("a.jpg", b"1"), ("a.cls", b"3"), ("b.jpg", b"2"), ("c.jpg", b"3")]),
    )
    with pytest.raises(InputError, match="2 sample\\(s\\) have no .cls while others do"):
        scan(str(raw))


def test_single_tar_file_input(tmp_path: Path) -> None:
    tar_path = _write(tmp_path / "one.tar", _tar_bytes([("a.jpg", b"A"), ("b.jpg", b"BB")]))
    assert detect_format(str(tar_path)) is InputFormat.TAR
    inv = scan(str(tar_path))
    assert [inv.key(i) for i in range(len(inv))] == ["a", "b"]
    assert inv.class_names is None
    assert inv.sample(1).source == "one.tar:b"


def test_unreadable_tar_is_an_error(tmp_path: Path) -> None:
    raw = tmp_path / "tars"
    _write(raw / "good.tar", _tar_bytes([("a.jpg", b"A")]))
    _write(raw / "bad.tar", b"this is not a tar file" * 100)
    with pytest.raises(InputError) as info:
        scan(str(raw))
    assert f"{raw / 'bad.tar'}: cannot read as an uncompressed tar" in str(info.value)


def test_tar_member_without_extension_is_an_error(tmp_path: Path) -> None:
    raw = _write(tmp_path / "t.tar", _tar_bytes([("a.jpg", b"A"), ("README", b"r")]))
    with pytest.raises(InputError, match="README: member has no extension"):
        scan(str(raw))


def test_reshard_a_shardprep_output(built: Path, tmp_path: Path) -> None:
    """A built OUT (shards + .idx + manifest.json) is tar input; labels come from .cls."""
    assert detect_format(str(built)) is InputFormat.TAR
    inv = scan(str(built))
    assert len(inv) == 103
    assert inv.class_names == ("0", "1", "2")  # integer .cls values keep their meaning
    assert inv.class_counts() == [60, 30, 13]
    expected_keys = {
        f"{c}__{i:05d}"
        for c, lo, hi in [("a", 0, 60), ("b", 60, 90), ("c", 90, 103)]
        for i in range(lo, hi)
    }
    assert {inv.key(i) for i in range(len(inv))} == expected_keys
    for i in range(len(inv)):
        ref = inv.sample(i)
        assert [p.ext for p in ref.parts] == ["bin"]  # .cls became the label
        assert ref.source.startswith("shard-0000") and ref.source.endswith(f":{ref.key}")
    # ... and re-shards into byte-identical samples with the same labels
    out = tmp_path / "reshard"
    summary = shardprep.build(str(built), str(out), shards=5, workers=1, progress=False)
    assert summary.num_samples == 103 and summary.num_shards == 5
    seen = {}
    for s in range(5):
        with tarfile.open(out / f"shard-{s:05d}.tar") as tar:
            for m in tar:
                seen[m.name] = tar.extractfile(m).read()
    assert len(seen) == 2 * 103
    for key in expected_keys:
        index = int(key[3:])
        label = 0 if index < 60 else 1 if index < 90 else 2
        assert seen[f"{key}.bin"] == payload(label, index)
        assert seen[f"{key}.cls"] == str(label).encode()


# --- auto-detection ---------------------------------------------------------------------


def test_detect_format_of_each_layout(tmp_path: Path) -> None:
    classes = tmp_path / "classes"
    _write(classes / "cat" / "1.jpg")
    _write(classes / "dog" / "2.jpg")
    assert detect_format(str(classes)) is InputFormat.CLASS_FOLDERS

    flat = tmp_path / "flat"
    _write(flat / "1.jpg")
    assert detect_format(str(flat)) is InputFormat.KEYED

    nested_keyed = tmp_path / "nested"
    _write(nested_keyed / "part0" / "1.jpg")
    _write(nested_keyed / "part0" / "1.json")
    # folders only and no .cls: class folders, whatever the file names (the scan then refuses
    # the two files that would be one keyed sample, asking for --format)
    assert detect_format(str(nested_keyed)) is InputFormat.CLASS_FOLDERS
    _write(nested_keyed / "part0" / "1.cls", "3")
    assert detect_format(str(nested_keyed)) is InputFormat.KEYED

    for name in ("l.csv", "l.tsv", "l.jsonl", "l.ndjson", "L.CSV"):
        assert detect_format(str(_write(tmp_path / "listings" / name, "path\n"))) is (
            InputFormat.LISTING
        )

    tars = tmp_path / "tars"
    _write(tars / "a.tar", _tar_bytes([("a.jpg", b"")]))
    _write(tars / ".hidden", b"")
    assert detect_format(str(tars)) is InputFormat.TAR
    assert detect_format(str(tars / "a.tar")) is InputFormat.TAR

    mixed = tmp_path / "mixed"
    _write(mixed / "a.tar", b"")
    _write(mixed / "a.txt", b"")
    assert detect_format(str(mixed)) is InputFormat.KEYED


def test_detect_format_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file or folder") as info:
        detect_format(str(tmp_path / "missing"))
    assert info.value.path == str(tmp_path / "missing")
    empty = tmp_path / "empty"
    _write(empty / ".DS_Store")
    with pytest.raises(InputError, match="the folder is empty"):
        detect_format(str(empty))
    with pytest.raises(
        InputError,
        match=r"must be a .csv/.tsv/.jsonl listing, a .tar shard or a Parquet file \(.parquet",
    ):
        detect_format(str(_write(tmp_path / "data.zip")))
    only_dirs = tmp_path / "only_dirs"
    (only_dirs / "a" / "b").mkdir(parents=True)
    with pytest.raises(InputError, match="no files found"):
        detect_format(str(only_dirs))


def test_scan_with_explicit_format_of_missing_input(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file or folder"):
        scan(str(tmp_path / "nope"), InputFormat.CLASS_FOLDERS)


def test_scan_order_is_sorted_and_repeatable(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    rng = np.random.default_rng(0)
    names = [f"{int(x):06d}" for x in rng.permutation(200)]
    for n in names:  # created in random order
        _write(raw / ("b" if int(n) % 2 else "a") / f"{n}.bin")
    first, second = scan(str(raw)), scan(str(raw))
    keys = [first.key(i) for i in range(len(first))]
    assert keys == sorted(keys)
    assert keys == [second.key(i) for i in range(len(second))]
    assert first.stem_blob == second.stem_blob


def test_a_big_folder_is_sorted_in_spilled_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Names merged from runs of 3 come out as sorted() would (odd bytes, dots, digits)."""
    names = ["b.bin", "a.bin", "a-b.bin", "Z.bin", "é.bin", "a.b.bin", "10.bin", "9.bin"]
    names += [f"n{i:03d}.bin" for i in range(20, 0, -1)] + [".hidden.bin"]
    for name in names:
        (tmp_path / "raw" / "c").mkdir(parents=True, exist_ok=True)
        (tmp_path / "raw" / "c" / name).write_bytes(b"x")
    odd = os.fsdecode(b"\xff-raw.bin")  # not UTF-8: kept through the spill as surrogates
    (tmp_path / "raw" / "c" / odd).write_bytes(b"x")
    visible = sorted([n for n in names if not n.startswith(".")] + [odd])
    assert list(walk.sorted_names(str(tmp_path / "raw" / "c"), run=3)) == visible
    expected = scan(str(tmp_path / "raw"))
    monkeypatch.setattr(walk, "RUN_NAMES", 3)
    spilled = scan(str(tmp_path / "raw"))
    every = np.arange(len(visible))
    assert spilled.samples(every) == expected.samples(every)
    assert [s.source for s in spilled.samples(every)] == [f"c/{n}" for n in visible]
