"""Items 3 and 6 of issue 9: manifest and index are checked against each other before use.

Each case edits a built output and expects a ``ManifestError`` naming the shard
(and the key where one is involved) from the loader, and the same finding from
``shardprep verify``: never fewer samples, a raw IndexError, or a file outside OUT.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loader import CorruptShardError, ShardDataset
from shardprep.format.errors import ManifestError
from shardprep.verify import verify_output
from tests.faults.shard_surgery import copy_output, edit_manifest_json, index_of, rewrite_index


def _refused(out: Path, *fragments: str) -> None:
    """Both the loader's constructor and verify refuse, with every fragment in the message."""
    with pytest.raises(ManifestError) as info:
        ShardDataset(str(out))
    for fragment in fragments:
        assert fragment in str(info.value)
    with pytest.raises(ManifestError) as info:
        verify_output(str(out))
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("delta", [-5, +5])
def test_changed_num_samples_is_refused_naming_the_shard(
    built: Path, tmp_path: Path, delta: int
) -> None:
    out = copy_output(built, tmp_path / "out")
    edit_manifest_json(out, lambda m: m["shards"][2].__setitem__("num_samples", 13 + delta))
    _refused(out, "shard 2 ('shard-00002.tar')", f"num_samples is {13 + delta}")


@pytest.mark.parametrize("delta", [-5, +5])
def test_consistently_changed_count_is_caught_by_the_index(
    built: Path, tmp_path: Path, delta: int
) -> None:
    """num_samples, class counts and totals all edited to agree: the index still disagrees."""
    out = copy_output(built, tmp_path / "out")

    def edit(m: dict[str, Any]) -> None:
        shard = m["shards"][2]
        shard["num_samples"] += delta
        shard["class_counts"][0] += delta
        m["classes"][0]["count"] += delta
        m["totals"]["num_samples"] += delta
        sizes = [s["num_samples"] for s in m["shards"]]
        m["totals"]["min_shard_samples"], m["totals"]["max_shard_samples"] = min(sizes), max(sizes)

    edit_manifest_json(out, edit)
    dataset = ShardDataset(str(out), shuffle=False)  # the manifest alone is consistent
    message = f"the index has 13 samples, the manifest says {13 + delta}"
    with pytest.raises(ManifestError, match=message) as info:
        list(dataset)
    assert "shard-00002.idx" in str(info.value)
    problems = verify_output(str(out)).problems
    assert len(problems) == 1 and problems[0].startswith("shard-00002.tar: shard-00002.idx: ")
    assert message in problems[0]


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda m: m["totals"].__setitem__("num_samples", 104), "totals.num_samples is 104"),
        (lambda m: m["totals"].__setitem__("num_bytes", 1), "totals.num_bytes is 1"),
        (lambda m: m["classes"][1].__setitem__("count", 31), "class 1 ('b') has count 31"),
        (
            lambda m: m["shards"][5]["class_counts"].__setitem__(0, 9),
            "shard 5 ('shard-00005.tar'): num_samples is",
        ),
    ],
)
def test_totals_and_class_counts_must_be_the_sums(
    built: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], None], fragment: str
) -> None:
    out = copy_output(built, tmp_path / "out")
    edit_manifest_json(out, edit)
    _refused(out, fragment)


@pytest.mark.parametrize(
    ("field", "name"),
    [
        ("file", "../elsewhere/x.tar"),
        ("file", "/etc/passwd"),
        ("file", "shard-00001.tar"),  # another shard's file
        ("file", "sub/shard-00000.tar"),
        ("index_file", "../elsewhere/x.idx"),
        ("index_file", "/etc/passwd"),
    ],
)
def test_names_outside_the_folder_are_refused(
    built: Path, tmp_path: Path, field: str, name: str
) -> None:
    out = copy_output(built, tmp_path / "out")
    # a valid shard really is there, outside OUT: it must not be read
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(out / "shard-00000.tar", tmp_path / "elsewhere" / "x.tar")
    shutil.copy(out / "shard-00000.idx", tmp_path / "elsewhere" / "x.idx")
    edit_manifest_json(out, lambda m: m["shards"][0].__setitem__(field, name))
    _refused(out, "shard 0", repr(name), "may only name its own shard files")


def _lie(field: str, member: int, change: Callable[[int], int]) -> Callable[[dict[str, Any]], None]:
    def edit(arrays: dict[str, Any]) -> None:
        arrays[field] = arrays[field].copy()
        arrays[field][member] = change(int(arrays[field][member]))

    return edit


