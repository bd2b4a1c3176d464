"""A build from a Python iterable refuses a bad sample by its key (or its position) before
anything is written to OUT, and leaves no scratch folder; checks that need no sample run
before the iterable is touched."""

from __future__ import annotations

import errno
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shardprep
from shardprep.format.errors import BuildInterrupted, InputError, OutputError
from tests.filesystems import tmpfs


@pytest.fixture(autouse=True)
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's TMPDIR, so the test can check that no spill is left behind."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def good(i: int) -> dict[str, Any]:
    return {"__key__": f"k{i:03d}", "cls": "cat" if i % 2 else "dog", "jpg": b"x" * (i + 1)}


def _stream(bad: Any, at: int = 5, count: int = 10) -> Iterator[Any]:
    """``count`` good samples with ``bad`` in place of sample ``at``."""
    for i in range(count):
        yield bad if i == at else good(i)


def _refused(samples: Any, tmp_path: Path, match: str, **options: Any) -> InputError:
    out = tmp_path / "out"
    with pytest.raises(InputError) as info:
        shardprep.build(samples, str(out), shards=2, workers=1, progress=False, **options)
    assert match in str(info.value), str(info.value)
    assert not out.exists()  # nothing was written to OUT
    assert os.listdir(tempfile.gettempdir()) == []  # the spill is gone
    return info.value


BAD_SAMPLES = [
    # (the sample at position 5, words the message must hold)
    ({"cls": "cat", "jpg": b"x"}, "sample #5 (counting from 0) has no '__key__'"),
    (("k005", b"x"), "sample #5 (counting from 0) is a tuple, not a dict"),
    ({"__key__": "a.b", "jpg": b"x", "cls": "cat"}, "sample #5 (counting from 0): __key__ 'a.b'"),
    ({"__key__": "_k", "jpg": b"x", "cls": "cat"}, "__key__ '_k' is not a valid sample key"),
    ({"__key__": "a b", "jpg": b"x", "cls": "cat"}, "__key__ 'a b' is not a valid sample key"),
    ({"__key__": 5, "jpg": b"x", "cls": "cat"}, "__key__ 5 is not a valid sample key"),
    ({"__key__": "k", "jpg": 3, "cls": "cat"}, "sample 'k': .jpg is a int; a member must be"),
    ({"__key__": "k", "jpg": None, "cls": "cat"}, "sample 'k': .jpg is a NoneType"),
    ({"__key__": "k", "json": [1, 2], "cls": "cat"}, "sample 'k': .json is a list"),
    ({"__key__": "k", "txt": "\udcff", "cls": "cat"}, "sample 'k': .txt is a str that is not"),
    ({"__key__": "k", "json": {"a": b"x"}, "cls": "cat"}, "sample 'k': .json is a dict that"),
    ({"__key__": "k", "json": {"a": math.nan}, "cls": "cat"}, "sample 'k': .json is a dict"),
    (
        {"__key__": "k", "image": {"bytes": b"\xff", "path": "a.jpg"}, "cls": "cat"},
        "pass its 'bytes' as the member instead",
    ),
    ({"__key__": "k", "a/b": b"x", "cls": "cat"}, "sample 'k': 'a/b' is not a valid member"),
    ({"__key__": "k", ".jpg": b"x", "cls": "cat"}, "sample 'k': '.jpg' is not a valid member"),
    ({"__key__": "k", "": b"x", "cls": "cat"}, "sample 'k': '' is not a valid member"),
    ({"__key__": "k", "cls": "cat"}, "sample 'k' has no data member"),
    ({"__key__": "k", "jpg": b"x"}, "sample 'k' has no cls while sample 'k000' has one"),
    (
        {"__key__": "k", "jpg": b"x", "cls": 1},
        "sample 'k' has an integer label (a class index) and sample 'k000' a string class name",
    ),
    ({"__key__": "k", "jpg": b"x", "cls": True}, "sample 'k': cls True is a bool"),
    ({"__key__": "k", "jpg": b"x", "cls": 1.0}, "sample 'k': cls 1.0 is a float"),
    ({"__key__": "k", "jpg": b"x", "cls": None}, "sample 'k': cls None is a NoneType"),
    ({"__key__": "k", "jpg": b"x", "cls": " cat"}, "sample 'k': cls ' cat' has whitespace"),
    ({"__key__": "k", "jpg": b"x", "cls": "cat "}, "sample 'k': cls 'cat ' has whitespace"),
    ({"__key__": "k", "jpg": b"x", "cls": ""}, "sample 'k': cls '' is empty"),
]


@pytest.mark.parametrize(("bad", "match"), BAD_SAMPLES)
def test_bad_sample_is_refused_by_its_key_or_position(bad: Any, match: str, tmp_path: Path) -> None:
    pulled: list[int] = []

    def counted() -> Iterator[Any]:
        for i, s in enumerate(_stream(bad)):
            pulled.append(i)
            yield s

    _refused(counted(), tmp_path, match)
    assert pulled == list(range(6))  # nothing after the bad sample was read


