"""End to end: shardprep.build(...) output, read back with tarfile, WebDataset and zstd."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import shardprep
from shardprep.cli import cli
from shardprep.format.errors import InputError, PlanError
from shardprep.format.shardformat import EOF_MARKER, decode_index
from tests.conftest import payload

BUILT_CLASSES = [("a", 0, 60), ("b", 60, 90), ("c", 90, 103)]  # (name, first index, end)
ZSTD_CLASSES = [("a", 0, 600), ("b", 600, 900), ("c", 900, 1001)]


def _expected(classes: list[tuple[str, int, int]], repeat: int = 1) -> dict[str, tuple[int, bytes]]:
    """key -> (label, raw file bytes) of a conftest-style class-folder dataset."""
    return {
        f"{name}__{i:05d}": (label, payload(label, i) * repeat)
        for label, (name, lo, hi) in enumerate(classes)
        for i in range(lo, hi)
    }


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _hashes(folder: Path) -> dict[str, str]:
    """Every file in ``folder`` (hidden ones included) -> sha256."""
    return {p.name: _sha256(p) for p in sorted(folder.iterdir())}


def _tar_members(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path, "r:") as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar]  # type: ignore[union-attr]


def _zstd_decompress(path: Path) -> bytes:
    import zstandard

    with (
        open(path, "rb") as f,
        zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True) as reader,
    ):
        return reader.read()


# --- the plain build (conftest ``built``: 60/30/13 samples, 8 shards) ------------------


def test_output_files_and_summary_counts(built: Path) -> None:
    names = sorted(os.listdir(built))
    assert names == ["manifest.json"] + [
        f"shard-{i:05d}.{ext}" for i in range(8) for ext in ("idx", "tar")
    ]
    manifest = shardprep.read_manifest(str(built))
    assert manifest.num_samples == 103
    assert sorted(s.num_samples for s in manifest.shards) == [12] + [13] * 7


def test_manifest_fields(built: Path) -> None:
    data = json.loads((built / "manifest.json").read_text())
    assert data["format"] == "shardprep-manifest"
    assert data["version"] == 2  # 2: per-sample checksums in the index, index_bytes
    assert data["options"]["shards"] == 8
    assert data["options"]["compression"] == "none"
    assert data["options"]["seed"] == 0
    assert not {"workers", "overwrite", "resume", "progress"} & set(data["options"])
    assert len(data["input_fingerprint"]) == 64
    assert data["classes"] == [
        {"index": 0, "name": "a", "count": 60},
        {"index": 1, "name": "b", "count": 30},
        {"index": 2, "name": "c", "count": 13},
    ]
    shards = data["shards"]
    assert [s["file"] for s in shards] == [f"shard-{i:05d}.tar" for i in range(8)]
    assert [s["index_file"] for s in shards] == [f"shard-{i:05d}.idx" for i in range(8)]
    totals = data["totals"]
    assert totals["num_shards"] == 8
    assert totals["num_samples"] == sum(s["num_samples"] for s in shards) == 103
    assert (totals["min_shard_samples"], totals["max_shard_samples"]) == (12, 13)
    sizes = [s["num_bytes"] for s in shards]
    assert totals["num_bytes"] == sum(sizes) == totals["tar_bytes"]
    assert totals["shard_bytes_ratio"] == round(max(sizes) / min(sizes), 6)
    # class counts: sum over shards, and each shard floor/ceil of n_c / 8
    per_class = np.array([s["class_counts"] for s in shards])
    assert per_class.sum(axis=0).tolist() == [60, 30, 13]
    assert per_class.sum(axis=1).tolist() == [s["num_samples"] for s in shards]
    assert set(per_class[:, 0]) <= {7, 8}
    assert set(per_class[:, 1]) <= {3, 4}
    assert set(per_class[:, 2]) <= {1, 2}
    for s in shards:
        path = built / s["file"]
        assert s["sha256"] == _sha256(path)
        assert s["index_sha256"] == _sha256(built / s["index_file"])
        assert s["index_bytes"] == (built / s["index_file"]).stat().st_size
        assert s["num_bytes"] == s["tar_bytes"] == path.stat().st_size


def test_shards_round_trip_through_tarfile(built: Path) -> None:
    expected = _expected(BUILT_CLASSES)
    manifest = json.loads((built / "manifest.json").read_text())
    seen: dict[str, tuple[int, bytes]] = {}
    for entry in manifest["shards"]:
        members = _tar_members(built / entry["file"])
        # each sample: <key>.bin then <key>.cls, consecutive
        assert len(members) == 2 * entry["num_samples"]
        histogram = [0, 0, 0]
        for (data_name, data), (cls_name, cls) in zip(members[::2], members[1::2], strict=True):
            key = data_name.removesuffix(".bin")
            assert data_name == f"{key}.bin" and cls_name == f"{key}.cls"
            assert key not in seen
            seen[key] = (int(cls), data)
            histogram[int(cls)] += 1
        assert histogram == entry["class_counts"]
    assert seen == expected  # every sample exactly once, byte-equal, with its label


def test_index_matches_the_tar(built: Path) -> None:
    for shard in range(8):
        tar_path = built / f"shard-{shard:05d}.tar"
        index = decode_index((built / f"shard-{shard:05d}.idx").read_bytes())
        assert index.exts == ("bin", "cls")
        with tarfile.open(tar_path, "r:") as tar:
            members = list(tar)
        n = index.num_samples
        assert len(members) == 2 * n
        assert index.member_start.tolist() == list(range(0, 2 * n + 1, 2))
        assert index.sample_offset.tolist()[:-1] == [members[2 * i].offset for i in range(n)]
        assert int(index.sample_offset[-1]) + len(EOF_MARKER) == tar_path.stat().st_size
        assert index.member_offset.tolist() == [m.offset_data for m in members]
        assert index.member_size.tolist() == [m.size for m in members]
        assert [index.exts[e] for e in index.member_ext] == ["bin", "cls"] * n
        keys = [index.key(i) for i in range(n)]
        assert keys == [m.name.removesuffix(".bin") for m in members[::2]]
        for i, key in enumerate(keys):
            name, number = key.split("__")
            assert index.source(i) == f"{name}/{number}.bin"
            assert int(index.label[i]) == "abc".index(name)
        assert index.copy.tolist() == [0] * n
        assert index.multiplicity.tolist() == [1] * n
        assert index.frame_sample.tolist() == index.frame_offset.tolist() == []


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # webdataset leaves shard files open
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_shards_round_trip_through_webdataset(built: Path) -> None:
    import webdataset as wds

    urls = [str(built / f"shard-{i:05d}.tar") for i in range(8)]
    dataset = wds.WebDataset(urls, shardshuffle=False)
    samples = [(s["__key__"], s["__url__"], int(s["cls"]), s["bin"]) for s in dataset]
    del dataset
    expected = _expected(BUILT_CLASSES)
    assert len(samples) == 103
    assert {key: (label, data) for key, _url, label, data in samples} == expected
    # shard order preserved, and each shard's samples in its index order
    order = []
    for url in urls:
        index = decode_index(Path(url).with_suffix(".idx").read_bytes())
        order += [(index.key(i), url) for i in range(index.num_samples)]
    assert [(key, url) for key, url, _l, _d in samples] == order


def test_build_returns_a_summary(make_class_folders: Callable[..., Path], tmp_path: Path) -> None:
    raw = make_class_folders({"x": 10, "y": 5})
    summary = shardprep.build(str(raw), str(tmp_path / "out"), shards=4, workers=1, progress=False)
    d = summary.to_dict()
    assert (d["num_samples"], d["num_classes"], d["num_shards"]) == (15, 2, 4)
    assert (d["min_shard_samples"], d["max_shard_samples"], d["reused_shards"]) == (3, 4, 0)
    assert d["out"] == str(tmp_path / "out")
    files = list((tmp_path / "out").glob("shard-*.tar"))
    assert d["num_bytes"] == d["tar_bytes"] == sum(f.stat().st_size for f in files)
    assert json.loads(json.dumps(d)) == d


# --- determinism ----------------------------------------------------------------------


def test_rebuilds_are_byte_identical(
    make_class_folders: Callable[..., Path], tmp_path: Path
) -> None:
    raw = make_class_folders({"cat": 150, "dog": 90, "eel": 37})
    outs = []
    for run, workers in enumerate((1, 2, 1)):
        out = tmp_path / f"out{run}"
        shardprep.build(str(raw), str(out), shards=6, workers=workers, progress=False)
        outs.append(_hashes(out))
    assert len(outs[0]) == 1 + 2 * 6
    assert outs[0] == outs[1] == outs[2]
    # a different seed changes the shards (and the manifest records it)
    other = tmp_path / "seed1"
    shardprep.build(str(raw), str(other), shards=6, seed=1, workers=2, progress=False)
    differing = {n for n, h in _hashes(other).items() if outs[0][n] != h}
    assert {f"shard-{i:05d}.tar" for i in range(6)} <= differing
    assert "manifest.json" in differing


def test_zstd_rebuild_with_two_workers_is_byte_identical(built_zstd: Path, tmp_path: Path) -> None:
    out = tmp_path / "again"
    shardprep.build(
        str(built_zstd.parent / "raw"),
        str(out),
        shards=10,
        workers=2,
        compression="zstd",
        progress=False,
    )
    assert _hashes(out) == _hashes(built_zstd)


# --- zstd -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_twin(built_zstd: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uncompressed build of ``built_zstd``'s input with the same options."""
    out = tmp_path_factory.mktemp("plain_twin") / "out"
    shardprep.build(str(built_zstd.parent / "raw"), str(out), shards=10, workers=1, progress=False)
    return out


