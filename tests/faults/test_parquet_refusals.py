"""Parquet input that cannot become samples is refused by name before anything is written."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

import shardprep
from shardprep.format.errors import DuplicateKeyError, InputError
from shardprep.scan.parquet import ParquetInputError
from tests.processes import run_bounded

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _write(path: Path, keys: list[Any], labels: list[Any] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    columns: dict[str, Any] = {"__key__": pa.array(keys, pa.string())}
    columns["jpg"] = [b"x" * (i + 1) for i in range(len(keys))]
    if labels is not None:
        columns["label"] = pa.array(labels, pa.string())
    pq.write_table(pa.table(columns), path, row_group_size=4)
    return path


def _refused(raw: Path, out: Path, error: type[Exception], **options: Any) -> str:
    with pytest.raises(error) as caught:
        shardprep.build(str(raw), str(out), shards=2, progress=False, **options)
    assert not out.exists()  # nothing written to OUT
    return str(caught.value)


def test_a_file_that_is_not_parquet_is_named(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _write(raw / "a.parquet", [f"k{i}" for i in range(6)])
    (raw / "b.parquet").write_bytes(b"PAR1 this is not parquet at all")
    message = _refused(raw, tmp_path / "out", ParquetInputError)
    assert message.startswith(f"{raw / 'b.parquet'}: not a Parquet file")


@pytest.mark.parametrize(("option", "what"), [("key_column", "key"), ("label_column", "label")])
def test_a_named_column_that_does_not_exist_is_named(
    tmp_path: Path, option: str, what: str
) -> None:
    raw = _write(tmp_path / "raw" / "a.parquet", [f"k{i}" for i in range(6)])
    message = _refused(raw, tmp_path / "out", ParquetInputError, **{option: "nope"})
    assert message.startswith(f"{raw}: no {what} column 'nope' (columns: __key__, jpg)")
    assert message.endswith(f"name an existing column with {option}=")  # was: --key-column


def test_a_null_key_is_named_with_its_file_and_row(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _write(raw / "a.parquet", [f"k{i}" for i in range(6)])
    _write(raw / "b.parquet", [f"m{i}" if i != 5 else None for i in range(9)])
    message = _refused(raw, tmp_path / "out", ParquetInputError)
    assert message.startswith(f"{raw / 'b.parquet'}: row 5: the key column '__key__' is null")
    assert "or leave out key_column= and drop the column" in message  # was: --key-column


def test_a_null_label_is_named_with_its_file_row_and_key(tmp_path: Path) -> None:
    labels = ["cat", "dog", None, "cat"]
    raw = _write(tmp_path / "raw" / "a.parquet", ["a", "b", "c", "d"], labels)
    message = _refused(raw, tmp_path / "out", ParquetInputError)
    assert message.startswith(f"{raw}: row 2 (key 'c'): the label column 'label' is null")
    assert message.endswith("or name another column with label_column=")  # was: --label-column


def test_duplicate_keys_name_both_rows_files(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _write(raw / "a.parquet", ["k0", "k1", "same", "k3"])
    _write(raw / "b.parquet", ["m0", "same"])
    message = _refused(raw, tmp_path / "out", DuplicateKeyError)
    assert message.startswith("duplicate sample key 'same' from 'a.parquet:same', 'b.parquet:same'")


def test_the_cli_refuses_with_exit_1_and_leaves_no_scratch_behind(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _write(raw / "a.parquet", [f"k{i}" for i in range(6)])
    (raw / "b.parquet").write_bytes(b"not parquet")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = tmp_path / "out"
    result = run_bounded(
        [
            sys.executable,
            "-m",
            "shardprep",
            "build",
            str(raw),
            str(out),
            "-n",
            "2",
            "--format",
            "parquet",
            "-q",
        ],
        timeout=120,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    assert result.returncode == 1, result.stderr
    assert f"{raw / 'b.parquet'}: not a Parquet file" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists() and list(scratch.iterdir()) == []  # spilled payloads removed too


def test_a_url_with_no_parquet_files_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"^memory://nothing-here: "):
        shardprep.build("memory://nothing-here", str(tmp_path / "out"), shards=2, progress=False)
    assert not (tmp_path / "out").exists()
