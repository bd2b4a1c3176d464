"""Input names that used to lose samples or mix datasets without a word, and the messages
that named the wrong thing (the input-path hunt): every case is kept, or refused naming it.

- a tar sample whose name starts with ``__`` is a sample (only WebDataset's own metadata
  members are skipped); a sample's members must be adjacent; a ``.cls`` member that is not
  UTF-8 is named as a label;
- two dataset splits in a detected layout are refused; ``--format`` reads them on purpose;
- OS junk files (``Thumbs.db``, ``desktop.ini``) are skipped as hidden names are;
- ``.pq`` and ``.parq`` files are Parquet;
- a decimal text label next to a non-decimal one is refused, never renumbered;
- Parquet files whose partition folders differ are named with the difference;
- duplicate keys from a Python iterable are refused before the shard count is checked.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardprep
from loader import ShardDataset
from shardprep.format.errors import InputError
from tests.faults.helpers import error_lines, invoke, write


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _build(raw: Path | str, out: Path, **options: Any) -> Any:
    return shardprep.build(str(raw), str(out), workers=1, progress=False, **options)


def _refused(raw: Path, out: Path, **options: Any) -> str:
    with pytest.raises(InputError) as info:
        _build(raw, out, shards=1, **options)
    assert not out.exists() or not any(p.suffix == ".tar" for p in out.iterdir())
    return str(info.value)


def _samples(out: Path) -> dict[str, dict[str, bytes]]:
    """Every sample of the build at ``out``, by key: its members' bytes (loader fields aside)."""
    found = {}
    for sample in ShardDataset(str(out), shuffle=False, rank=0, world_size=1):
        members = {k: v for k, v in sample.items() if not k.startswith("__")}
        found[sample["__key__"]] = members
    return found


def _classes(out: Path) -> list[tuple[int, str, int]]:
    manifest = json.loads((out / "manifest.json").read_text())
    return [(c["index"], c["name"], c["count"]) for c in manifest["classes"]]


def _table(n: int, tag: bytes = b"") -> pa.Table:
    return pa.table({"jpg": pa.array([tag + b"img%d" % i for i in range(n)])})


# --- tar input -------------------------------------------------------------------------------


@pytest.mark.parametrize("folder", ["", "d/"])
def test_a_tar_sample_named_with_two_underscores_is_kept(tmp_path: Path, folder: str) -> None:
    members = [
        ("__meta__", b"webdataset metadata"),  # skipped by WebDataset: skipped here too
        (f"{folder}__0001.jpg", b"one"),
        (f"{folder}__0001.cls", b"0"),
        (f"{folder}0002.jpg", b"two"),
        (f"{folder}0002.cls", b"1"),
    ]
    raw = _tar(tmp_path / "raw" / "a.tar", members)
    summary = _build(raw.parent, tmp_path / "out", shards=2)
    assert summary.num_samples == 2
    key = "d____0001" if folder else "k__0001"  # the key rule of file names: a 'k' prefix
    assert _samples(tmp_path / "out") == {
        key: {"jpg": b"one", "cls": b"0"},
        f"{folder.replace('/', '__')}0002": {"jpg": b"two", "cls": b"1"},
    }


def test_tar_members_of_one_sample_that_are_not_adjacent_are_refused(tmp_path: Path) -> None:
    members = [("0001.jpg", b"a"), ("0002.jpg", b"b"), ("0001.png", b"c"), ("0001.cls", b"1")]
    raw = _tar(tmp_path / "raw" / "a.tar", members)
    message = _refused(raw.parent, tmp_path / "out")
    assert message == (
        "1 input problem(s), nothing was written:\n"
        f"  {raw}:0001.png: the members of sample '0001' are not contiguous in a.tar: "
        "'0001.jpg' comes before other samples' members and '0001.png' after them; WebDataset "
        "groups only adjacent members into one sample (it would read two samples), so write "
        "each sample's members next to each other (e.g. tar in sorted name order)"
    )


def test_a_tar_label_that_is_not_utf8_names_its_member(tmp_path: Path) -> None:
    members = [("0001.jpg", b"a"), ("0001.cls", b"\xff"), ("0002.jpg", b"b"), ("0002.cls", b"1")]
    raw = _tar(tmp_path / "raw" / "a.tar", members)
    message = _refused(raw.parent, tmp_path / "out")
    assert message == (
        "1 input problem(s), nothing was written:\n"
        f"  {raw}:0001.cls: cannot read label: not UTF-8 text ('utf-8' codec can't decode byte "
        "0xff in position 0: invalid start byte); write the class index or name as UTF-8 text"
    )


