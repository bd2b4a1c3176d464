"""The pure parts of versions (issue 37): the class union of an append, and the validation of a
manifest's ``versions`` field (each edit below is refused naming what is wrong)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardprep
from shardprep.append import class_union
from shardprep.format.errors import InputError, ManifestError
from shardprep.format.manifest import parse_manifest
from tests.conftest import write_class_folders


def test_class_union_keeps_the_build_indices() -> None:
    names, mapping = class_union(("dog", "zebra"), ("cat", "dog"), "OUT", "NEW")
    assert names == ("dog", "zebra", "cat")
    assert mapping is not None and mapping.tolist() == [2, 0]
    assert class_union(("a", "b"), ("a", "b"), "OUT", "NEW") == (("a", "b"), None)
    names, mapping = class_union(("a", "b", "c"), ("a", "b"), "OUT", "NEW")
    assert (names, mapping) == (("a", "b", "c"), None)
    assert class_union(None, None, "OUT", "NEW") == (None, None)


def test_class_union_of_integer_labels_is_the_longer_range() -> None:
    assert class_union(("0", "1"), ("0", "1", "2", "3"), "OUT", "NEW") == (
        ("0", "1", "2", "3"),
        None,
    )
    assert class_union(("0", "1", "2"), ("0",), "OUT", "NEW") == (("0", "1", "2"), None)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (("0", "1"), ("cat",), "OUT has integer labels .* and NEW class names"),
        (("cat",), ("0", "1"), "NEW has integer labels .* and OUT class names"),
        (("cat",), None, "OUT is labelled and NEW is not"),
        (None, ("cat",), "NEW is labelled and OUT is not"),
    ],
)
def test_class_union_refusals(
    old: tuple[str, ...] | None, new: tuple[str, ...] | None, message: str
) -> None:
    with pytest.raises(InputError, match=message):
        class_union(old, new, "OUT", "NEW")


@pytest.fixture(scope="module")
def appended(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("versions")
    out = base / "out"
    shardprep.build(str(write_class_folders(base / "a", {"x": 9, "y": 5})), str(out), shards=2,
                    progress=False)  # fmt: skip
    new = base / "b" / "z"
    new.mkdir(parents=True)
    for i in range(4):
        (new / f"n{i}.bin").write_bytes(bytes([i]) * (i + 1))
    shardprep.build(str(base / "b"), str(out), shards=2, append=True, progress=False)
    data: dict[str, Any] = json.loads((out / "manifest.json").read_bytes())
    return data


def _edited(data: dict[str, Any], edit: Any) -> bytes:
    copy = json.loads(json.dumps(data))
    edit(copy)
    return json.dumps(copy).encode()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["versions"].pop(), "versions is not a list of two or more versions"),
        (lambda m: m["versions"][1].update(version=3), "is version 3 from shard 2, not version 2"),
        (lambda m: m["versions"][1].update(first_shard=1), "not version 2 from shard 2"),
        (lambda m: m["versions"][0].update(num_shards=3), "version 1: num_samples is 14 but"),
        (lambda m: m["versions"][1].update(num_samples=5), "version 2: num_samples is 5 but"),
        (lambda m: m["versions"][0].pop("manifest_sha256"), "version 1: manifest_sha256 is not"),
        (lambda m: m["versions"][1].update(manifest_sha256="0" * 64), "version 2 is the newest"),
        (lambda m: m["versions"][1]["options"].update(seed=9), "newest version's options"),
        (lambda m: m.update(class_weighting={}), "keeps class_weighting in each version"),
        (lambda m: m["versions"][0].pop("options"), r"versions\[0\] lacks one of"),
    ],
)
def test_a_versions_field_that_contradicts_the_manifest_is_refused(
    appended: dict[str, Any], edit: Any, message: str
) -> None:
    assert parse_manifest(_edited(appended, lambda m: None), "M").num_samples == 18
    with pytest.raises(ManifestError, match=message):
        parse_manifest(_edited(appended, edit), "M")


def test_labels_of_the_union_are_written(tmp_path: Path) -> None:
    """NEW alone would be class 0 ('z'); in the build it is class 2."""
    out = tmp_path / "out"
    shardprep.build(str(write_class_folders(tmp_path / "a", {"x": 4, "y": 4})), str(out),
                    shards=1, progress=False)  # fmt: skip
    (tmp_path / "b" / "z").mkdir(parents=True)
    (tmp_path / "b" / "z" / "n.bin").write_bytes(b"1")
    shardprep.build(str(tmp_path / "b"), str(out), shards=1, append=True, progress=False)
    from shardprep.format.shardformat import decode_index

    index = decode_index((out / "shard-00001.idx").read_bytes())
    assert np.asarray(index.label).tolist() == [2]
