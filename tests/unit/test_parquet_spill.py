"""scan.parquet's payload spill: a column's bytes land where the parts say, for sliced arrays too."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardprep.scan.parquet import _Spill, _spill_binary

pa = pytest.importorskip("pyarrow")


@pytest.mark.parametrize("kind", ["binary", "large_binary"])
def test_sliced_columns_with_nulls_are_spilled_exactly(tmp_path: Path, kind: str) -> None:
    values = [b"a" * 3, None, b"bc", b"", b"defg", None, b"hij"]
    column = pa.array(values, getattr(pa, kind)()).slice(
        2, 4
    )  # offset 2: b"bc", b"", b"defg", None
    spill = _Spill(str(tmp_path / "spill" / "x.parquet"))
    spill.write(memoryview(b"HEAD"))  # a column after others: offsets are relative to its start
    parts = _spill_binary(column, ["e0", "e1", "e2", "e3"], spill)
    spill.close()
    data = (tmp_path / "spill" / "x.parquet").read_bytes()
    assert parts[3] is None
    got = [data[p[2] : p[2] + p[1]] for p in parts if p is not None]
    assert got == [b"bc", b"", b"defg"]
    assert [p[0] for p in parts if p is not None] == ["e0", "e1", "e2"]
    assert data == b"HEADbcdefg"  # only the slice's bytes are copied
