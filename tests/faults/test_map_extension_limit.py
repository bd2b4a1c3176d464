"""Issue 34 leftover A: a --map whose samples return different member names cannot pass the
65,536 distinct names a shard's index can number (uint16): the sample that would cross the
limit is refused naming the shard, its key and the limit, and nothing is published (it was
an OverflowError from the index writer)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import shardprep
from shardprep.example import write_example
from shardprep.format.shardformat import MAX_EXTENSIONS, decode_index
from shardprep.transform import MapError

MAP = "tests.faults.test_map_extension_limit:names_per_sample"
PER_SAMPLE = 1000  # names each sample adds; the 66th sample of the shard crosses 65,536


def names_per_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """Keeps key and class; PER_SAMPLE members whose names no other sample uses."""
    kept = {k: v for k, v in sample.items() if k in ("__key__", "cls")}
    return {**kept, **{f"{sample['__key__']}-{j}": b"" for j in range(PER_SAMPLE)}}


def test_a_map_passing_the_shards_member_name_limit_is_refused_naming_the_sample(
    tmp_path: Path,
) -> None:
    raw = tmp_path / "raw"
    write_example(str(raw), 70, 2, 0)
    plain = tmp_path / "plain"  # the same plan without the map: the shard's sample order
    shardprep.build(str(raw), str(plain), shards=1, workers=1, progress=False)
    order = decode_index((plain / "shard-00000.idx").read_bytes())
    crossing = MAX_EXTENSIONS // PER_SAMPLE  # samples 0..64 fit (65,000 names), 65 does not
    name = MAX_EXTENSIONS - crossing * PER_SAMPLE - 1  # its 536th new name (.cls is one too)
    key = order.key(crossing)
    out = tmp_path / "out"
    with pytest.raises(MapError) as caught:
        shardprep.build(str(raw), str(out), shards=1, workers=1, map=MAP, progress=False)
    first = str(caught.value).splitlines()[0]
    assert re.fullmatch(
        re.escape(f"shard 0: map {MAP} on sample {key!r} (from ")
        + r"'[^']+'"
        + re.escape(
            f"): its member '{key}-{name}' would be the "
            "shard's 65,537th distinct member name; a shard holds at most 65,536 (its index "
            "numbers them in 16 bits): return the same member names for every sample and put "
            "per-sample data inside a member (an .npz, a .json, a .tar) instead of in its name. "
            "No shard was finished: fix the function, keeping its name "
        )
        + ".*",
        first,
    ), first
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == []
    assert not [p.name for p in out.iterdir() if p.name.endswith(".partial")]
