"""The engine seam without Ray: option checks, the missing-extra error, retry classification."""

from __future__ import annotations

import errno
import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import shardprep
from shardprep.engine import EngineOptions, open_engine
from shardprep.engine.faults import TransientWriteError, classify
from shardprep.engine.local import LocalEngine
from shardprep.format.errors import (
    InputError,
    PlanError,
    StalledError,
    WorkersDiedError,
    WriteError,
)
from shardprep.format.interface import PYTHON
from shardprep.inventory import PartRef, SampleRef
from shardprep.scan import listing, scan
from tests.conftest import write_class_folders
from tests.engine.faulty import HOLD_LIMIT_S, faults_in
from tests.faults.helpers import error_lines, invoke
from tests.processes import run_bounded


def _sample(path: Path, size: int) -> SampleRef:
    return SampleRef("k", 0, "k.bin", (PartRef("bin", str(path), -1, size),), None)


def _failed(cause: OSError) -> WriteError:
    err = WriteError(f"shard 2: {cause}", 2)
    err.__cause__ = cause
    return err


def test_an_io_error_on_unchanged_sources_is_transient(tmp_path: Path) -> None:
    (tmp_path / "k.bin").write_bytes(b"abc")
    result = classify(_failed(OSError(errno.EIO, "flaky")), [_sample(tmp_path / "k.bin", 3)])
    assert isinstance(result, TransientWriteError)
    assert result.shard_index == 2


@pytest.mark.parametrize(
    ("code", "size", "exists"),
    [
        (errno.EACCES, 3, True),  # permission: not passing
        (errno.ENOSPC, 3, True),  # disk full: not passing
        (errno.EIO, 4, True),  # the source changed size since the scan
        (errno.EIO, 3, False),  # the source is gone
    ],
)
def test_other_failures_are_not_retried(tmp_path: Path, code: int, size: int, exists: bool) -> None:
    if exists:
        (tmp_path / "k.bin").write_bytes(b"abc")
    err = _failed(OSError(code, "failed"))
    assert classify(err, [_sample(tmp_path / "k.bin", size)]) is err


def test_unknown_engine_and_a_ray_address_without_ray_are_refused(tmp_path: Path) -> None:
    """shardprep.build names keywords; the engine seam itself (no caller to name) its flag."""
    with pytest.raises(PlanError, match="^engine= must be one of local, ray \\(got 'spark'\\)$"):
        shardprep.build(str(tmp_path), str(tmp_path / "out"), shards=1, engine="spark")
    with pytest.raises(PlanError, match="^ray_address= needs engine='ray'$"):
        shardprep.build(str(tmp_path), str(tmp_path / "out"), shards=1, ray_address="x:1")
    with pytest.raises(PlanError, match="--engine must be one of"):
        open_engine(EngineOptions(name="dask"))
    with pytest.raises(PlanError, match="^engine= must be one of"):  # the build's interface
        open_engine(EngineOptions(name="dask", interface=PYTHON))


NO_RAY = """
import sys
sys.modules["ray"] = None  # as if Ray were not installed
from shardprep.cli import main
main(["build", sys.argv[1], sys.argv[2], "-n", "1", "--engine", "ray", "-q"])
"""


