"""Issue 23: the remote shard cache under faults, against a real S3 server (moto).

It must never delete a file it did not make (a project folder as ``cache_dir``), never keep a torn
download (a full disk: a real small tmpfs), fetch a cached file damaged on disk again, name both
files when the remote copy is bad too, and sweep the ``.part`` files of killed downloaders.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

import shardprep
from loader import ReadOptions, RemoteOptions, ShardDataset
from loader.io import source as source_module
from loader.io.cache import ShardCache
from loader.io.cachedir import CACHE_FOLDER, cache_bytes
from loader.io.source import Source
from shardprep.format.errors import ChecksumMismatchError
from tests.conftest import write_class_folders
from tests.filesystems import tmpfs
from tests.s3 import Proxy, S3Server

ROOT = Path(__file__).resolve().parents[2]
OLD = 978_307_200  # 2001-01-01: older than anything the cache makes (LRU would pick these first)


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_module, "BACKOFF_S", 0.01)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 samples of ~17 KB in 4 plain-tar shards of ~270 KB."""
    base = tmp_path_factory.mktemp("big")
    raw = write_class_folders(base / "raw", {"a": 40, "b": 24}, repeat=40)
    shardprep.build(str(raw), str(base / "out"), shards=4, workers=1, progress=False)
    return base / "out"


@pytest.fixture
def big_url(s3: S3Server, bucket: str, big: Path) -> str:
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
    fs.put(str(big), f"{bucket}/big", recursive=True)
    return f"s3://{bucket}/big"


def remote(s3: S3Server, proxy: Proxy, **kw: Any) -> ReadOptions:
    return ReadOptions(
        remote=RemoteOptions(storage_options=s3.storage_options(proxy.endpoint), **kw)
    )


def samples(ds: ShardDataset) -> list[tuple[str, bytes]]:
    return [(s["__key__"], s["bin"]) for s in ds]


def fetched(proxy: Proxy, since: int) -> list[str]:
    """Shard and index files GET'ed through ``proxy`` since request ``since``, in order."""
    lines = [r.split("?")[0] for r in proxy.requests[since:] if r.startswith("GET ")]
    names = [line.rsplit("/", 1)[-1] for line in lines]
    return [n for n in names if n.startswith("shard-")]


def output_folder(cache_dir: Path) -> Path:
    [folder] = [
        p for p in (cache_dir / CACHE_FOLDER).iterdir() if p.is_dir() and not p.is_symlink()
    ]
    return folder


def tree(root: Path, skip: str | None = None) -> dict[str, bytes]:
    """Every plain file under ``root`` (not through symlinks) -> its bytes."""
    out = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != skip]
        for name in names:
            path = Path(folder) / name
            if not path.is_symlink():
                out[str(path.relative_to(root))] = path.read_bytes()
    return out


def cache_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "cannot write" in str(w.message)]


# --- 1. a project folder as cache_dir ------------------------------------------------------


