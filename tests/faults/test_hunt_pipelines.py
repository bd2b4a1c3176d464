"""Hostile inputs for the pipeline paths (issue 21): Parquet files, Python iterables, --map.

Each test is an attack that an outsider could mount with a crafted file, sample or function;
each pins the behaviour: a named refusal before OUT is written (and no scratch left), or the
exact bytes written.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shardprep
from shardprep.example import write_example
from shardprep.format.errors import BuildInterrupted, InputError, OutputError, PlanError
from shardprep.scan.iterable import MAX_CLASS_INDEX as ITERABLE_MAX_CLASS_INDEX
from shardprep.scan.iterable import MAX_EXTENSIONS
from shardprep.scan.parquet import MAX_CLASS_INDEX, ParquetInputError, _spill_path
from shardprep.scratch import sweep_stale
from shardprep.transform import MapError
from tests.faults.helpers import flip_page_byte
from tests.filesystems import tmpfs
from tests.processes import run_bounded

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's TMPDIR, so each test can check that no scratch folder is left behind."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _members(out: Path) -> dict[str, bytes]:
    """Every member of every shard of ``out``, by name."""
    found: dict[str, bytes] = {}
    for shard in sorted(out.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            for info in tar.getmembers():
                data = tar.extractfile(info)
                assert data is not None
                found[info.name] = data.read()
    return found


def _refused(raw: Any, out: Path, error: type[Exception], scratch: Path, **options: Any) -> str:
    with pytest.raises(error) as caught:
        shardprep.build(raw, str(out), shards=2, workers=1, progress=False, **options)
    assert not out.exists()  # nothing written to OUT
    assert os.listdir(scratch) == []  # no spill left
    return str(caught.value)


def _parquet(path: Path, columns: dict[str, Any], **options: Any) -> Path:
    pq.write_table(pa.table(columns), path, **options)
    return path


# --- Parquet ------------------------------------------------------------------------------


def test_dictionary_encoded_and_fixed_size_binary_columns_are_members(tmp_path: Path) -> None:
    """A dictionary<binary> column (what pyarrow writes for a dictionary-encoded column) was
    read as metadata: its bytes went into .json as "b'..'" text, or the file was refused for
    having no binary column. Fixed-size binary was refused the same way."""
    raw = _parquet(
        tmp_path / "d.parquet",
        {
            "__key__": ["a", "b", "c"],
            "jpg": pa.array([b"JJ", b"KK", b"JJ"]).dictionary_encode(),
            "npy": pa.array([b"\x00\x01", b"\x02\x03", b"\x04\x05"], pa.binary(2)),
        },
    )
    assert pa.types.is_dictionary(pq.read_schema(raw).field("jpg").type)
    out = tmp_path / "out"
    shardprep.build(str(raw), str(out), shards=1, workers=1, progress=False)
    assert _members(out) == {
        "a.jpg": b"JJ",
        "a.npy": b"\x00\x01",
        "b.jpg": b"KK",
        "b.npy": b"\x02\x03",
        "c.jpg": b"JJ",
        "c.npy": b"\x04\x05",
    }


@pytest.mark.parametrize(
    "column",
    [
        pa.array([[b"\x00"], [b"\xff"]], pa.list_(pa.binary())),
        pa.array([[{"bytes": b"\x00", "path": "a.png"}]] * 2),  # HF Sequence(Image())
        pa.array([{"thumb": b"\x00", "w": 1}] * 2),
    ],
    ids=["list-of-binary", "list-of-image-structs", "struct-with-binary"],
)
def test_bytes_nested_in_a_column_are_refused_naming_it(
    column: Any, tmp_path: Path, scratch: Path
) -> None:
    """They went into .json as Python reprs ("b'\\\\x00'"), a silent loss of every payload."""
    raw = _parquet(
        tmp_path / "n.parquet", {"__key__": ["a", "b"], "jpg": [b"x", b"y"], "extra": column}
    )
    message = _refused(raw, tmp_path / "out", ParquetInputError, scratch)
    assert message.startswith(f"{raw}: column 'extra' (")
    assert "holds bytes inside a list, struct or map" in message
    assert "split it into binary columns, or drop it" in message


def test_a_negative_integer_label_is_refused_naming_the_row(tmp_path: Path, scratch: Path) -> None:
    """[0, -1] became the names "-1", "0": the row labelled 0 was written as class 1."""
    raw = _parquet(
        tmp_path / "l.parquet", {"__key__": ["a", "b"], "jpg": [b"x", b"y"], "label": [0, -1]}
    )
    message = _refused(raw, tmp_path / "out", ParquetInputError, scratch)
    assert message == (
        f"{raw}: row 1 (key 'b'): label -1 in column 'label' is a negative class index; "
        "integer labels are class indices (>= 0): renumber them, or store the labels as "
        "strings (class names, numbered in sorted order)"
    )


@pytest.mark.parametrize("label", [MAX_CLASS_INDEX + 1, str(MAX_CLASS_INDEX + 1)])
def test_an_absurd_class_index_is_refused_before_it_costs_memory(
    label: Any, tmp_path: Path, scratch: Path
) -> None:
    """One row labelled 2**40 made the build list 2**40 class names: the process grew to
    21 GB and the kernel killed it (measured). Now a class index has a bound."""
    labels = pa.array([0, label] if isinstance(label, int) else ["0", label])
    raw = _parquet(
        tmp_path / "h.parquet", {"__key__": ["a", "b"], "jpg": [b"x", b"y"], "label": labels}
    )
    message = _refused(raw, tmp_path / "out", ParquetInputError, scratch)
    assert f"{raw}: row 1 (key 'b'): label {label!r} in column 'label' is a class index " in message
    assert "would need 1,048,577 class names" in message


def test_the_largest_class_index_allowed_still_builds(tmp_path: Path) -> None:
    """The bound above refuses one index too many, not the largest one (built once here, not
    once per refused label type: the build is the same)."""
    ok = _parquet(
        tmp_path / "ok.parquet",
        {"__key__": ["a", "b"], "jpg": [b"x", b"y"], "label": [0, MAX_CLASS_INDEX]},
    )
    summary = shardprep.build(str(ok), str(tmp_path / "ok"), shards=1, progress=False)
    assert summary.num_classes == MAX_CLASS_INDEX + 1


def test_a_corrupted_page_with_a_checksum_is_refused(tmp_path: Path, scratch: Path) -> None:
    """A flipped byte inside a payload page was copied into the shards as it was; a file
    written with page checksums (``write_page_checksum=True``, Spark's default since 3.5)
    is now checked."""
    rows = 32
    payloads = [bytes([i]) * 3000 + os.urandom(1000) for i in range(rows)]
    raw = _parquet(
        tmp_path / "c.parquet",
        {"__key__": [f"k{i:02d}" for i in range(rows)], "bin": payloads},
        row_group_size=16,
        write_page_checksum=True,
        use_dictionary=False,
        compression="none",
    )
    flip_page_byte(raw, row_group=1, column=1)
    message = _refused(raw, tmp_path / "out", ParquetInputError, scratch)
    assert message.startswith(f"{raw}: row group 1 (rows 16-31) cannot be read")
    assert "CRC checksum verification failed" in message


def test_a_file_cut_short_says_so(tmp_path: Path, scratch: Path) -> None:
    raw = _parquet(tmp_path / "t.parquet", {"__key__": ["a", "b"], "jpg": [b"x" * 999, b"y"]})
    raw.write_bytes(raw.read_bytes()[:-100])
    message = _refused(raw, tmp_path / "out", ParquetInputError, scratch)
    assert message.startswith(f"{raw}: not a Parquet file, or one cut short (its footer")


def test_a_full_scratch_disk_during_the_parquet_spill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spill of 2 MB of payloads into a 256 KiB TMPDIR: an OutputError naming the spill
    file with advice, ENOSPC as its cause, nothing in OUT, nothing left in TMPDIR."""
    raw = _parquet(
        tmp_path / "big.parquet",
        {"__key__": [f"k{i}" for i in range(32)], "bin": [os.urandom(64 << 10) for _ in range(32)]},
        row_group_size=4,
    )
    with tmpfs(tmp_path / "small", "size=256k") as small:
        monkeypatch.setattr(tempfile, "tempdir", str(small))
        with pytest.raises(OutputError) as info:
            shardprep.build(str(raw), str(tmp_path / "out"), shards=2, progress=False)
        message = str(info.value)
        assert message.startswith(f"{small}/shardprep-build-")
        assert "/big.parquet: no room for the Parquet payloads in the build's scratch" in message
        assert "set TMPDIR to a folder on a disk with room" in message
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == errno.ENOSPC
        assert os.listdir(small) == []
    assert not (tmp_path / "out").exists()


def test_a_spill_path_cannot_leave_the_scratch_folder(tmp_path: Path) -> None:
    """An object store key may hold '..' segments (S3 keys are any string): the spill of
    ``s3://b/p/a/../../../x.parquet`` would have been created outside the scratch folder."""
    root = str(tmp_path / "parquet-xyz")
    assert _spill_path(root, "year=2024/part-0.parquet", "u") == f"{root}/year=2024/part-0.parquet"
    for rel in ("a/../../x.parquet", "../x.parquet", "a/../../parquet-xyz2/x.parquet"):
        with pytest.raises(ParquetInputError, match=r"^s3://b/p/x: its name leads out of"):
            _spill_path(root, rel, "s3://b/p/x")


# --- Python iterables --------------------------------------------------------------------


def test_too_many_distinct_extensions_are_refused_naming_the_sample(
    tmp_path: Path, scratch: Path
) -> None:
    """A sample with 70,000 members ``m0`` .. ``m69999`` ended in a bare OverflowError
    (uint16 extension ids) after the spill."""
    samples = [
        {"__key__": "few", "jpg": b"y"},
        {"__key__": "many", **{f"m{i}": b"x" for i in range(MAX_EXTENSIONS + 10)}},
    ]
    message = _refused(samples, tmp_path / "out", InputError, scratch)
    assert message.startswith(
        "sample 'many' brings the number of distinct member extensions to 65,547; a build "
        "holds at most 65,536"
    )


@pytest.mark.parametrize("cls", [ITERABLE_MAX_CLASS_INDEX + 1, 2**40, "2000000"])
def test_an_absurd_class_index_from_code_is_refused(
    cls: Any, tmp_path: Path, scratch: Path
) -> None:
    """cls=2**40 on one sample: the build was killed by the kernel at 21 GB (measured)."""
    samples = [{"__key__": "a", "jpg": b"x", "cls": 0}, {"__key__": "b", "jpg": b"y", "cls": cls}]
    message = _refused(samples, tmp_path / "out", InputError, scratch)
    shown = repr(cls)  # an int as it is, a str quoted
    assert message.startswith(f"sample 'b': cls {shown} is a class index above 1,048,575")


def test_the_same_dict_mutated_between_samples_gives_each_sample(tmp_path: Path) -> None:
    """A generator that reuses one dict (and one bytearray) for every sample: each sample is
    copied when it is yielded, so each keeps its own bytes."""

    def reused() -> Iterator[dict[str, Any]]:
        sample: dict[str, Any] = {}
        buffer = bytearray(b"-abc")
        for i in range(6):
            buffer[0] = ord("A") + i
            sample.clear()
            sample.update({"__key__": f"k{i}", "bin": buffer, "cls": i % 2})
            yield sample

    out = tmp_path / "out"
    shardprep.build(reused(), str(out), shards=2, workers=1, progress=False)
    members = _members(out)
    assert {k: v for k, v in members.items() if k.endswith(".bin")} == {
        f"k{i}.bin": bytes([ord("A") + i]) + b"abc" for i in range(6)
    }
    assert {k: v for k, v in members.items() if k.endswith(".cls")} == {
        f"k{i}.cls": str(i % 2).encode() for i in range(6)
    }


def test_a_10_kb_key_survives_spill_shards_and_loader(tmp_path: Path) -> None:
    """Keys longer than a tar name (100 bytes) go through GNU long-name records."""
    from loader import ShardDataset

    long_key = "k" * 10240
    out = tmp_path / "out"
    samples = [{"__key__": long_key, "jpg": b"long"}, {"__key__": "short", "jpg": b"s"}]
    shardprep.build(samples, str(out), shards=1, workers=1, progress=False)
    assert _members(out) == {f"{long_key}.jpg": b"long", "short.jpg": b"s"}
    got = {s["__key__"]: s["jpg"] for s in ShardDataset(str(out), shuffle=False)}
    assert got == {long_key: b"long", "short": b"s"}


SPILL_AND_WAIT = """
import os, sys, time, shardprep
marker = sys.argv[1]
def samples():
    for i in range(1000):
        if i == 50:
            open(marker, "w").close()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                time.sleep(0.05)
        yield {"__key__": f"k{i:04d}", "bin": os.urandom(1000)}
shardprep.build(samples(), sys.argv[2], shards=2, workers=1, progress=False)
"""


def test_a_build_killed_while_spilling_is_swept_by_the_next_one(
    tmp_path: Path, scratch: Path
) -> None:
    """SIGKILL in the middle of the spill leaves its scratch folder (the spill tar half
    written, the lock released by the kernel); the next build's sweep removes it, and a
    folder whose build is alive is left alone."""
    marker = tmp_path / "spilling"
    proc = subprocess.Popen(
        [sys.executable, "-c", SPILL_AND_WAIT, str(marker), str(tmp_path / "out")],
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(scratch)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the spill never started"
            time.sleep(0.01)  # polling interval only
        (alive,) = os.listdir(scratch)
        assert sweep_stale(str(scratch)) == []  # its build holds the lock: left alone
        spilled = scratch / alive / "samples" / "iterable-00000.tar"
        assert spilled.stat().st_size > 0
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stderr:
            proc.stderr.close()
    assert os.listdir(scratch) == [alive]  # left by the SIGKILL
    assert not (tmp_path / "out").exists()
    shardprep.build(
        [{"__key__": "a", "bin": b"x"}], str(tmp_path / "next"), shards=1, progress=False
    )
    assert os.listdir(scratch) == []  # swept by the next build, which removed its own too


# --- --map ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def raw_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("hunt-map")
    write_example(str(base / "raw"), 24, 2, 0)
    return base / "raw"


@pytest.mark.parametrize(
    ("function", "raised"),
    [("exits_zero", "SystemExit: 0"), ("raises_base_exception", "NotAnException: not an")],
)
@pytest.mark.parametrize("workers", [1, 2])
def test_sys_exit_or_a_base_exception_in_a_map_is_a_map_error(
    function: str, raised: str, workers: int, raw_images: Path, tmp_path: Path
) -> None:
    """sys.exit(0) in a map ended `shardprep build` with exit status 0 and no manifest and
    no message; another BaseException gave a bare traceback."""
    out = tmp_path / "out"
    with pytest.raises(MapError) as info:
        shardprep.build(
            str(raw_images),
            str(out),
            shards=2,
            workers=workers,
            map=f"tests.faults.hunt_maps:{function}",
            progress=False,
        )
    message = str(info.value)
    assert f"map tests.faults.hunt_maps:{function} on sample '" in message
    assert f"raised {raised}" in message
    assert message.endswith("call shardprep.build again with the same arguments and resume=True")
    assert not (out / "manifest.json").exists()
    assert not [p for p in out.iterdir() if p.name.endswith(".partial")]


def test_the_cli_exits_1_when_the_map_calls_sys_exit(raw_images: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_bounded(
        [sys.executable, "-m", "shardprep", "build", str(raw_images), str(out), "-n", "2",
         "--map", "tests.faults.hunt_maps:exits_zero"],
        timeout=120,
        cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "raised SystemExit: 0" in result.stderr
    assert not (out / "manifest.json").exists()


def test_a_map_module_that_exits_on_import_is_refused(raw_images: Path, tmp_path: Path) -> None:
    """A module whose import runs sys.exit(0): the CLI ended with exit status 0, silently."""
    with pytest.raises(PlanError, match=r"cannot import it \(SystemExit: 0\)"):
        shardprep.build(
            str(raw_images),
            str(tmp_path / "out"),
            shards=2,
            map="tests.faults.hunt_exits_on_import:identity",
            progress=False,
        )
    assert not (tmp_path / "out").exists()
    sys.modules.pop("tests.faults.hunt_exits_on_import", None)


def test_keyboard_interrupt_from_a_map_stops_the_build_as_ctrl_c(
    raw_images: Path, tmp_path: Path
) -> None:
    with pytest.raises(BuildInterrupted) as info:
        shardprep.build(
            str(raw_images),
            str(tmp_path / "out"),
            shards=2,
            workers=1,
            map="tests.faults.hunt_maps:interrupts",
            progress=False,
        )
    assert info.value.resumable


def test_a_member_name_with_a_control_character_is_refused(
    raw_images: Path, tmp_path: Path
) -> None:
    """A map returning "txt\\n" wrote a member named "<key>.txt\\n" into the shards."""
    with pytest.raises(MapError, match=r"returned the member name 'txt\\n', which holds a control"):
        shardprep.build(
            str(raw_images),
            str(tmp_path / "out"),
            shards=2,
            workers=1,
            map="tests.faults.hunt_maps:newline_member",
            progress=False,
        )


def test_a_map_that_mutates_its_input_and_returns_it_writes_the_result(
    raw_images: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    shardprep.build(
        str(raw_images),
        str(out),
        shards=2,
        workers=2,
        map="tests.faults.hunt_maps:mutates_and_returns",
        progress=False,
    )
    pngs = {k: v for k, v in _members(out).items() if k.endswith(".png")}
    assert len(pngs) == 24
    assert set(pngs.values()) == {b"\x89PNG\r\n\x1a\n"}


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_map_that_ends_its_process_is_named_and_the_build_exits_1(
    raw_images: Path, tmp_path: Path, workers: str
) -> None:
    """os._exit(0) in a map: with --workers 1 it ran in the build's own process, which then
    ended with status 0 and no manifest; now every map runs in a worker process, whose death
    is a WorkersDiedError naming the shard and the map."""
    out = tmp_path / "out"
    result = run_bounded(
        [sys.executable, "-m", "shardprep", "build", str(raw_images), str(out), "-n", "2",
         "-j", workers, "--map", "tests.faults.hunt_maps:ends_the_process"],
        timeout=120,
        cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "the worker process writing it died without an answer" in result.stderr
    assert "tests.faults.hunt_maps:ends_the_process" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (out / "manifest.json").exists()


def test_a_hanging_map_is_stopped_by_the_stall_timeout_with_one_worker(
    raw_images: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = run_bounded(
        [sys.executable, "-m", "shardprep", "build", str(raw_images), str(out), "-n", "2",
         "-j", "1", "--stall-timeout", "3", "--map", "tests.faults.hunt_maps:hangs"],
        timeout=120,
        cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "no progress for 3" in result.stderr
    assert not (out / "manifest.json").exists()


def test_json_output_is_the_summary_alone_whatever_prints_to_stdout(
    raw_images: Path, tmp_path: Path
) -> None:
    """With --json, what the build's processes write to stdout (a map, a library, Ray's notice
    of a dead node) goes to stderr: stdout is the summary only."""
    out = tmp_path / "out"
    result = run_bounded(
        [sys.executable, "-m", "shardprep", "build", str(raw_images), str(out), "-n", "2",
         "--json", "--map", "tests.faults.hunt_maps:prints"],
        timeout=120,
        cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["num_shards"] == 2
    assert "noise from the map" in result.stderr