def test_ray_missing_names_the_extra(tmp_path: Path) -> None:
    (tmp_path / "raw" / "a").mkdir(parents=True)
    (tmp_path / "raw" / "a" / "x.bin").write_bytes(b"x")
    result = run_bounded(
        [sys.executable, "-c", NO_RAY, str(tmp_path / "raw"), str(tmp_path / "out")], timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert 'Error: --engine ray needs Ray: pip install "shardprep[ray]"' in result.stderr
    assert not (tmp_path / "out").exists()


def test_ray_missing_names_the_keyword_in_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was: "--engine ray needs Ray" for shardprep.build(..., engine="ray") too."""
    (tmp_path / "raw" / "a").mkdir(parents=True)
    (tmp_path / "raw" / "a" / "x.bin").write_bytes(b"x")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(PlanError) as caught:
        shardprep.build(str(tmp_path / "raw"), str(tmp_path / "out"), shards=1, engine="ray")
    assert str(caught.value).startswith("engine='ray' needs Ray: pip install \"shardprep[ray]\"")
    assert not (tmp_path / "out").exists()


def test_an_unreachable_ray_address_is_refused_promptly(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    (tmp_path / "raw" / "a").mkdir(parents=True)
    (tmp_path / "raw" / "a" / "x.bin").write_bytes(b"x")
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    address = f"ray_address='127.0.0.1:{port}': no Ray cluster answers"  # the keyword
    with pytest.raises(PlanError, match=address):
        shardprep.build(
            str(tmp_path / "raw"),
            str(tmp_path / "out"),
            shards=1,
            engine="ray",
            ray_address=f"127.0.0.1:{port}",
            progress=False,
        )
    assert not (tmp_path / "out").exists()
    args = ["-n", "1", "--engine", "ray", "--ray-address", f"127.0.0.1:{port}", "-q"]
    result = invoke("build", str(tmp_path / "raw"), str(tmp_path / "out"), *args)
    assert result.exit_code == 2, result.output
    [line] = error_lines(result)
    assert line.startswith(f"Error: --ray-address 127.0.0.1:{port}: no Ray cluster answers")


def test_ray_is_refused_for_an_out_in_this_process_only(tmp_path: Path) -> None:
    """Ray tasks upload into OUT themselves: a memory:// OUT (this process's) is refused."""
    raw = write_class_folders(tmp_path / "raw", {"a": 2, "b": 1})
    options = {"shards": 1, "engine": "ray", "ray_address": "127.0.0.1:1", "progress": False}
    with pytest.raises(InputError) as caught:
        shardprep.build(str(raw), "memory://sp-seam/out", **options)
    assert str(caught.value) == (  # the keywords: this is shardprep.build, not the CLI
        "memory://sp-seam/out: engine='ray' cannot build into an OUT that lives in this "
        "process's memory (its tasks run in other processes, which upload into OUT themselves): "
        "use engine='local', or an object store or a folder as OUT"
    )
    # A folder (one every node shares) passes that check: the build goes on to the cluster.
    with pytest.raises(PlanError, match="^ray_address='127.0.0.1:1'|needs Ray"):
        shardprep.build(str(raw), str(tmp_path / "out"), **options)
    assert not (tmp_path / "out").exists()


def _listing_with_problems(root: Path) -> Path:
    rows = ["path,label,note"]
    for i in range(23):
        if i not in (4, 17):
            (root / f"{i:02d}.bin").write_bytes(b"x" * i)
        rows.append(f"{i:02d}.bin,{'' if i % 5 == 2 else 'c' + str(i % 3)},n{i}")
    (root / "l.csv").write_text("\n".join(rows) + "\n")
    return root / "l.csv"


@pytest.mark.parametrize("workers", [1, 2])
def test_a_listing_scanned_in_chunks_gives_the_same_inventory_and_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    path = _listing_with_problems(tmp_path)
    with pytest.raises(InputError) as whole:
        scan(str(path))
    (tmp_path / "04.bin").write_bytes(b"")
    (tmp_path / "17.bin").write_bytes(b"")
    with pytest.raises(InputError) as whole_unlabelled:
        scan(str(path))
    path.write_text(path.read_text().replace(",,", ",c9,"))
    reference = scan(str(path))
    path.write_text(path.read_text().replace(",c9,", ",,"))
    (tmp_path / "04.bin").unlink()
    (tmp_path / "17.bin").unlink()
    monkeypatch.setattr(listing, "CHUNK_ROWS", 3)  # 8 chunks, merged in order
    engine = LocalEngine(workers)
    with pytest.raises(InputError) as chunked:
        scan(str(path), ordered_map=engine.ordered_map)
    assert str(chunked.value) == str(whole.value)
    (tmp_path / "04.bin").write_bytes(b"")
    (tmp_path / "17.bin").write_bytes(b"")
    with pytest.raises(InputError) as chunked_unlabelled:
        scan(str(path), ordered_map=engine.ordered_map)
    assert str(chunked_unlabelled.value) == str(whole_unlabelled.value)
    path.write_text(path.read_text().replace(",,", ",c9,"))
    inventory = scan(str(path), ordered_map=engine.ordered_map)
    assert inventory.class_names == reference.class_names == ("c0", "c1", "c2", "c9")
    for column in ("stem_end", "label", "part_size", "meta_end"):
        assert np.array_equal(getattr(inventory, column), getattr(reference, column)), column
    assert inventory.stem_blob == reference.stem_blob
    assert inventory.meta_blob == reference.meta_blob


def test_ray_is_imported_only_by_a_ray_build() -> None:
    from tests.unit.test_layering import _imported_after

    modules = ("shardprep.cli", "shardprep.builder", "shardprep.engine.local")
    assert _imported_after((*modules, "shardprep.engine.ray_engine"), ("ray", "torch")) == []


def test_a_hung_local_writer_is_killed_after_the_stall_timeout(tmp_path: Path) -> None:
    """Worker processes: a write that never returns stops the build with the shard named."""
    raw = write_class_folders(tmp_path / "raw", {"a": 30, "b": 20})
    reference = tmp_path / "reference"
    shardprep.build(str(raw), str(reference), shards=4, workers=1, progress=False)
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "hold-2").touch()  # the test hook: shard 2's write waits for this file to go
    out = tmp_path / "out"
    started = time.monotonic()
    with (
        faults_in(faults),
        pytest.raises(StalledError, match=r"shard 2: no progress for 4 s") as caught,
    ):
        # (4 s, not less: on a loaded 2-core machine a worker that is not held can go 1.5 s
        # without progress, and the stall was then named on shard 0: a failed CI-like run)
        shardprep.build(str(raw), str(out), shards=4, workers=2, stall_timeout=4, progress=False)
    # Killed, not waited for: the hook would hold the worker for HOLD_LIMIT_S (120 s).
    assert time.monotonic() - started < HOLD_LIMIT_S / 2
    assert caught.value.shard_index == 2
    # 0, 1 and 3 finished first: a stall is 4 s in which no shard progressed
    assert sorted(p.name for p in out.glob("shard-*.tar")) == [
        "shard-00000.tar",
        "shard-00001.tar",
        "shard-00003.tar",
    ]
    assert str(caught.value) == (
        "shard 2: no progress for 4 s (the stall timeout), so its writers were stopped: a "
        "source or OUT may hang (a network filesystem or an object store that stopped "
        "answering). The 3 finished shard(s) are kept: fix the cause and call shardprep.build "
        "again with the same arguments and resume=True (or raise stall_timeout= for very slow "
        "storage)"
    )
    assert multiprocessing.active_children() == []  # the held worker was killed, not waited for
    assert (faults / "hold-2").exists()  # ... it never got past the hook
    assert not list(out.glob(".*.partial")) and not (out / "manifest.json").exists()
    (faults / "hold-2").unlink()
    shardprep.build(str(raw), str(out), shards=4, workers=2, resume=True, progress=False)
    assert _tree(out) == _tree(reference)


