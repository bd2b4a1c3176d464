"""loader.read.reader's arrays: keys of a sample range as one array, cached index arrays narrowed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from loader.read.chunk import key_array, key_list

# keys as the builder writes them: non-empty, no NUL (a tar name cannot hold one)
KEYS = st.lists(
    st.one_of(
        st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=127), min_size=1),
        st.text(alphabet=st.characters(min_codepoint=1, blacklist_categories=("Cs",)), min_size=1),
    ),
    max_size=40,
)


def _index(keys: list[str]) -> SimpleNamespace:
    encoded = [k.encode() for k in keys]
    ends = np.cumsum([len(k) for k in encoded], dtype=np.uint64)
    blob = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    return SimpleNamespace(key_end=ends, key_blob=blob)


@given(KEYS, st.data())
def test_key_array_is_the_decoded_keys(keys: list[str], data: st.DataObject) -> None:
    index = _index(keys)
    a = data.draw(st.integers(0, len(keys)))
    b = data.draw(st.integers(a, len(keys)))
    assert key_list(index, a, b) == keys[a:b]  # type: ignore[arg-type]
    got = key_array(index, a, b)  # type: ignore[arg-type]
    assert got.dtype.kind == "U"
    assert got.tolist() == keys[a:b]


def test_ascii_keys_take_the_vectorised_path_with_the_widest_key_as_width() -> None:
    keys = ["a", "bcd", "ef", "0000123"]
    got = key_array(_index(keys), 1, 4)  # type: ignore[arg-type]
    assert got.dtype == np.dtype("<U7")
    assert got.tolist() == ["bcd", "ef", "0000123"]


def test_cached_index_arrays_narrow_to_32_bits_only_where_every_value_fits() -> None:
    from loader.read.reader import _narrow

    small = np.array([0, 5, (1 << 32) - 1], dtype=np.uint64)
    assert _narrow(small).dtype == np.uint32
    assert _narrow(small).tolist() == small.tolist()
    large = np.array([0, 1 << 32], dtype=np.uint64)
    assert _narrow(large).dtype == np.uint64
    assert _narrow(large).tolist() == [0, 1 << 32]
    assert _narrow(np.array([], dtype=np.uint64)).dtype == np.uint32