def test_a_project_folder_as_cache_dir_keeps_every_user_file(
    s3: S3Server,
    proxy: Proxy,
    big_url: str,
    big: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    project = tmp_path / "project"
    user = {
        "train.py": b"import loader\nprint('train')\n",
        "src/model.py": b"class Model: ...\n",
        ".git/HEAD": b"ref: refs/heads/main\n",
        "checkpoints/epoch-1.ckpt": os.urandom(300_000),
        "shard-00001.tar": b"the user's own tar, named like a cached shard",
        "data/shard-00000.tar": b"a local shard of another dataset",
        ".shard-00002.tar.1.0.part": b"named like a download, but the user's",
    }
    for name, data in user.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_bytes(data)
    for path in project.rglob("*"):
        os.utime(path, (OLD, OLD))  # the oldest files around: first in line for an LRU
    monkeypatch.chdir(project)
    shard_bytes = [p.stat().st_size for p in big.glob("shard-*")]
    limit = 3 * max(shard_bytes) // 2  # 4 shards of about that size: eviction in every epoch
    assert sum(shard_bytes) > 2 * limit
    read = remote(s3, proxy, cache_dir=".", cache_limit=limit)
    local = ShardDataset(str(big))
    for epoch in range(3):
        ds = ShardDataset(big_url, read=read)
        ds.set_epoch(epoch)
        local.set_epoch(epoch)
        before = len(proxy.requests)
        assert samples(ds) == samples(local)
        if epoch == 0:
            assert fetched(proxy, before).count("shard-00000.tar") == 1
            # things that look like the cache's inside its folder, planted by someone else:
            # a symlink named like a cached shard, a symlinked output folder, a foreign name
            folder = output_folder(project)
            (folder / "shard-00042.tar").symlink_to(project / "checkpoints" / "epoch-1.ckpt")
            (project / CACHE_FOLDER / "0123456789abcdef").symlink_to(project / "data")
            (folder / "notes.txt").write_bytes(b"mine")
            os.utime(folder / "notes.txt", (OLD, OLD))
        else:
            tars = [n for n in fetched(proxy, before) if n.endswith(".tar")]
            assert len(tars) >= 3  # the cache holds one shard at a time: evicted, fetched again
        assert cache_bytes(".") <= limit
    assert tree(project, skip=CACHE_FOLDER) == user  # byte-identical, none missing
    folder = output_folder(project)
    assert (folder / "notes.txt").read_bytes() == b"mine"
    assert (folder / "shard-00042.tar").is_symlink()
    assert (project / CACHE_FOLDER / "0123456789abcdef" / "shard-00000.tar").exists()


# --- 2. a full disk ----------------------------------------------------------------------------


@pytest.mark.parametrize("preallocate", [True, False], ids=["fallocate", "sparse"])
def test_a_full_disk_keeps_no_torn_file_and_warns_once(
    s3: S3Server,
    proxy: Proxy,
    big_url: str,
    big: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    preallocate: bool,
) -> None:
    """Sparse: the space is not reserved, so the disk fills in the middle of a download (short
    write, then ENOSPC); fallocate: the reservation itself fails."""
    monkeypatch.setattr(ShardCache, "preallocate", preallocate)
    shards = sorted(big.glob("shard-*.tar"))
    indexes = sum(p.stat().st_size for p in big.glob("shard-*.idx"))
    with tmpfs(tmp_path / "disk", "size=1m") as disk:
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        room = indexes + 64 * 1024 + min(p.stat().st_size for p in shards) // 2
        (disk / "filler").write_bytes(b"\1" * (free - room))
        cache = disk / "cache"
        read = remote(s3, proxy, cache_dir=str(cache), request_bytes=16 * 1024)
        local = ShardDataset(str(big))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for epoch in range(2):
                ds = ShardDataset(big_url, read=read)
                ds.set_epoch(epoch)
                local.set_epoch(epoch)
                assert samples(ds) == samples(local)
        [message] = cache_warnings(caught)  # one, for every failed download of both epochs
        assert str(cache / CACHE_FOLDER) in message
        assert "No space left on device" in message
        folder = output_folder(cache)
        kept = {p.name: p.read_bytes() for p in folder.iterdir() if p.name.startswith("shard-")}
        cached = {n for n in kept if n.endswith((".tar", ".idx"))}
        assert {f"{p.name}" for p in shards} - cached  # some shard did not fit
        for name in cached:  # whatever is under a final name is complete and right
            assert kept[name] == (big / name).read_bytes(), name
        assert [p.name for p in folder.iterdir() if p.name.endswith(".part")] == []


# --- 3. a cached file damaged on disk ----------------------------------------------------------


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_cached_file_damaged_on_disk_is_fetched_again(
    s3: S3Server, proxy: Proxy, big_url: str, big: Path, tmp_path: Path
) -> None:
    read = remote(s3, proxy, cache_dir=str(tmp_path))
    expected = samples(ShardDataset(str(big)))
    assert samples(ShardDataset(big_url, read=read)) == expected
    cached = output_folder(tmp_path) / "shard-00001.tar"
    flip(cached, 5000)  # inside a member's payload: same size, other bytes
    before = len(proxy.requests)
    assert samples(ShardDataset(big_url, read=read)) == expected
    assert fetched(proxy, before) == ["shard-00001.tar"]  # that file only, once
    assert cached.read_bytes() == (big / "shard-00001.tar").read_bytes()
    before = len(proxy.requests)
    assert samples(ShardDataset(big_url, read=read)) == expected
    assert fetched(proxy, before) == []  # trusted again


def test_a_damaged_cached_file_and_a_damaged_remote_raise_naming_both(
    s3: S3Server, proxy: Proxy, big_url: str, big: Path, tmp_path: Path
) -> None:
    import fsspec

    read = remote(s3, proxy, cache_dir=str(tmp_path))
    assert samples(ShardDataset(big_url, read=read)) == samples(ShardDataset(str(big)))
    cached = output_folder(tmp_path) / "shard-00002.tar"
    flip(cached, 7000)
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
    key = f"{big_url[len('s3://') :]}/shard-00002.tar"
    data = bytearray(fs.cat(key))
    data[9000] ^= 0xFF
    fs.pipe(key, bytes(data))
    with pytest.raises(ChecksumMismatchError) as caught:
        samples(ShardDataset(big_url, read=read))
    message = str(caught.value)
    assert message.startswith(f"{cached}: the cached copy of {big_url}/shard-00002.tar was damaged")
    assert f"fetching it again failed too: {big_url}/shard-00002.tar: sha256" in message
    assert caught.value.path == f"{big_url}/shard-00002.tar"
    assert not cached.exists() and not list(cached.parent.glob("*.part"))


# --- 4. stale downloads ------------------------------------------------------------------------

DOWNLOADER = """
import json, sys
from loader.io.cache import ShardCache
from loader.io.options import RemoteOptions
from loader.io.source import Source
url, options, cache_dir = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
source = Source(url, RemoteOptions(storage_options=options, cache_dir=cache_dir))
manifest = source.manifest()
cache = ShardCache.for_output(source, manifest)
cache.open(manifest.shards[0])  # killed during this download
"""


def test_downloads_of_killed_processes_are_swept_when_the_cache_opens(
    s3: S3Server, big_url: str, big: Path, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    with Proxy(s3.port, bandwidth=20_000) as slow:  # ~270 KB: about 14 s to download
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                DOWNLOADER,
                big_url,
                json.dumps(s3.storage_options(slow.endpoint)),
                str(cache_dir),
            ],
            cwd=ROOT,
            start_new_session=True,
            stderr=subprocess.PIPE,
        )
        assert child.stderr is not None
        try:
            deadline = time.monotonic() + 60
            parts: list[Path] = []
            while not parts and child.poll() is None and time.monotonic() < deadline:
                parts = list(cache_dir.glob(f"{CACHE_FOLDER}/*/.shard-00000.tar.*.part"))
                time.sleep(0.05)  # polling for the file the child makes, bounded by the deadline
            assert parts, child.stderr.read().decode() if child.poll() is not None else "timeout"
        finally:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(30)
            child.stderr.close()
    [dead] = parts
    folder = dead.parent
    live = folder / f".shard-00003.tar.{os.getpid()}.99.part"  # a download in progress (ours)
    foreign = [folder / ".notes.part", folder / "x.part"]
    for path in foreign:
        path.write_bytes(b"not the cache's")
    with open(live, "w+b") as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX)
        source = Source(
            big_url, RemoteOptions(storage_options=s3.storage_options(), cache_dir=str(cache_dir))
        )
        assert dead.exists() and ShardCache.for_output(source, source.manifest()) is not None
        assert not dead.exists()  # swept: no cache_limit, nothing had to be evicted
        assert live.exists()  # its writer holds its lock
    assert all(p.read_bytes() == b"not the cache's" for p in foreign)
