"""Issue 10 item 1: ``shardprep build RAW s3://bucket/prefix`` against a real S3 server (moto).

Every remote build is compared object by object, byte for byte, with a local build of the
same input and options.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest

import shardprep
import shardprep.destination as destination
from shardprep.format.errors import InputError, OutputError
from shardprep.format.manifest import JOURNAL_NAME
from shardprep.remote_input import RemoteParts, remote_sizes
from tests.conftest import payload, write_class_folders
from tests.processes import run_bounded
from tests.s3 import Proxy, S3Server, free_port

COUNTS = {"a": 60, "b": 30, "c": 13}  # 103 samples


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_class_folders(tmp_path_factory.mktemp("s3build") / "raw", COUNTS, repeat=40)


def _filesystem(s3: S3Server, endpoint: str | None = None) -> Any:
    return fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options(endpoint))


def _objects(fs: Any, prefix: str) -> dict[str, bytes]:
    """Name → bytes of every object directly under ``prefix``."""
    fs.invalidate_cache()
    try:
        paths = fs.ls(prefix, detail=False)
    except FileNotFoundError:
        return {}
    return {p.rsplit("/", 1)[-1]: fs.cat_file(p) for p in paths}


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _local(raw: Path, tmp_path: Path, **options: Any) -> dict[str, bytes]:
    out = tmp_path / "local"
    shardprep.build(str(raw), str(out), progress=False, **options)
    return _files(out)


def _cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Any:
    return run_bounded(
        [sys.executable, "-m", "shardprep", "build", *args],
        timeout=120,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_build_into_s3_is_byte_identical_to_local(
    raw: Path,
    s3: S3Server,
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    compression: str,
) -> None:
    options: dict[str, Any] = {"shards": 6, "workers": 2, "compression": compression}
    staged: list[int] = []  # shard files in the staging folder whenever an upload starts
    upload = destination.RemoteDestination._upload

    def counting(self: destination.RemoteDestination, record: Any) -> None:
        staged.append(sum(".tar" in n for n in os.listdir(self.staging)))
        upload(self, record)

    monkeypatch.setattr(destination.RemoteDestination, "_upload", counting)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where the staging folder goes
    summary = shardprep.build(
        str(raw),
        f"s3://{bucket}/out",
        progress=False,
        storage_options=s3.storage_options(),
        **options,
    )
    assert summary.out == f"s3://{bucket}/out"
    assert summary.num_shards == 6
    assert summary.num_samples == sum(COUNTS.values())
    remote = _objects(_filesystem(s3), f"{bucket}/out")
    assert JOURNAL_NAME not in remote
    assert remote == _local(raw, tmp_path, **options)  # same names, same bytes
    assert len(staged) == 6
    assert max(staged) <= 2 + destination.UPLOAD_THREADS  # workers + upload threads
    assert [p.name for p in tmp_path.iterdir()] == ["local"]  # the staging folder is gone


def test_cli_with_storage_options_then_environment(
    raw: Path, s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    """--storage-option reaches the server; so do the AWS_* variables botocore reads; a
    non-empty prefix is refused as a non-empty folder is; and no local folder named 's3:'."""
    url = f"s3://{bucket}/out"
    endpoint = json.dumps({"endpoint_url": s3.endpoint})
    options = ["-n", "4", "-j", "1", "-q"]
    result = _cli(
        str(raw),
        url,
        *options,
        "--storage-option",
        "key=testing",
        "--storage-option",
        "secret=testing",
        "--storage-option",
        f"client_kwargs={endpoint}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert os.listdir(tmp_path) == []  # the old bug wrote ./s3:/bucket/out
    fs = _filesystem(s3)
    first = _objects(fs, f"{bucket}/out")
    assert first == _local(raw, tmp_path, shards=4)

    env = s3.environment()  # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...
    again = _cli(str(raw), url, *options, env=env, cwd=tmp_path)
    assert again.returncode == 1
    assert again.stderr.strip().splitlines()[-1] == (
        f"Error: {url}: the output prefix is not empty (9 entries, e.g. 'manifest.json'); "
        "pass --overwrite to replace a previous build, --resume to finish an interrupted one, "
        "or choose an empty prefix"
    )
    done = _cli(str(raw), url, *options, "--resume", env=env)  # a pipeline's step may always
    assert done.returncode == 0, done.stderr  # pass --resume: a finished build is no error
    assert done.stderr.strip() == f"{url}: the build is already complete; nothing to resume"
    assert _objects(fs, f"{bucket}/out") == first
    other = _cli(str(raw), url, *options, "--resume", "--seed", "1", env=env)
    assert other.returncode == 1
    assert other.stderr.strip() == (
        f"Error: {url}: already holds a complete build, of other input or options, so there "
        "is nothing to resume: pass --overwrite instead to rebuild it from this input"
    )
    replaced = _cli(str(raw), url, *options, "--overwrite", "--seed", "1", env=env)
    assert replaced.returncode == 0, replaced.stderr
    assert _objects(fs, f"{bucket}/out") == _local(raw, tmp_path / "seed1", shards=4, seed=1)


def test_overwrite_keeps_foreign_objects(
    raw: Path, s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    fs = _filesystem(s3)
    url, options = f"s3://{bucket}/out", s3.storage_options()
    fs.pipe_file(f"{bucket}/out/notes.txt", b"mine")
    with pytest.raises(InputError, match="the output prefix is not empty"):
        shardprep.build(str(raw), url, shards=5, progress=False, storage_options=options)
    shardprep.build(
        str(raw), url, shards=8, overwrite=True, progress=False, storage_options=options
    )
    shardprep.build(
        str(raw), url, shards=5, overwrite=True, progress=False, storage_options=options
    )
    remote = _objects(fs, f"{bucket}/out")
    assert remote.pop("notes.txt") == b"mine"  # not this build's: left alone
    assert remote == _local(raw, tmp_path, shards=5)  # shards 5-7 of the 8-shard build are gone
    with pytest.raises(InputError, match="exists and is an object, not a prefix"):
        shardprep.build(
            str(raw), f"{url}/notes.txt", shards=5, progress=False, storage_options=options
        )


def test_missing_bucket_unreachable_and_silent_endpoints(
    raw: Path, s3: S3Server, tmp_path: Path
) -> None:
    options = s3.storage_options()
    with pytest.raises(OutputError) as info:
        shardprep.build(str(raw), "s3://no-such-bucket/out", shards=2, storage_options=options)
    assert str(info.value).startswith(
        "s3://no-such-bucket/out: the bucket 'no-such-bucket' does not exist"
    )
    assert str(info.value).endswith("create it or fix the URL")

    refused = {**options, "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"}}
    started = time.monotonic()
    with pytest.raises(OutputError, match=r"^s3://b-x/out: cannot reach the storage \("):
        shardprep.build(str(raw), "s3://b-x/out", shards=2, storage_options=refused)
    assert time.monotonic() - started < 20

    # a server that accepts connections and never answers: the first contact's deadline (in a
    # child process: the request it gives up on runs on there for minutes)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        mute = {
            **options,
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{silent.getsockname()[1]}"},
        }
        code = (
            "import sys, json, shardprep, shardprep.destination as d\n"
            "d.CONTACT_TIMEOUT_S = 2.0\n"
            "try:\n"
            "    shardprep.build(sys.argv[1], 's3://b-x/out', shards=2, storage_options=json.loads(sys.argv[2]))\n"
            "except shardprep.ShardprepError as err:\n"
            "    print(err)\n"
        )
        started = time.monotonic()
        result = run_bounded([sys.executable, "-c", code, str(raw), json.dumps(mute)], timeout=60)
        assert time.monotonic() - started < 30
    assert result.stdout.startswith("s3://b-x/out: no answer from the storage within 2 s;"), result
    assert list(tmp_path.iterdir()) == []


def test_unknown_protocol_and_missing_backend(raw: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(OutputError, match=r"^nosuch://b/out: unknown protocol 'nosuch'"):
        shardprep.build(str(raw), "nosuch://b/out", shards=2)
    registry = importlib.import_module("fsspec.registry")  # the module, not fsspec.registry
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if s3fs were not installed
    monkeypatch.delitem(registry._registry, "s3", raising=False)
    with pytest.raises(OutputError) as info:
        shardprep.build(str(raw), "s3://b/out", shards=2)
    assert (
        str(info.value)
        == 's3://b/out: the s3:// backend is not installed: pip install "shardprep[s3]"'
    )


# A build whose uploads crawl (the proxy delays every 64 KiB the client sends), run as the
# CLI in its own session: SIGKILL takes the whole process group, SIGINT reaches every process
# of it as a terminal's Ctrl-C does.
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_stopped_mid_upload_then_resume(tmp_path: Path, sig: signal.Signals) -> None:
    # A server of its own: the killed client's requests may still be arriving at it.
    with S3Server() as s3, Proxy(s3.port) as proxy:
        s3.create_bucket("own")
        _stop_mid_upload_then_resume(s3, "own", proxy, tmp_path, sig)


def _stop_mid_upload_then_resume(
    s3: S3Server, bucket: str, proxy: Proxy, tmp_path: Path, sig: signal.Signals
) -> None:
    raw = write_class_folders(tmp_path / "raw", {"a": 40, "b": 24}, repeat=600)  # ~16 MB
    url, shards = f"s3://{bucket}/out", 8
    proxy.latency = 0.03  # ≈ 2 MB/s per connection for uploads
    command = [sys.executable, "-m", "shardprep", "build", str(raw), url, "-n", str(shards)]
    process = subprocess.Popen(
        [*command, "-j", "2", "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # TMPDIR: a killed build leaves its scratch folder, here in the test's tmp
        env={**os.environ, **s3.environment(proxy.endpoint), "TMPDIR": str(tmp_path)},
        start_new_session=True,
        # Ctrl-C as in a terminal, even when pytest itself started with SIGINT ignored (a
        # background job of a non-interactive shell does, and the child would inherit it)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    fs = _filesystem(s3)
    try:
        deadline = time.monotonic() + 60
        while not any(n.endswith(".tar") for n in _objects_names(fs, f"{bucket}/out")):
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "no shard was uploaded in time"
            time.sleep(0.02)  # polling interval only
        os.killpg(process.pid, sig)
        _, stderr = process.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    if sig == signal.SIGINT:
        assert process.returncode == 130, stderr
        assert stderr.strip().splitlines()[-1] == (
            f"interrupted; the shards whose upload had finished are kept in {url}: run the "
            "same command with --resume to finish the build"  # (uploads stop with the build)
        )
    names = set(_objects_names(fs, f"{bucket}/out"))
    assert "manifest.json" not in names  # a reader never sees a manifest of an unfinished build
    assert JOURNAL_NAME in names
    tars = {n for n in names if n.endswith(".tar")}
    assert 1 <= len(tars) < shards
    assert all(n.replace(".tar", ".idx") in names for n in tars)  # index uploaded first

    result = run_bounded(
        [*command, "-j", "2", "--resume", "--json"],
        timeout=120,
        env={**os.environ, **s3.environment()},
    )
    assert result.returncode == 0, result.stderr
    # shards whose body the proxy had received when the client died may complete after it
    assert len(tars) <= json.loads(result.stdout)["reused_shards"] < shards
    assert _objects(fs, f"{bucket}/out") == _local(raw, tmp_path, shards=shards)


def _objects_names(fs: Any, prefix: str) -> list[str]:
    fs.invalidate_cache()
    try:
        return [p.rsplit("/", 1)[-1] for p in fs.ls(prefix, detail=False)]
    except FileNotFoundError:
        return []


def test_cut_connections_during_upload_are_retried(
    raw: Path, s3: S3Server, bucket: str, proxy: Proxy, tmp_path: Path
) -> None:
    proxy.cut_next(3, after=0)  # three answers cut before their first byte
    shardprep.build(
        str(raw),
        f"s3://{bucket}/out",
        shards=4,
        workers=1,
        progress=False,
        storage_options=s3.storage_options(proxy.endpoint),
    )
    assert proxy.cuts == 3
    assert _objects(_filesystem(s3), f"{bucket}/out") == _local(raw, tmp_path, shards=4)


def _listing_of_urls(tmp_path: Path, fs: Any, bucket: str) -> tuple[Path, Path]:
    """Upload samples to s3://bucket/data/..., and write two listings of them: one by URL,
    one by local path to a copy laid out as bucket/data/... beside it (the same keys)."""
    rows, local_rows = [], []
    mirror = tmp_path / "mirror"
    for i in range(45):
        label = "ab"[i % 2]
        key = f"data/{label}/{i:04d}.bin"
        body = payload(i % 2, i) * 30
        fs.pipe_file(f"{bucket}/{key}", body)
        (mirror / bucket / key).parent.mkdir(parents=True, exist_ok=True)
        (mirror / bucket / key).write_bytes(body)
        rows.append(f"s3://{bucket}/{key},{label},{i}")
        local_rows.append(f"{bucket}/{key},{label},{i}")
    listing = tmp_path / "urls.csv"
    listing.write_text("path,label,n\n" + "\n".join(rows) + "\n")
    local = mirror / "local.csv"
    local.write_text("path,label,n\n" + "\n".join(local_rows) + "\n")
    return listing, local


def test_listing_of_s3_urls(s3: S3Server, bucket: str, tmp_path: Path) -> None:
    fs = _filesystem(s3)
    listing, local_listing = _listing_of_urls(tmp_path, fs, bucket)
    out = tmp_path / "out"
    summary = shardprep.build(
        str(listing),
        str(out),
        shards=3,
        workers=2,
        progress=False,
        storage_options=s3.storage_options(),
    )
    assert summary.num_samples == 45
    reference = tmp_path / "reference"
    shardprep.build(str(local_listing), str(reference), shards=3, workers=1, progress=False)
    assert _files(out) == _files(reference)

    fs.rm_file(f"{bucket}/data/b/0003.bin")
    with pytest.raises(InputError) as info:
        shardprep.build(
            str(listing),
            str(tmp_path / "x"),
            shards=3,
            progress=False,
            storage_options=s3.storage_options(),
        )
    assert f"{listing}:5: cannot stat s3://{bucket}/data/b/0003.bin: not found" in str(info.value)


def test_listed_objects_read_through_a_cutting_proxy(
    s3: S3Server, bucket: str, proxy: Proxy
) -> None:
    """Bodies cut mid-transfer while a writer fetches listed objects are retried (s3fs)."""
    fs = _filesystem(s3)
    urls, bodies = [], []
    for i in range(45):
        bodies.append(payload(i % 2, i) * 60)
        fs.pipe_file(f"{bucket}/data/{i}.bin", bodies[-1])
        urls.append(f"s3://{bucket}/data/{i}.bin")
    options = s3.storage_options(proxy.endpoint)
    sizes = remote_sizes(urls, options)
    assert sizes == [len(b) for b in bodies]
    proxy.cut_next(2, after=3000)
    parts = RemoteParts(list(zip(urls, [len(b) for b in bodies], strict=True)), options)
    try:
        assert [parts.read(u, len(b)) for u, b in zip(urls, bodies, strict=True)] == bodies
    finally:
        parts.close()
    assert proxy.cuts == 2
