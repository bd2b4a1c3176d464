"""Issue 9 item 4: tar input with link members is refused, never a label without data."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from tests.faults.helpers import invoke, write


def _tar(path: Path, members: list[tarfile.TarInfo | tuple[str, bytes]]) -> Path:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
            else:
                info = tarfile.TarInfo(member[0])
                info.size = len(member[1])
                tar.addfile(info, io.BytesIO(member[1]))
    return write(path, buffer.getvalue())


def _link(name: str, target: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize(
    ("kind", "what"),
    [(tarfile.SYMTYPE, "a symbolic link"), (tarfile.LNKTYPE, "a hard link")],
    ids=["symlink", "hardlink"],
)
def test_link_members_are_refused_naming_tar_and_member(
    tmp_path: Path, kind: bytes, what: str
) -> None:
    tar = _tar(
        tmp_path / "raw" / "in.tar",
        [
            ("a.jpg", b"A"),
            ("a.cls", b"0"),
            _link("b.jpg", "a.jpg", kind),
            ("b.cls", b"1"),
            ("c.jpg", b"C"),
            ("c.cls", b"1"),
        ],
    )
    out = tmp_path / "out"
    result = invoke("build", str(tmp_path / "raw"), str(out), "-n", "1", "-q")
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert lines[0] == "Error: 2 input problem(s), nothing was written:"
    assert lines[1:] == [
        f"  {tar}:b.jpg: member is {what} to 'a.jpg'; links are not followed: store the file "
        "itself in the tar (tar --dereference --hard-dereference)",
        f"  {tar}:b: sample has no data members, only a label",
    ]
    assert not out.exists()


def test_a_label_without_data_is_refused(tmp_path: Path) -> None:
    tar = _tar(tmp_path / "in.tar", [("a.jpg", b"A"), ("a.cls", b"0"), ("b.cls", b"1")])
    result = invoke("build", str(tar), str(tmp_path / "out"), "-n", "1", "-q")
    assert result.exit_code == 1
    assert f"  {tar}:b: sample has no data members, only a label" in result.stderr.splitlines()


def test_directory_members_are_skipped(tmp_path: Path) -> None:
    folder = tarfile.TarInfo("d")
    folder.type = tarfile.DIRTYPE
    tar = _tar(tmp_path / "in.tar", [folder, ("d/a.jpg", b"A"), ("d/a.cls", b"0")])
    result = invoke("build", str(tar), str(tmp_path / "out"), "-n", "1", "-q")
    assert result.exit_code == 0, result.output