def test_zstd_manifest(built_zstd: Path, plain_twin: Path) -> None:
    zm, pm = shardprep.read_manifest(str(built_zstd)), shardprep.read_manifest(str(plain_twin))
    assert zm.compression == "zstd"
    assert [s.file for s in zm.shards] == [f"shard-{i:05d}.tar.zst" for i in range(10)]
    assert zm.class_counts == pm.class_counts == (600, 300, 101)
    for z, p in zip(zm.shards, pm.shards, strict=True):
        assert z.num_samples == p.num_samples
        assert z.class_counts == p.class_counts
        assert z.tar_bytes == p.tar_bytes == p.num_bytes
        assert z.num_bytes == (built_zstd / z.file).stat().st_size < z.tar_bytes
        assert z.sha256 == _sha256(built_zstd / z.file)


def test_zstd_stream_decompresses_to_the_uncompressed_build(
    built_zstd: Path, plain_twin: Path
) -> None:
    for i in range(10):
        tar_bytes = (plain_twin / f"shard-{i:05d}.tar").read_bytes()
        assert _zstd_decompress(built_zstd / f"shard-{i:05d}.tar.zst") == tar_bytes
    members = _tar_members(plain_twin / "shard-00000.tar")
    assert len(members) == 2 * shardprep.read_manifest(str(plain_twin)).shards[0].num_samples


