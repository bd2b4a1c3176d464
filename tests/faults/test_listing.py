"""Issue 9 item 5: listings: BOM, extra fields, labels with line numbers, symlink confinement."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest

from tests.faults.helpers import error_lines, invoke, write


def _dataset(root: Path, n: int = 4) -> Path:
    for i in range(n):
        write(root / "img" / f"{i}.jpg", f"jpeg {i}")
    return root


def _members(out: Path) -> dict[str, bytes]:
    with tarfile.open(out / "shard-00000.tar") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar}  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["list.csv", "list.jsonl"])
def test_a_utf8_bom_is_accepted(tmp_path: Path, name: str) -> None:
    root = _dataset(tmp_path / "ds", 2)
    if name.endswith(".csv"):
        text = "path,label\nimg/0.jpg,cat\nimg/1.jpg,dog\n"
    else:
        text = '{"path": "img/0.jpg", "label": "cat"}\n{"path": "img/1.jpg", "label": "dog"}\n'
    listing = write(root / name, b"\xef\xbb\xbf" + text.encode())
    out = tmp_path / "out"
    result = invoke("build", str(listing), str(out), "-n", "1", "-q", "-j", "1")
    assert result.exit_code == 0, result.output
    assert _members(out) == {
        "img__0.jpg": b"jpeg 0",
        "img__0.cls": b"0",
        "img__1.jpg": b"jpeg 1",
        "img__1.cls": b"1",
    }


@pytest.mark.parametrize(
    ("row", "fields"),
    [("img/1.jpg,dog,extra", 3), ('img/1.jpg,"a,b",c,d', 4), ("img/1.jpg", 1)],
    ids=["one-extra", "two-extra", "missing"],
)
def test_a_row_with_other_field_count_names_its_line(tmp_path: Path, row: str, fields: int) -> None:
    root = _dataset(tmp_path / "ds")
    listing = write(root / "list.csv", f"path,label\nimg/0.jpg,cat\n{row}\nimg/2.jpg,cat\n")
    result = invoke("build", str(listing), str(tmp_path / "out"), "-n", "1", "-q")
    assert result.exit_code == 1
    assert error_lines(result) == [
        f"Error: {listing}:3: {fields} fields, the header has 2; quote fields that hold the "
        "delimiter"
    ]


def test_bad_and_missing_labels_name_their_lines(tmp_path: Path) -> None:
    root = _dataset(tmp_path / "ds", 5)
    rows = [
        {"path": "img/0.jpg", "label": "cat"},
        {"path": "img/1.jpg", "label": [1, 2]},
        {"path": "img/2.jpg"},
        {"path": "img/3.jpg", "label": True},
        {"path": "img/4.jpg", "label": " "},
    ]
    listing = write(root / "list.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    result = invoke("build", str(listing), str(tmp_path / "out"), "-n", "1", "-q")
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "Error: 4 input problem(s), nothing was written:",
        f"  {listing}:2: label [1, 2] is not a string or an integer",
        f"  {listing}:4: label True is not a string or an integer",
        f"  {listing}:3: no label, while line 1 has one (2 row(s) without); label every row or none",
        f"  {listing}:5: no label, while line 1 has one (2 row(s) without); label every row or none",
    ]


def test_integer_labels_are_accepted(tmp_path: Path) -> None:
    root = _dataset(tmp_path / "ds", 2)
    listing = write(
        root / "list.jsonl",
        '{"path": "img/0.jpg", "label": 3}\n{"path": "img/1.jpg", "label": 0}\n',
    )
    out = tmp_path / "out"
    result = invoke("build", str(listing), str(out), "-n", "1", "-q", "-j", "1")
    assert result.exit_code == 0, result.output
    assert _members(out)["img__0.cls"] == b"3"


def test_a_symlink_out_of_the_listing_folder_is_refused(tmp_path: Path) -> None:
    root = _dataset(tmp_path / "ds", 2)
    secret = write(tmp_path / "elsewhere" / "secret.jpg", "not yours")
    os.symlink(secret, root / "img" / "link.jpg")
    os.symlink(tmp_path / "elsewhere", root / "dirlink")
    os.symlink(root / "img" / "0.jpg", root / "inside.jpg")  # a link inside the folder is fine
    listing = write(
        root / "list.csv", "path\nimg/0.jpg\nimg/link.jpg\ndirlink/secret.jpg\ninside.jpg\n"
    )
    out = tmp_path / "out"
    result = invoke("build", str(listing), str(out), "-n", "1", "-q")
    assert result.exit_code == 1
    real = os.path.realpath(secret)
    assert result.stderr.splitlines() == [
        "Error: 2 input problem(s), nothing was written:",
        f"  {listing}:3: 'img/link.jpg' resolves to {real}, outside the listing's folder "
        f"{root} (symlinks are resolved); copy the file in or move the listing up",
        f"  {listing}:4: 'dirlink/secret.jpg' resolves to {real}, outside the listing's folder "
        f"{root} (symlinks are resolved); copy the file in or move the listing up",
    ]
    assert not out.exists()
    write(listing, "path\nimg/0.jpg\ninside.jpg\n")
    result = invoke("build", str(listing), str(out), "-n", "1", "-q", "-j", "1")
    assert result.exit_code == 0, result.output
    assert _members(out) == {"img__0.jpg": b"jpeg 0", "inside.jpg": b"jpeg 0"}