def test_negative_class_index_and_labels_missing_on_the_first(tmp_path: Path) -> None:
    ints = ({"__key__": f"k{i}", "jpg": b"x", "cls": 2 - i} for i in range(5))
    _refused(ints, tmp_path, "sample 'k3': cls -1 is a negative class index")
    first_unlabelled = iter(
        [{"__key__": "a", "jpg": b"x"}, {"__key__": "b", "jpg": b"x", "cls": 0}]
    )
    _refused(first_unlabelled, tmp_path, "sample 'a' has no cls while sample 'b' has one")


def test_decimal_strs_go_with_ints_not_with_names(tmp_path: Path) -> None:
    """ "3" and 3 are one class index; "10" among names is refused, as in a listing (numbered
    as a name it would be class 0, not 10)."""
    mixed = [{"__key__": f"k{i}", "jpg": b"x", "cls": [0, "1", 2][i % 3]} for i in range(6)]
    shardprep.build(mixed, str(tmp_path / "a"), shards=2, workers=1, progress=False)
    assert shardprep.read_manifest(str(tmp_path / "a")).class_names == ("0", "1", "2")
    named = [{"__key__": f"k{i}", "jpg": b"x", "cls": ["b", "10", "a"][i % 3]} for i in range(6)]
    _refused(
        named,
        tmp_path,
        "sample 'k1' has a decimal label (a class index) and sample 'k0' a string class name",
    )


def test_duplicate_key_is_refused_before_out_is_written(tmp_path: Path) -> None:
    samples = [good(i) for i in range(10)] + [good(3)]
    error = _refused(samples, tmp_path, "sample key 'k003' is given to more than one sample")
    assert "nothing was written to OUT" in str(error)


def test_weight_member_is_refused_with_weights_only(tmp_path: Path) -> None:
    samples = [good(i) | {"weight": b"1"} for i in range(4)]
    _refused(
        samples,
        tmp_path,
        "sample 'k000': the member 'weight' would clash",
        class_weights="balanced",
        weights_only=True,
    )


def test_empty_iterable_and_format_are_refused(tmp_path: Path) -> None:
    _refused(iter([]), tmp_path, "the samples iterable yielded no samples")
    message = (
        "input_format='tar' names a layout of files; samples given as a Python iterable have "
        "none: leave it out"
    )
    _refused([good(0)], tmp_path, message, input_format="tar")  # the keyword, not --format


def _untouched() -> Iterator[dict[str, Any]]:
    raise AssertionError("the iterable was read although the build was refused up front")
    yield {}  # a generator: the assertion fires on the first next()


def test_refusals_that_need_no_sample_come_before_the_iterable_is_read(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("not ours")
    with pytest.raises(InputError, match="pass overwrite=True to replace a previous build"):
        shardprep.build(_untouched(), str(out), shards=2, progress=False)
    with pytest.raises(InputError, match="resume here; call shardprep.build without resume=True"):
        shardprep.build(_untouched(), str(tmp_path / "none"), shards=2, resume=True)
    with pytest.raises(
        InputError, match="^engine='ray' on a cluster cannot build from a Python iterable yet"
    ):
        shardprep.build(
            _untouched(), str(tmp_path / "o"), shards=2, engine="ray", ray_address="ray://h:1"
        )
    with pytest.raises(InputError, match="the output folder holds TMPDIR"):
        shardprep.build(_untouched(), str(tmp_path), shards=2, overwrite=True)
    assert (out / "keep.txt").read_text() == "not ours"
    assert sorted(os.listdir(tmp_path)) == ["out", "tmp"]


def test_an_error_of_the_iterable_itself_passes_through(tmp_path: Path) -> None:
    def failing() -> Iterator[dict[str, Any]]:
        yield good(0)
        raise RuntimeError("the pipeline broke")

    with pytest.raises(RuntimeError, match="the pipeline broke"):
        shardprep.build(failing(), str(tmp_path / "out"), shards=2, progress=False)
    assert not (tmp_path / "out").exists()
    assert os.listdir(tempfile.gettempdir()) == []


def test_ctrl_c_while_spilling_says_nothing_was_written(tmp_path: Path) -> None:
    def interrupted() -> Iterator[dict[str, Any]]:
        yield good(0)
        raise KeyboardInterrupt

    with pytest.raises(BuildInterrupted, match="before anything was written") as info:
        shardprep.build(interrupted(), str(tmp_path / "out"), shards=2, progress=False)
    assert not info.value.resumable
    assert not (tmp_path / "out").exists()
    assert os.listdir(tempfile.gettempdir()) == []


def test_full_scratch_disk_is_an_output_error_with_advice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with tmpfs(tmp_path / "small", "size=256k") as small:
        monkeypatch.setattr(tempfile, "tempdir", str(small))
        samples = ({"__key__": f"k{i}", "bin": bytes(64 << 10)} for i in range(16))
        with pytest.raises(OutputError, match="no room to spill the samples") as info:
            shardprep.build(samples, str(tmp_path / "out"), shards=2, progress=False)
        assert "set TMPDIR to a folder on a disk with room" in str(info.value)
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == errno.ENOSPC
        assert os.listdir(small) == []
    assert not (tmp_path / "out").exists()