@pytest.mark.skipif(shutil.which("zstd") is None, reason="no zstd binary")
def test_zstd_command_line_tool_reads_the_shards(built_zstd: Path, plain_twin: Path) -> None:
    expected = _expected(ZSTD_CLASSES, repeat=40)
    total = 0
    for i in (0, 9):
        result = subprocess.run(
            ["zstd", "-dc", str(built_zstd / f"shard-{i:05d}.tar.zst")],
            capture_output=True,
            check=True,
        )
        assert result.stdout == (plain_twin / f"shard-{i:05d}.tar").read_bytes()
        with tarfile.open(fileobj=io.BytesIO(result.stdout), mode="r:") as tar:
            for m in tar:
                if m.name.endswith(".bin"):
                    assert tar.extractfile(m).read() == expected[m.name[:-4]][1]  # type: ignore[union-attr]
                    total += 1
    assert total > 150


def test_zstd_seek_to_any_sample(built_zstd: Path) -> None:
    """Decompress only the frame that holds sample i: its members are there, byte-exact."""
    import zstandard

    expected = _expected(ZSTD_CLASSES, repeat=40)
    checked = Counter()
    for shard in (0, 4, 9):
        path = built_zstd / f"shard-{shard:05d}.tar.zst"
        index = decode_index((built_zstd / f"shard-{shard:05d}.idx").read_bytes())
        starts, offsets = index.frame_sample, index.frame_offset
        n = index.num_samples
        assert starts[0] == 0 and starts[-1] == n
        assert offsets[0] == 0 and offsets[-1] < path.stat().st_size  # EOF marker frame after
        assert len(starts) >= 4  # several frames per shard
        assert np.all(np.diff(starts.astype(np.int64)) > 0)
        firsts = [int(s) for s in starts[:-1]]
        picks = {0, n - 1, n // 2, *firsts, *(s - 1 for s in firsts if s)}
        blob = path.read_bytes()
        for i in sorted(picks):
            f = int(np.searchsorted(starts, i, side="right")) - 1
            assert int(starts[f]) <= i < int(starts[f + 1])
            frame = blob[int(offsets[f]) : int(offsets[f + 1])]
            chunk = zstandard.ZstdDecompressor().decompress(frame)  # this frame alone
            base = int(index.sample_offset[int(starts[f])])
            end = int(index.sample_offset[int(starts[f + 1])])
            assert len(chunk) == end - base
            key = index.key(i)
            m = int(index.member_start[i])
            data_start = int(index.member_offset[m]) - base
            data = chunk[data_start : data_start + int(index.member_size[m])]
            label, raw = expected[key]
            assert data == raw
            # the sample's bytes also parse as a tar on their own
            lo = int(index.sample_offset[i]) - base
            hi = int(index.sample_offset[i + 1]) - base
            with tarfile.open(fileobj=io.BytesIO(chunk[lo:hi] + EOF_MARKER), mode="r:") as tar:
                got = [(mm.name, tar.extractfile(mm).read()) for mm in tar]  # type: ignore[union-attr]
            assert got == [(f"{key}.bin", raw), (f"{key}.cls", str(label).encode())]
            checked[shard] += 1
    assert min(checked.values()) >= 8


# --- the output folder ------------------------------------------------------------------


def test_non_empty_out_is_refused(make_class_folders: Callable[..., Path], tmp_path: Path) -> None:
    raw = make_class_folders({"a": 4})
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(InputError) as info:
        shardprep.build(str(raw), str(out), shards=2, workers=1, progress=False)
    assert str(out) in str(info.value)
    assert "overwrite=True" in str(info.value)  # the keyword: called from Python
    assert os.listdir(out) == ["notes.txt"]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(InputError, match="is not a folder"):
        shardprep.build(str(raw), str(a_file), shards=2, workers=1, progress=False)
    with pytest.raises(PlanError):
        shardprep.build(str(raw), str(out), shards=2, overwrite=True, resume=True)


def test_overwrite_replaces_a_previous_build(
    make_class_folders: Callable[..., Path], tmp_path: Path
) -> None:
    raw = make_class_folders({"a": 20, "b": 10})
    out = tmp_path / "out"
    shardprep.build(str(raw), str(out), shards=8, workers=1, progress=False)
    (out / "notes.txt").write_text("mine")
    (out / ".shard-00002.tar.partial").write_bytes(b"left by a crash")
    (out / ".shardprep-build.json").write_text("{}")
    summary = shardprep.build(
        str(raw),
        str(out),
        shards=3,
        workers=1,
        compression="zstd",
        overwrite=True,
        progress=False,
    )
    assert summary.num_shards == 3
    assert sorted(os.listdir(out)) == [
        "manifest.json",
        "notes.txt",
        "shard-00000.idx",
        "shard-00000.tar.zst",
        "shard-00001.idx",
        "shard-00001.tar.zst",
        "shard-00002.idx",
        "shard-00002.tar.zst",
    ]
    assert (out / "notes.txt").read_text() == "mine"
    # the same as building into an empty folder
    fresh = tmp_path / "fresh"
    shardprep.build(str(raw), str(fresh), shards=3, workers=1, compression="zstd", progress=False)
    hashes = _hashes(out)
    del hashes["notes.txt"]
    assert hashes == _hashes(fresh)


def test_failed_scan_writes_nothing(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    (raw / "cat").mkdir(parents=True)
    (raw / "cat" / "a.jpg").write_bytes(b"a")
    (raw / "dog").mkdir()  # empty class folder
    out = tmp_path / "out"
    with pytest.raises(InputError):
        shardprep.build(str(raw), str(out), shards=1, workers=1, progress=False)
    assert not out.exists()


def test_build_tolerates_empty_files_and_long_keys(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    deep = raw / "cls" / ("sub" * 30) / ("deeper" * 10)
    deep.mkdir(parents=True)
    (deep / "long.bin").write_bytes(b"L" * 1000)
    (raw / "cls" / "empty.bin").write_bytes(b"")
    out = tmp_path / "out"
    shardprep.build(str(raw), str(out), shards=1, workers=1, progress=False)
    members = dict(_tar_members(out / "shard-00000.tar"))
    long_key = "cls__" + "sub" * 30 + "__" + "deeper" * 10 + "__long"
    assert len(long_key) > 100
    assert members == {
        "cls__empty.bin": b"",
        "cls__empty.cls": b"0",
        f"{long_key}.bin": b"L" * 1000,
        f"{long_key}.cls": b"0",
    }


# --- verify ---------------------------------------------------------------------------


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def _verify(out: Path) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["verify", "--quiet", str(out)])
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def test_verify_accepts_a_clean_build(built: Path, built_zstd: Path) -> None:
    assert _verify(built) == (0, "ok: 8 shards, 103 samples verified\n")
    assert _verify(built_zstd) == (0, "ok: 10 shards, 1001 samples verified\n")


def test_verify_finds_a_flipped_byte(built: Path, tmp_path: Path) -> None:
    out = _copy(built, tmp_path)
    path = out / "shard-00003.tar"
    data = bytearray(path.read_bytes())
    data[512 + 5] ^= 0x01  # inside the first member's data
    path.write_bytes(bytes(data))
    code, output = _verify(out)
    assert code == 1
    assert "shard-00003.tar: sha256 of the shard does not match the manifest" in output
    index = decode_index((out / "shard-00003.idx").read_bytes())
    assert (
        f"shard-00003.tar: 1 damaged sample(s) (missing bytes or checksum mismatch): {index.key(0)!r} (offset 0)"
        in output
    )
    assert "2 problem(s) in" in output
    for other in (0, 1, 2, 4, 5, 6, 7):
        assert f"shard-{other:05d}" not in output


def test_verify_finds_a_truncated_shard(built: Path, tmp_path: Path) -> None:
    out = _copy(built, tmp_path)
    path = out / "shard-00005.tar"
    os.truncate(path, path.stat().st_size - 1500)
    code, output = _verify(out)
    assert code == 1
    assert "shard-00005.tar: sha256 of the shard does not match" in output
    assert "shard-00005.tar: cannot read the tar stream" in output
    assert f"shard-00005.tar: the file has {path.stat().st_size} bytes, the manifest says" in output
    assert "3 problem(s) in" in output


def test_verify_finds_a_zeroed_shard_start(built: Path, tmp_path: Path) -> None:
    out = _copy(built, tmp_path)
    with open(out / "shard-00001.tar", "r+b") as f:
        f.write(bytes(1024))  # reads as an empty tar
    code, output = _verify(out)
    assert code == 1
    assert "shard-00001.tar: tar ends after 0 members, the index lists" in output


def test_verify_finds_missing_and_modified_files(built: Path, tmp_path: Path) -> None:
    out = _copy(built, tmp_path)
    os.remove(out / "shard-00006.tar")
    with open(out / "shard-00002.idx", "ab") as f:
        f.write(b"\x00" * 8)
    code, output = _verify(out)
    assert code == 1
    assert "shard-00006.tar: missing file shard-00006.tar" in output
    assert "shard-00002.tar: sha256 of the index does not match the manifest" in output


def test_verify_finds_a_corrupt_zstd_frame(built_zstd: Path, tmp_path: Path) -> None:
    out = _copy(built_zstd, tmp_path)
    path = out / "shard-00007.tar.zst"
    index = decode_index((out / "shard-00007.idx").read_bytes())
    data = bytearray(path.read_bytes())
    data[int(index.frame_offset[2]) + 100] ^= 0xFF  # inside frame 2
    path.write_bytes(bytes(data))
    code, output = _verify(out)
    assert code == 1
    assert "shard-00007.tar.zst: sha256 of the shard does not match" in output
    assert "shard-00007.tar.zst: zstd frame 2 at offset" in output
    assert "shard-00007.tar.zst: cannot read the tar stream" in output


def test_verify_without_manifest(built: Path, tmp_path: Path) -> None:
    out = _copy(built, tmp_path)
    os.remove(out / "manifest.json")
    code, output = _verify(out)
    assert code == 1
    assert "no manifest; the build did not finish" in output
