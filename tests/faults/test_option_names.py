"""Issue 34 item 9: a message names an option as its caller gives it: ``shardprep.build``'s
keyword (``input_format='keyed'``, ``path_column=``, ``class_weights=``, ``storage_options=``,
``workers=``) for a Python-API build, the flag (``--format keyed``, ``--path-column``...) for
``shardprep build``, through the build's one :class:`~shardprep.format.interface.Interface`.

Each test here was run with its fix reverted (the flag hard-coded again) and failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import shardprep
from shardprep.engine.ray_engine import _workers_died
from shardprep.format.errors import InputError, PlanError
from shardprep.format.interface import CLI, PYTHON
from shardprep.storage import describe_error
from tests.faults.helpers import error_lines, invoke, write


def _refused(raw: Path, out: Path, error: type[Exception] = InputError, **options: Any) -> str:
    options = {"shards": 1, "progress": False, "workers": 1, **options}
    with pytest.raises(error) as caught:
        shardprep.build(str(raw), str(out), **options)
    return str(caught.value)


def _cli_error(*args: str) -> str:
    result = invoke("build", *args, "-q", "-j", "1")
    assert result.exit_code in (1, 2), result.output  # 2: a PlanError, as click's usage errors
    return result.stderr


def test_an_ambiguous_top_level_names_input_format(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    write(raw / "cat" / "0.png", b"c")
    write(raw / "README.txt", b"about")
    message = _refused(raw, tmp_path / "out")
    assert message.endswith(
        "but no .cls labels; pass input_format='keyed' to read every file as keyed samples, or "
        "move the files out to read the folders as classes (input_format='class-folders')"
    ), message
    assert "--format" not in message


def test_class_folders_whose_files_merge_name_input_format(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for name in ("cat/a.jpg", "cat/a.png", "dog/b.png"):
        write(raw / name, b"x")
    message = _refused(raw, tmp_path / "out")
    assert message.endswith(
        "this is keyed data: pass input_format='keyed'; if they are separate samples, rename "
        "one of them"
    ), message


def test_keyed_parts_of_one_type_name_input_format(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for name in ("a.v1.png", "a.v2.png", "b.png"):
        write(raw / name, b"x")
    message = _refused(raw, tmp_path / "out")
    assert "if they are parts of one sample pass input_format='keyed'" in message, message
    assert "--format" not in message


def test_a_parquet_file_in_class_folders_names_input_format(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    write(raw / "cat" / "0.png", b"c")
    write(raw / "dog" / "rows.parquet", b"PAR1")
    message = _refused(raw, tmp_path / "out")
    assert (
        "pass input_format='parquet' to read rows as samples, or "
        "input_format='class-folders' to take each file as one sample"
    ) in message, message


def test_parquet_beside_other_files_names_input_format(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    write(raw / "train.parquet", b"PAR1")
    write(raw / "cover.jpg", b"jpeg")
    message = _refused(raw, tmp_path / "out")
    assert message.endswith(
        "pass input_format='parquet' to read the .parquet files alone (one sample per row; the "
        "others are skipped), or input_format='keyed' to read every file as a sample"
    ), message


def test_a_listing_without_its_path_column_names_path_column(tmp_path: Path) -> None:
    listing = tmp_path / "list.csv"
    listing.write_text("file,label\na.bin,0\n")
    message = _refused(listing, tmp_path / "out")
    assert message.endswith("name the path column with path_column="), message
    stderr = _cli_error(str(listing), str(tmp_path / "out"), "-n", "1")
    assert "name the path column with --path-column" in stderr, stderr


def test_class_weights_refusals_name_the_keywords(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for c in ("a", "b", "c"):
        write(raw / c / "0.bin", c)
        write(raw / c / "1.bin", c + c)
    out = tmp_path / "out"
    message = _refused(raw, out, PlanError, class_weights="heavy")
    assert message.startswith("class_weights='heavy': expected 'balanced', 'sqrt'"), message
    message = _refused(raw, out, PlanError, class_weights="a=1,dog=1")
    assert message.startswith("class_weights= names unknown class(es) 'dog'"), message
    message = _refused(raw, out, PlanError, class_weights="a=2,b=1")
    assert message.endswith(
        "name every class, or pass allow_zero_weights= to give the others weight 0"
    ), message
    stderr = _cli_error(str(raw), str(out), "-n", "1", "--class-weights", "heavy")
    assert "Error: --class-weights heavy: expected 'balanced', 'sqrt'" in stderr, stderr
    stderr = _cli_error(str(raw), str(out), "-n", "1", "--class-weights", "a=2,b=1")
    assert "or pass --allow-zero-weights to give the others weight 0" in stderr, stderr


def test_an_iterable_sample_clashing_with_the_weight_member_names_weights_only(
    tmp_path: Path,
) -> None:
    samples = [{"__key__": f"k{i}", "cls": i % 2, "bin": b"x", "weight": b"1"} for i in range(4)]
    with pytest.raises(InputError) as caught:
        shardprep.build(
            samples,
            str(tmp_path / "out"),
            shards=1,
            class_weights="balanced",
            weights_only=True,
            progress=False,
        )
    assert "adds itself (weights_only=True writes .weight); rename it" in str(caught.value)


class WorkerCrashedError(Exception):
    """Named like Ray's: _workers_died reads the class name."""