@pytest.mark.parametrize(
    ("field", "change", "fragment"),
    [
        ("member_size", lambda v: 0, "is not where the tar layout puts it"),
        ("member_size", lambda v: v + 512, "is not where the tar layout puts it"),
        ("member_offset", lambda v: v - 512, "is not where the tar layout puts it"),
        ("member_offset", lambda v: v + 512, "is not where the tar layout puts it"),
        ("member_size", lambda v: 100 << 30, "lies past the end of the tar data"),
        ("member_offset", lambda v: 100 << 30, "lies past the end of the tar data"),
    ],
)
def test_a_lying_index_is_an_error_naming_shard_and_key(
    built: Path, tmp_path: Path, field: str, change: Callable[[int], int], fragment: str
) -> None:
    out = copy_output(built, tmp_path / "out")
    index = index_of(out, 1)
    victim = 4
    member = int(index.member_start[victim])
    rewrite_index(out, 1, _lie(field, member, change))  # the manifest's sha256 agrees
    dataset = ShardDataset(str(out), shuffle=False)
    with pytest.raises(ManifestError) as info:
        list(dataset)
    assert "shard-00001.idx" in str(info.value)
    assert f"sample {index.key(victim)!r}" in str(info.value)
    assert fragment in str(info.value)
    problems = verify_output(str(out)).problems
    assert len(problems) == 1
    assert problems[0].startswith("shard-00001.tar: shard-00001.idx: ")
    assert f"sample {index.key(victim)!r}" in problems[0] and fragment in problems[0]


def test_a_size_lie_inside_the_padding_fails_the_checksum(built: Path, tmp_path: Path) -> None:
    """size - 1 keeps the block layout: the member's tar header (which records the true size)
    is then not the one the index describes, and its checksum fails too."""
    out = copy_output(built, tmp_path / "out")
    index = index_of(out, 1)
    member = int(index.member_start[4])
    assert int(index.member_size[member]) % 512 != 1  # same number of blocks after the lie
    rewrite_index(out, 1, _lie("member_size", member, lambda v: v - 1))
    with pytest.raises(CorruptShardError, match="the tar header of its .bin member") as info:
        list(ShardDataset(str(out), shuffle=False))
    assert info.value.key == index.key(4)
    assert "1 damaged sample(s)" in "\n".join(verify_output(str(out)).problems)


def test_an_index_spanning_100_gib_is_refused_without_allocating(
    built: Path, tmp_path: Path
) -> None:
    out = copy_output(built, tmp_path / "out")

    def stretch(arrays: dict[str, Any]) -> None:
        arrays["sample_offset"] = arrays["sample_offset"].copy()
        arrays["sample_offset"][-1] = np.uint64(100 << 30)

    rewrite_index(out, 7, stretch)
    with pytest.raises(ManifestError, match="lies past the end of the tar data") as info:
        list(ShardDataset(str(out), shuffle=False))
    assert "shard-00007.idx" in str(info.value)
    assert "lies past the end" in "\n".join(verify_output(str(out)).problems)


def test_old_format_outputs_are_refused_with_rebuild_advice(built: Path, tmp_path: Path) -> None:
    out = copy_output(built, tmp_path / "out")
    edit_manifest_json(out, lambda m: m.__setitem__("version", 1))
    _refused(out, "manifest version 1 is not supported", "rebuild it")


@pytest.mark.parametrize(
    ("byte", "fragment"),
    [(0x00, "its key holds a NUL byte"), (0xFF, "its key is not UTF-8")],
)
def test_a_key_that_is_not_text_is_refused_naming_the_sample(
    built: Path, tmp_path: Path, byte: int, fragment: str
) -> None:
    """Both reading paths would hand such a key out differently (or fail without a name)."""
    out = copy_output(built, tmp_path / "out")
    index = index_of(out, 2)
    victim = 3
    at = int(index.key_end[victim]) - 1  # the key's last byte: its length, so the layout, stays

    def edit(arrays: dict[str, Any]) -> None:
        arrays["key_blob"] = arrays["key_blob"].copy()
        arrays["key_blob"][at] = byte

    rewrite_index(out, 2, edit)
    named = (index.key(victim)[:-1].encode() + bytes([byte])).decode("utf-8", "replace")
    for batch_size in (None, 4):
        with pytest.raises(ManifestError) as info:
            list(ShardDataset(str(out), shuffle=False, batch_size=batch_size))
        assert "shard-00002.idx" in str(info.value)
        assert f"sample {named!r}: {fragment}" in str(info.value)
    assert fragment in "\n".join(verify_output(str(out)).problems)


def test_a_key_starting_inside_a_character_is_refused(built: Path, tmp_path: Path) -> None:
    """Moving a key boundary into a two-byte character: the blob stays UTF-8, the keys do not."""
    out = copy_output(built, tmp_path / "out")
    index = index_of(out, 0)
    a, b = int(index.key_end[0]), int(index.key_end[1])  # key 1 is blob[a:b]

    def edit(arrays: dict[str, Any]) -> None:
        blob = arrays["key_blob"].copy()
        blob[a - 1 : a + 1] = list("é".encode())  # key 0 ends with 0xC3, key 1 starts with 0xA9
        arrays["key_blob"] = blob

    assert b - a >= 2
    rewrite_index(out, 0, edit)
    with pytest.raises(ManifestError, match="its key is not UTF-8"):
        list(ShardDataset(str(out), shuffle=False))
