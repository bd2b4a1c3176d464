"""Issue 23, item 7: builder-side findings, each refused or repaired with a message that names
the file, shard or key and says what to do.

- size fields of a manifest entry that no shard can have (a loader would allocate by them);
- class folders and file names that are not UTF-8 (refused at scan, before OUT is touched);
- ``--resume`` over a finished shard damaged after the kill (rewritten, with a notice);
- staging and scratch folders of killed builds (swept by the next build, only ours).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loader import ShardDataset
from shardprep.errors import ManifestError
from shardprep.verify import verify_output
from tests.faults.helpers import error_lines, invoke
from tests.faults.shard_surgery import copy_output, edit_manifest_json

# --- item 3: sizes in the manifest ------------------------------------------------------


def _set_shard(shard: int, field: str, value: int) -> Any:
    """Set one size of one shard, and the totals to agree (only the bounds can refuse it)."""

    def edit(m: dict[str, Any]) -> None:
        m["shards"][shard][field] = value
        if field == "tar_bytes" and m["options"]["compression"] == "none":
            m["shards"][shard]["num_bytes"] = value
        nbytes = [s["num_bytes"] for s in m["shards"]]
        m["totals"]["num_bytes"] = sum(nbytes)
        m["totals"]["tar_bytes"] = sum(s["tar_bytes"] for s in m["shards"])
        m["totals"]["shard_bytes_ratio"] = round(max(nbytes) / max(1, min(nbytes)), 6)

    return edit


@pytest.mark.parametrize(
    ("fixture", "field", "fragment"),
    [
        ("built", "index_bytes", "index_bytes 1125899906842624 is outside 16.."),
        ("built", "index_bytes", "index_bytes 3 is outside 16.."),
        ("built_zstd", "num_bytes", "num_bytes 1125899906842624 is above the maximum"),
        ("built", "tar_bytes", "tar_bytes 1125899906842624 is above the maximum"),
    ],
)
def test_impossible_sizes_are_refused_naming_shard_and_field(
    request: pytest.FixtureRequest, tmp_path: Path, fixture: str, field: str, fragment: str
) -> None:
    built: Path = request.getfixturevalue(fixture)
    out = copy_output(built, tmp_path / "out")
    value = 3 if "index_bytes 3 " in fragment else 1 << 50
    edit_manifest_json(out, _set_shard(3, field, value))
    name = "shard-00003.tar.zst" if fixture == "built_zstd" else "shard-00003.tar"
    where = f"shard 3 ('{name}'): "
    with pytest.raises(ManifestError) as info:
        ShardDataset(str(out))
    assert where + fragment in str(info.value)
    with pytest.raises(ManifestError) as info:
        verify_output(str(out))
    assert where + fragment in str(info.value)
    result = invoke("verify", str(out), "--quiet")
    assert result.exit_code != 0
    lines = error_lines(result)
    assert len(lines) == 1 and where + fragment in lines[0], result.output