@pytest.mark.parametrize("workers", [1, 2])
def test_the_local_engine_writes_through_the_write_task_it_is_given(
    tmp_path: Path, workers: int
) -> None:
    """In this process (1 worker) and in worker processes: the test seam reaches every write."""
    raw = write_class_folders(tmp_path / "raw", {"a": 30, "b": 20})
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "deny-1").touch()  # every write of shard 1 fails with EACCES
    options = {"shards": 4, "workers": workers, "progress": False}
    with (
        faults_in(faults),
        pytest.raises(WriteError, match=r"^shard 1: .*injected lasting failure of shard 1") as err,
    ):
        shardprep.build(str(raw), str(tmp_path / "out"), **options)
    assert err.value.shard_index == 1
    attempts = [int(line) for line in (faults / "attempts").read_text().split()]
    assert attempts.count(1) == 1 and set(attempts) <= {0, 1, 2, 3}
    if workers == 1:
        assert attempts == [0, 1]  # in shard order, and none after the failure
    # Outside faults_in the production write task is back: the same build succeeds.
    shardprep.build(str(raw), str(tmp_path / "out"), overwrite=True, **options)
    assert (tmp_path / "out" / "manifest.json").exists()
    assert (faults / "deny-1").exists()


def test_a_stall_before_any_shard_finished_claims_none_is_kept(tmp_path: Path) -> None:
    """Was: "The finished shards are kept" when none were."""
    raw = write_class_folders(tmp_path / "raw", {"a": 30, "b": 20})
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "hold-0").touch()  # both shards' writes wait: none finishes
    (faults / "hold-1").touch()
    out = tmp_path / "out"
    with (
        faults_in(faults),
        pytest.raises(StalledError) as caught,
    ):
        shardprep.build(str(raw), str(out), shards=2, workers=2, stall_timeout=1.5, progress=False)
    assert str(caught.value).endswith(
        "(and 1 more shard(s) being written): no progress for 1.5 s (the stall timeout), so its "
        "writers were stopped: a source or OUT may hang (a network filesystem or an object store "
        "that stopped answering). No shard was finished: fix the cause and call shardprep.build "
        "again with the same arguments and resume=True (or raise stall_timeout= for very slow "
        "storage)"
    ), str(caught.value)
    assert not list(out.glob("shard-*"))
    (faults / "hold-0").unlink()
    (faults / "hold-1").unlink()
    shardprep.build(str(raw), str(out), shards=2, workers=2, resume=True, progress=False)
    assert (out / "manifest.json").exists()


