"""Issue 9 item 1: auto-detection never silently changes what the data means."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.faults.helpers import error_lines, invoke, write


def _class_folders(
    root: Path, classes: tuple[str, ...] = ("cat", "dog", "eel"), n: int = 4
) -> Path:
    for c in classes:
        for i in range(n):
            write(root / c / f"{i:03d}.png", f"{c}{i}" * (i + 1))
    return root


def _summary(*args: str) -> dict[str, object]:
    result = invoke("build", *args, "--json", "-j", "1")
    assert result.exit_code == 0, result.output
    summary: dict[str, object] = json.loads(result.stdout)
    return summary


@pytest.mark.parametrize("first", [True, False], ids=["first-folder", "last-folder"])
def test_dotted_names_stay_class_folders_in_any_folder(tmp_path: Path, first: bool) -> None:
    raw = _class_folders(tmp_path / "raw")
    folder = "cat" if first else "eel"
    write(raw / folder / "img.v2.001.png", b"one")
    write(raw / folder / "img.v2.002.png", b"two")
    summary = _summary(str(raw), str(tmp_path / "out"), "-n", "2")
    assert summary["layout"] == "class-folders"
    assert summary["layout_detected"] is True
    assert summary["num_classes"] == 3
    assert summary["num_samples"] == 3 * 4 + 2  # every file is a sample: nothing merged


@pytest.mark.parametrize("folder", ["cat", "eel"])
def test_same_name_different_extension_is_refused_in_any_folder(
    tmp_path: Path, folder: str
) -> None:
    raw = _class_folders(tmp_path / "raw")
    write(raw / folder / "a.jpg", b"jpeg")
    write(raw / folder / "a.png", b"png")
    out = tmp_path / "out"
    result = invoke("build", str(raw), str(out), "-n", "2", "-q")
    assert result.exit_code == 1
    assert error_lines(result) == [
        f"Error: '{folder}/a.jpg' and '{folder}/a.png' become one sample key '{folder}__a': "
        f"{raw} was read as class folders (its top level holds only folders and no .cls "
        "labels), one file per sample. If files sharing a name are parts of one sample, this "
        "is keyed data: pass --format keyed; if they are separate samples, rename one of them"
    ]
    assert not out.exists()
    # said explicitly, it is keyed data: the pair is one unlabelled sample
    summary = _summary(str(raw), str(out), "-n", "2", "--format", "keyed")
    assert (summary["layout"], summary["layout_detected"], summary["num_classes"]) == (
        "keyed",
        False,
        0,
    )
    assert summary["num_samples"] == 3 * 4 + 1


@pytest.mark.parametrize("folder", ["cat", "eel"])
def test_a_stray_cls_file_is_refused_in_any_folder(tmp_path: Path, folder: str) -> None:
    raw = _class_folders(tmp_path / "raw")
    write(raw / folder / "000.cls", "1")
    result = invoke("build", str(raw), str(tmp_path / "out"), "-n", "2", "-q")
    assert result.exit_code == 1
    message = "\n".join(error_lines(result))
    if folder == "cat":  # the first folder has a .cls: read as keyed, the others lack labels
        assert "no .cls label, while other samples have one (11 such samples)" in result.stderr
    else:  # read as class folders: the .cls file is refused
        assert message.startswith("Error: 1 input problem(s), nothing was written:")
        assert f"{raw / 'eel' / '000.cls'}: a .cls label file in class-folder input" in (
            result.stderr
        )


def test_labelled_keyed_folders_are_keyed(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for part in ("p0", "p1"):
        for i, label in enumerate(["cat", "dog", "cat"]):
            write(raw / part / f"{i}.jpg", f"{part}{i}")
            write(raw / part / f"{i}.json", "{}")
            write(raw / part / f"{i}.cls", label)
    summary = _summary(str(raw), str(tmp_path / "out"), "-n", "2")
    assert (summary["layout"], summary["num_classes"], summary["num_samples"]) == ("keyed", 2, 6)


def test_keyed_parts_of_the_same_type_are_refused_unless_keyed_is_given(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    write(raw / "a.v1.png", b"v1")
    write(raw / "a.v2.png", b"v2")
    write(raw / "b.png", b"b")
    out = tmp_path / "out"
    result = invoke("build", str(raw), str(out), "-n", "1", "-q")
    assert result.exit_code == 1
    assert (
        f"  {raw / 'a'}: 'a.v1.png', 'a.v2.png' would be one sample (WebDataset groups files "
        "by the name up to the first dot) with two parts of the same type; if they are "
        "separate samples rename them so they differ before the first dot, if they are parts "
        "of one sample pass --format keyed"
    ) in result.stderr.splitlines()
    summary = _summary(str(raw), str(out), "-n", "1", "--format", "keyed")
    assert (summary["layout"], summary["num_samples"]) == ("keyed", 2)


def test_files_beside_folders_without_labels_are_ambiguous(tmp_path: Path) -> None:
    raw = _class_folders(tmp_path / "raw")
    write(raw / "README.txt", "about")
    result = invoke("build", str(raw), str(tmp_path / "out"), "-n", "2", "-q")
    assert result.exit_code == 1
    assert error_lines(result) == [
        f"Error: {raw}: ambiguous layout: the top level holds files (e.g. 'README.txt') and "
        "folders (e.g. 'cat') but no .cls labels; pass --format keyed to read every file as "
        "keyed samples, or move the files out to read the folders as classes "
        "(--format class-folders)"
    ]


def test_summary_names_the_layout(tmp_path: Path) -> None:
    raw = _class_folders(tmp_path / "raw")
    result = invoke("build", str(raw), str(tmp_path / "out"), "-n", "2", "-j", "1")
    assert result.exit_code == 0
    assert result.stdout.splitlines()[1] == "  input     class-folders (auto-detected)"
    assert "12 (6-6 per shard), 3 classes" in result.stdout.splitlines()[2]


@pytest.mark.parametrize(
    ("raw_at", "out_at", "message"),
    [
        ("raw", "raw/out", "{out}: the output folder is inside the input {raw} (the next build"),
        ("raw", "raw", "{out}: the output folder is the input (the next build"),
        ("raw/cat", "raw", "{raw}: the input is inside the output folder {out} (--overwrite"),
    ],
)
def test_an_output_overlapping_the_input_is_refused_before_anything_is_written(
    tmp_path: Path, raw_at: str, out_at: str, message: str
) -> None:
    _class_folders(tmp_path / "raw")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    raw, out = str(tmp_path / raw_at), str(tmp_path / out_at)
    for extra in ([], ["--overwrite"]):
        result = invoke("build", raw, out, "-n", "2", "-j", "1", *extra)
        assert result.exit_code != 0
        assert error_lines(result)[0].startswith("Error: " + message.format(raw=raw, out=out))
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def _parquet(path: Path, rows: int = 3) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"jpg": [b"row-%d" % i for i in range(rows)]})
    pq.write_table(table, path)


def test_parquet_files_beside_images_are_ambiguous_and_format_decides(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    _parquet(raw / "train.parquet")
    write(raw / "cover.jpg", b"jpeg")
    result = invoke("build", str(raw), str(tmp_path / "out"), "-n", "1", "-q")
    assert result.exit_code == 1
    assert error_lines(result) == [
        f"Error: {raw}: ambiguous layout: the top level holds .parquet files (e.g. "
        "'train.parquet') and other files (e.g. 'cover.jpg'); pass --format parquet to read "
        "the .parquet files alone (one sample per row; the others are skipped), or --format "
        "keyed to read every file as a sample"
    ]
    assert not (tmp_path / "out").exists()
    summary = _summary(str(raw), str(tmp_path / "out"), "-n", "1", "--format", "parquet")
    assert (summary["layout"], summary["num_samples"]) == ("parquet", 3)


def test_a_folder_of_images_beside_parquet_files_is_refused_naming_the_file(
    tmp_path: Path,
) -> None:
    raw = tmp_path / "raw"
    _parquet(raw / "train.parquet")
    write(raw / "images" / "0.jpg", b"jpeg")
    write(raw / "images" / "1.jpg", b"jpeg")
    result = invoke("build", str(raw), str(tmp_path / "out"), "-n", "1", "-q")
    assert result.exit_code == 1
    assert error_lines(result) == [
        f"Error: {raw / 'images' / '0.jpg'} (and 1 more): not a Parquet file, in {raw}, whose "
        "data files are Parquet (README*, dataset_info.json, _SUCCESS and other _* names, "
        "*.crc are skipped beside them); pass --format parquet to read the .parquet files "
        "alone (the others are skipped), or move the other files out of the input"
    ]
    summary = _summary(str(raw), str(tmp_path / "out"), "-n", "1", "--format", "parquet")
    assert (summary["layout"], summary["num_samples"]) == ("parquet", 3)


def test_a_parquet_file_in_a_later_class_folder_is_never_one_sample_on_a_guess(
    tmp_path: Path,
) -> None:
    raw = _class_folders(tmp_path / "raw")
    _parquet(raw / "eel" / "rows.parquet")
    result = invoke("build", str(raw), str(tmp_path / "out"), "-n", "2", "-q")
    assert result.exit_code == 1
    assert error_lines(result)[0] == "Error: 1 input problem(s), nothing was written:"
    assert (
        f"  {raw / 'eel' / 'rows.parquet'}: a Parquet file in class folders (the first class "
        "folder holds no Parquet, so the input was read as class folders); a Parquet file is "
        "never read as one sample on a guess: pass --format parquet to read rows as samples, "
        "or --format class-folders to take each file as one sample"
    ) in result.stderr.splitlines()
    summary = _summary(str(raw), str(tmp_path / "out"), "-n", "2", "--format", "class-folders")
    assert summary["num_samples"] == 3 * 4 + 1  # said explicitly: the file is one sample