def test_a_ray_task_whose_workers_died_names_the_workers_option() -> None:
    """The engine's words only: a shard's message says what happened (the builder adds what
    is kept and how to resume); a scan task's says what to do too."""
    crashed = WorkerCrashedError()
    shard = str(_workers_died(crashed, -1, 2, PYTHON))
    assert shard.startswith("shard 2: the Ray worker process running it died on each of its")
    assert "(free memory or give Ray fewer CPUs with workers=)" in shard
    assert "kept" not in shard and "--" not in shard
    scan = str(_workers_died(crashed, 3, -1, PYTHON))
    assert scan.endswith(
        "; nothing was written: fix the cause, then call shardprep.build again with the same "
        "arguments"
    ), scan
    scan = str(_workers_died(crashed, 3, -1, CLI))
    assert "fewer CPUs with --workers" in scan
    assert scan.endswith("; nothing was written: fix the cause, then run the same command again")


@pytest.mark.parametrize(
    ("err", "python", "cli"),
    [
        (
            ConnectionError("refused"),
            "check the endpoint (storage_options={'client_kwargs': {'endpoint_url': '...'}} or "
            "AWS_ENDPOINT_URL) and the network",
            'check the endpoint (--storage-option \'client_kwargs={"endpoint_url": "..."}\' '
            "or AWS_ENDPOINT_URL) and the network",
        ),
        (
            TypeError("AioSession.__init__() got an unexpected keyword argument 'aws_key'"),
            "the storage client refused an option (AioSession.__init__() got an unexpected "
            "keyword argument 'aws_key'); pass the options its fsspec filesystem takes (for S3: "
            "AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or storage_options="
            "{'profile': ...}, {'key': ..., 'secret': ...} or {'anon': True} for a public bucket)",
            "--storage-option profile=..., key=..., secret=..., anon=true for a public bucket)",
        ),
        (
            PermissionError("denied"),
            "or storage_options={'profile': ...}, {'key': ..., 'secret': ...} or "
            "{'anon': True} for a public bucket) and the bucket's permissions",
            "or --storage-option profile=..., key=..., secret=..., anon=true for a public "
            "bucket) and the bucket's permissions",
        ),
    ],
)
def test_storage_hints_name_the_storage_options(err: Exception, python: str, cli: str) -> None:
    assert describe_error("s3://b/x", err, PYTHON).endswith(python)
    assert describe_error("s3://b/x", err, CLI).endswith(cli)
    assert "--" not in describe_error("s3://b/x", err, PYTHON)


def test_a_keyed_input_refuses_a_parquet_part_by_name(tmp_path: Path) -> None:
    """Was: sub/x.parquet with sub/x.cls became one sample whose part was the Parquet file."""
    raw = tmp_path / "raw"
    write(raw / "first" / "a.png", b"a")  # the first folder with files: keyed, no Parquet
    write(raw / "first" / "a.cls", b"0")
    write(raw / "sub" / "x.parquet", b"PAR1")
    write(raw / "sub" / "x.cls", b"1")
    out = tmp_path / "out"
    message = _refused(raw, out)
    assert message.splitlines()[1:] == [
        f"  {raw / 'sub' / 'x.parquet'}: a Parquet file in keyed input (the input was detected "
        "as keyed files: its first folder with files holds no Parquet); a Parquet file is never "
        "read as a sample's part on a guess: pass input_format='parquet' to read rows as "
        "samples, or input_format='keyed' to take each file as a part"
    ], message
    assert not out.exists()
    result = invoke("build", str(raw), str(out), "-n", "1", "-q")
    assert result.exit_code == 1, result.output
    assert error_lines(result) == ["Error: 1 input problem(s), nothing was written:"]
    stderr = result.stderr
    assert (
        "pass --format parquet to read rows as samples, or --format keyed to take each file as "
        "a part"
    ) in stderr, stderr
    # said explicitly, the file is a part of its sample (docs/cli.md)
    result = invoke("build", str(raw), str(out), "-n", "1", "--format", "keyed", "-q", "--json")
    assert result.exit_code == 0, result.output
    summary = shardprep.build(
        str(raw), str(tmp_path / "out2"), shards=1, input_format="keyed", progress=False
    )
    assert summary.num_samples == 2