def test_stall_timeout_must_be_positive(tmp_path: Path) -> None:
    """shardprep.build names the keyword (the CLI, --stall-timeout: click's own range check)."""
    with pytest.raises(PlanError, match="^stall_timeout= must be positive \\(got 0\\)$"):
        shardprep.build(str(tmp_path), str(tmp_path / "o"), shards=1, stall_timeout=0)


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _small_file_limit() -> None:  # in the child: files may not grow past 24 KiB
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (24 << 10, 24 << 10))


def test_a_full_scratch_disk_says_to_set_tmpdir(tmp_path: Path) -> None:
    """The scan's column files cannot grow (a real write limit): a clear error, no traceback."""
    raw = write_class_folders(tmp_path / "raw", {"a": 2500, "b": 1500})
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    result = run_bounded(
        [sys.executable, "-m", "shardprep", "build", str(raw), str(tmp_path / "out"), "-n", "2"]
        + ["-j", "1", "-q"],
        timeout=120,
        env={**os.environ, "TMPDIR": str(scratch)},
        preexec_fn=_small_file_limit,
    )
    assert result.returncode != 0
    assert "no room for the build's scratch files (File too large)" in result.stderr
    assert "set TMPDIR to a folder on a disk with room" in result.stderr
    assert "Traceback" not in result.stderr
    assert list(scratch.iterdir()) == []  # the scratch folder is removed on the way out
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_writer_that_died_says_how_many_shards_are_kept_and_how_to_resume(
    tmp_path: Path,
) -> None:
    """Was: "the finished shards are kept: ... run the same command with --resume" from the
    local engine, for shardprep.build too and when none was finished. The engine says how the
    writer died; the builder adds the count of shards in OUT and the resume as the caller
    gives it."""
    raw = write_class_folders(tmp_path / "raw", {"a": 30, "b": 20})
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "crash-0").touch()  # every write of shard 0 ends its worker process
    out = tmp_path / "out"
    options = {"shards": 2, "workers": 2, "progress": False}
    with faults_in(faults), pytest.raises(WorkersDiedError) as caught:
        shardprep.build(str(raw), str(out), **options)
    message = str(caught.value)
    kept = len(list(out.glob("shard-*.tar")))
    what = f"the {kept} finished shard(s) are kept" if kept else "no shard was finished"
    assert message.endswith(
        "the worker process writing it died without an answer (the kernel's out-of-memory "
        f"killer stopped it: see dmesg); {what}: fix the cause, then call shardprep.build "
        "again with the same arguments and resume=True"
    ), message
    (faults / "crash-0").unlink()
    shardprep.build(str(raw), str(out), resume=True, **options)  # what the message says
    assert (out / "manifest.json").exists()