# --- splits ----------------------------------------------------------------------------------


HUB_IN_ONE_FOLDER = {
    "data/train-00000-of-00001.parquet": 4,
    "data/test-00000-of-00001.parquet": 3,
}
HUB_IN_FOLDERS = {"train/0.parquet": 4, "test/0.parquet": 3}


@pytest.mark.parametrize("files", [HUB_IN_ONE_FOLDER, HUB_IN_FOLDERS], ids=["names", "folders"])
def test_two_splits_of_a_parquet_export_are_refused_and_format_reads_them(
    tmp_path: Path, files: dict[str, int]
) -> None:
    raw = tmp_path / "raw"
    write(raw / "README.md", b"# card")
    for rel, n in files.items():
        (raw / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(_table(n), raw / rel)
    train, test = sorted(files, key=lambda r: "test" in r)
    result = invoke("build", str(raw), str(tmp_path / "out"), "-n", "2", "-q")
    assert result.exit_code == 1
    assert error_lines(result) == [
        f"Error: {raw}: holds 2 dataset splits: test ({raw / test}), train ({raw / train}); a "
        "build makes one dataset, so the splits would be mixed into one: point RAW at one "
        "split (its folder; move a split's files into a folder of their own if the splits "
        "share one), or pass --format parquet to read every split into one dataset"
    ]
    assert not (tmp_path / "out").exists()
    summary = _build(raw, tmp_path / "out", shards=2, input_format="parquet")
    assert summary.num_samples == 7  # said on purpose: every split's rows
    one = _build(
        raw / "train" if files is HUB_IN_FOLDERS else raw / train, tmp_path / "one", shards=2
    )
    assert one.num_samples == 4


@pytest.mark.parametrize("layout", ["class-folders", "keyed"])
def test_split_folders_of_files_are_refused(tmp_path: Path, layout: str) -> None:
    raw = tmp_path / "raw"
    for split in ("train", "val"):
        for i in range(2):
            if layout == "class-folders":
                write(raw / split / "cat" / f"{i}.jpg", f"{split}{i}")
            else:
                write(raw / split / f"{i}.jpg", f"{split}{i}")
                write(raw / split / f"{i}.cls", "cat")
    message = _refused(raw, tmp_path / "out")
    assert message == (
        f"{raw}: holds 2 dataset splits: train (train/), val (val/); a build makes one "
        "dataset, so the splits would be mixed into one: point RAW at one split (its folder; "
        "move a split's files into a folder of their own if the splits share one), or pass "
        f"input_format={layout!r} to read every split into one dataset"
    )
    assert _build(raw, tmp_path / "out", shards=2, input_format=layout).num_samples == 4


# --- OS junk files ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["class-folders", "keyed"])
def test_os_junk_files_are_skipped_as_hidden_names_are(tmp_path: Path, layout: str) -> None:
    raw = tmp_path / "raw"
    for c in ("cat", "dog"):
        for i in range(2):
            write(raw / c / f"{i}.jpg", f"{c}{i}")
            if layout == "keyed":
                write(raw / c / f"{i}.cls", c)
        write(raw / c / "Thumbs.db", b"thumbnails")
        write(raw / c / "desktop.ini", b"[.ShellClassInfo]")
        write(raw / c / ".DS_Store", b"finder")
    write(raw / "THUMBS.DB", b"thumbnails")  # at the top too, in any case
    summary = _build(raw, tmp_path / "out", shards=2)
    assert (summary.layout, summary.num_samples) == (layout, 4)
    assert {m for s in _samples(tmp_path / "out").values() for m in s} == {"jpg", "cls"}


# --- Parquet suffixes ------------------------------------------------------------------------


def test_pq_and_parq_files_are_parquet(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    pq.write_table(_table(2, b"a"), raw / "a.pq")
    pq.write_table(_table(3, b"b"), raw / "b.PARQ")
    summary = _build(raw, tmp_path / "out", shards=2)
    assert (summary.layout, summary.num_samples) == ("parquet", 5)
    assert sorted(_samples(tmp_path / "out")) == [f"a-{i:09d}" for i in range(2)] + [
        f"b-{i:09d}" for i in range(3)
    ]
    single = _build(raw / "a.pq", tmp_path / "single", shards=1)  # a file RAW too
    assert (single.layout, single.num_samples) == ("parquet", 2)


# --- text labels -----------------------------------------------------------------------------


@pytest.mark.parametrize("other", ["-1", "+1", "cat"])
def test_a_decimal_csv_label_beside_another_name_is_refused(tmp_path: Path, other: str) -> None:
    for name in ("a", "b"):
        write(tmp_path / f"{name}.jpg", name)
    listing = write(tmp_path / "list.csv", f"path,label\na.jpg,3\nb.jpg,{other}\n")
    message = _refused(listing, tmp_path / "out")
    assert message.startswith(
        f"{listing}:2: 'label' has a decimal label (a class index) and {listing}:3: 'label' a "
        "string class name "
        "(not a decimal number): numbering the names would renumber the indices"
    ), message


def test_a_decimal_tar_label_beside_a_name_in_another_tar_is_refused(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _tar(raw / "s0.tar", [("a.jpg", b"a"), ("a.cls", b"3")])
    _tar(raw / "s1.tar", [("b.jpg", b"b"), ("b.cls", b"cat")])
    message = _refused(raw, tmp_path / "out")
    assert message.startswith(
        f"{raw / 's0.tar'}:a.cls has a decimal label (a class index) and {raw / 's1.tar'}:b.cls "
        "a string class name"
    ), message


def test_hive_label_folders_with_an_index_and_a_name_are_refused(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for value in ("1", "cat"):
        (raw / f"label={value}").mkdir(parents=True)
        pq.write_table(_table(2), raw / f"label={value}" / "p.parquet")
    message = _refused(raw, tmp_path / "out")
    assert message.startswith(
        f"{raw / 'label=1' / 'p.parquet'}: row 0 (key 'label=1/p-000000000') has a decimal "
        f"label (a class index) and {raw / 'label=cat' / 'p.parquet'}: row 0 "
        "(key 'label=cat/p-000000000') a string class name"
    ), message


def test_decimal_text_labels_alone_keep_their_value(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _tar(raw / "s0.tar", [("a.jpg", b"a"), ("a.cls", b"3"), ("b.jpg", b"b"), ("b.cls", b"1")])
    _build(raw, tmp_path / "out", shards=1)
    assert _classes(tmp_path / "out") == [(0, "0", 0), (1, "1", 1), (2, "2", 0), (3, "3", 1)]


def test_class_folder_names_are_names_sorted_as_text(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for c in ("1", "2", "10"):
        write(raw / c / "x.jpg", c)
    _build(raw, tmp_path / "out", shards=1)
    # a folder name is never a class index: '1', '10', '2' sort as text, as ImageFolder's do
    assert _classes(tmp_path / "out") == [(0, "1", 1), (1, "10", 1), (2, "2", 1)]
    assert {k: s["cls"] for k, s in _samples(tmp_path / "out").items()} == {
        "1__x": b"0",
        "10__x": b"1",
        "2__x": b"2",
    }


# --- Parquet partitions ----------------------------------------------------------------------


def test_parquet_files_whose_partition_folders_differ_name_the_difference(
    tmp_path: Path,
) -> None:
    raw = tmp_path / "raw"
    (raw / "year=2024" / "label=1").mkdir(parents=True)
    (raw / "label=2").mkdir(parents=True)
    pq.write_table(_table(2), raw / "label=2" / "p.parquet")
    pq.write_table(_table(2), raw / "year=2024" / "label=1" / "p.parquet")
    message = _refused(raw, tmp_path / "out")
    assert message == (
        f"{raw / 'year=2024' / 'label=1' / 'p.parquet'}: its columns differ from those of "
        f"{raw / 'label=2' / 'p.parquet'} (partition folders (name=value): 'year', 'label' "
        "here, 'label' in the first file; other columns (into .json): 'year' here, none in the "
        "first file); every Parquet file of one input must have the same columns and the same "
        "partition folders (name=value)"
    )


# --- Python iterables ------------------------------------------------------------------------


@pytest.mark.parametrize("keys", [["k0", "k0"], ["k0", "k1", "k0"]], ids=["adjacent", "apart"])
def test_duplicate_keys_from_an_iterable_are_refused_before_the_shard_count(
    tmp_path: Path, keys: list[str]
) -> None:
    samples = [{"__key__": k, "jpg": b"x%d" % i} for i, k in enumerate(keys)]
    with pytest.raises(InputError) as info:
        shardprep.build(samples, str(tmp_path / "out"), shards=len(keys), progress=False)
    assert str(info.value) == (
        f"sample key 'k0' is given to more than one sample (#0 and #{len(keys) - 1}, counting "
        "from 0): give every sample its own __key__ (nothing was written to OUT)"
    )
    assert not (tmp_path / "out").exists()
