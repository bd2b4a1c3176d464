"""Issue 34 leftover B: a Python-iterable sample holding a field the loader sets itself is
refused naming the sample's key and the field (it was silently dropped); other ``__*`` keys
(what WebDataset's reader adds) are still ignored, as docs/pipelines.md says."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shardprep
from shardprep.format.errors import InputError


def _samples(extra: dict[str, Any], at: int = 3) -> Iterator[dict[str, Any]]:
    for i in range(6):
        sample: dict[str, Any] = {"__key__": f"k{i}", "cls": i % 2, "jpg": b"x" * (i + 1)}
        if i == at:
            sample.update(extra)
        yield sample


@pytest.mark.parametrize("field", ["__padded__", "__weight__", "__position__", "__source__"])
def test_a_loader_field_in_a_sample_is_refused_naming_key_and_field(
    field: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    with pytest.raises(InputError) as caught:
        shardprep.build(_samples({field: 0.5}), str(out), shards=2, progress=False)
    assert str(caught.value) == (
        f"sample 'k3': the field {field!r} is one the loader sets itself (it would never be "
        "handed back: the loader's own value takes its place); keep the value in a member of "
        "your own (e.g. in the sample's 'json') or drop the field"
    )
    assert not out.exists()


def test_webdatasets_own_dunder_keys_are_still_ignored(tmp_path: Path) -> None:
    extra = {"__url__": "s3://b/x.tar", "__local_path__": "/tmp/x.tar"}
    plain = shardprep.build(_samples({}), str(tmp_path / "plain"), shards=2, progress=False)
    read = shardprep.build(_samples(extra), str(tmp_path / "read"), shards=2, progress=False)
    assert plain.num_samples == read.num_samples == 6
    for name in sorted(p.name for p in (tmp_path / "plain").iterdir()):
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "read" / name).read_bytes()
