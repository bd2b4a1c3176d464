"""Sample-key rules: key_from_stem, split_name, is_valid_key (shardprep.keys)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardprep.keys import is_valid_key, key_from_stem, split_name


@pytest.mark.parametrize("key", ["a", "0", "0001", "A-9_z", "img_01", "-", "-x", "x_", "a__b"])
def test_valid_keys(key: str) -> None:
    assert is_valid_key(key)


@pytest.mark.parametrize(
    "key",
    ["", "_a", "__key__", "a.b", "a/b", "a b", "a\n", "\na", "café", "a:b", "a\\b", "a\x00"],
)
def test_invalid_keys(key: str) -> None:
    assert not is_valid_key(key)


@pytest.mark.parametrize(
    ("stem", "key"),
    [
        ("0001", "0001"),  # already valid: unchanged
        ("A-9_z", "A-9_z"),
        ("cat/img01", "cat__img01"),
        ("cat/img.01", "cat__img_01"),
        ("a/b/c", "a__b__c"),
        ("a b", "a_b"),
        ("café", "caf_"),
        ("x:y;z", "x_y_z"),
        ("_hidden", "k_hidden"),
        ("/abs", "k__abs"),
        ("", "k"),
        ("...", "k___"),
        ("-dash/x", "-dash__x"),
    ],
)
def test_key_from_stem_examples(stem: str, key: str) -> None:
    assert key_from_stem(stem) == key


def test_key_from_stem_can_collide() -> None:
    """Distinct stems may map to one key; the scan reports that (DuplicateKeyError)."""
    assert key_from_stem("a b") == key_from_stem("a_b") == key_from_stem("a.b") == "a_b"
    assert key_from_stem("cat/x") == key_from_stem("cat__x")


@given(st.text(max_size=40))
def test_key_from_stem_always_gives_a_valid_key(stem: str) -> None:
    key = key_from_stem(stem)
    assert is_valid_key(key)
    assert key_from_stem(stem) == key  # deterministic
    assert key_from_stem(key) == key  # idempotent


@given(st.from_regex(r"[A-Za-z0-9-][A-Za-z0-9_-]{0,30}", fullmatch=True))
def test_valid_keys_are_fixed_points(key: str) -> None:
    assert is_valid_key(key)
    assert key_from_stem(key) == key


@given(st.lists(st.from_regex(r"[A-Za-z0-9]{1,8}", fullmatch=True), min_size=1, max_size=5))
def test_slash_maps_to_double_underscore(parts: list[str]) -> None:
    assert key_from_stem("/".join(parts)) == "__".join(parts)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("0001.jpg", ("0001", "jpg")),
        ("0001.seg.png", ("0001", "seg.png")),
        ("a.tar.gz", ("a", "tar.gz")),
        ("noext", ("noext", "")),
        (".hidden", (".hidden", "")),
        (".hidden.jpg", (".hidden", "jpg")),
        ("a.", ("a", "")),
        ("a..b", ("a", ".b")),
        ("", ("", "")),
    ],
)
def test_split_name_examples(name: str, expected: tuple[str, str]) -> None:
    assert split_name(name) == expected


@given(st.text(alphabet="ab.", max_size=12))
def test_split_name_splits_at_first_dot_after_position_zero(name: str) -> None:
    stem, ext = split_name(name)
    assert "." not in stem[1:]
    dot = name.find(".", 1)
    if dot < 0:
        assert (stem, ext) == (name, "")
    else:
        assert stem + "." + ext == name
        assert len(stem) == dot
