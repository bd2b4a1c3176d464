"""Attacks on the remote cache's folder (issue 23 follow-up): a symlink planted where the cache
keeps an output's files must never let it delete, replace or create files in the link's target.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loader import ReadOptions, RemoteOptions, ShardDataset
from loader.io.cache import ShardCache
from loader.io.cachedir import CACHE_FOLDER
from loader.io.source import Source
from tests.s3 import S3Server

USER = {
    "shard-00000.tar": b"the user's own tar, named like a cached shard",
    "shard-00000.idx": b"the user's own index",
    "notes.txt": b"mine",
}


@pytest.fixture
def url(s3: S3Server, bucket: str, built: Path) -> str:
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
    fs.put(str(built), f"{bucket}/out", recursive=True)
    return f"s3://{bucket}/out"


def victim_folder(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir()
    for name, data in USER.items():
        (victim / name).write_bytes(data)
    return victim


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_symlinked_output_folder_is_refused_and_its_target_untouched(
    s3: S3Server, url: str, tmp_path: Path
) -> None:
    options = RemoteOptions(storage_options=s3.storage_options(), cache_dir=str(tmp_path / "c"))
    source = Source(url, options)
    cache = ShardCache(source, source.manifest(), options.cache_dir or "", None)
    victim = victim_folder(tmp_path)
    (tmp_path / "c" / CACHE_FOLDER).mkdir(parents=True)
    os.symlink(victim, cache.folder)  # the very folder this output's files would go to
    ds = ShardDataset(url, read=ReadOptions(remote=options))
    with pytest.raises(ValueError) as caught:
        list(ds)
    assert str(caught.value).startswith(f"{cache.folder}: a symlink where the cache keeps")
    assert contents(victim) == USER  # before the fix: both shard files replaced, locks and
    # stamps written beside them


def test_an_output_folder_swapped_for_a_symlink_after_open_is_refused(
    s3: S3Server, url: str, tmp_path: Path
) -> None:
    options = RemoteOptions(storage_options=s3.storage_options(), cache_dir=str(tmp_path / "c"))
    source = Source(url, options)
    manifest = source.manifest()
    cache = ShardCache.for_output(source, manifest)
    assert cache is not None
    entry = manifest.shards[0]
    with cache.open(entry) as f:  # type: ignore[union-attr]
        assert len(f.read()) == entry.num_bytes
    victim = victim_folder(tmp_path)
    os.rename(cache.folder, tmp_path / "moved")
    os.symlink(victim, cache.folder)
    with pytest.raises(ValueError, match="a symlink where the cache keeps"):
        cache.open(entry)
    assert contents(victim) == USER


def test_a_hard_link_under_a_stamp_name_keeps_its_file(
    s3: S3Server, url: str, tmp_path: Path
) -> None:
    """The stamp is a new file: a hard link planted under its name is replaced, not truncated."""
    options = RemoteOptions(storage_options=s3.storage_options(), cache_dir=str(tmp_path / "c"))
    source = Source(url, options)
    manifest = source.manifest()
    cache = ShardCache.for_output(source, manifest)
    assert cache is not None
    os.makedirs(cache.folder, exist_ok=True)
    victim = victim_folder(tmp_path)
    entry = manifest.shards[0]
    os.link(victim / "notes.txt", os.path.join(cache.folder, entry.file + ".ok"))
    with cache.open(entry) as f:  # type: ignore[union-attr]
        assert len(f.read()) == entry.num_bytes
    assert contents(victim) == USER
    assert (victim / "notes.txt").stat().st_nlink == 1  # the cache's stamp is its own file now


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another user needs root")
@pytest.mark.parametrize("which", ["cache folder", "output folder"])
def test_a_cache_folder_of_another_user_is_refused(
    s3: S3Server, url: str, tmp_path: Path, which: str
) -> None:
    options = RemoteOptions(storage_options=s3.storage_options(), cache_dir=str(tmp_path / "c"))
    source = Source(url, options)
    cache = ShardCache(source, source.manifest(), options.cache_dir or "", None)
    os.makedirs(cache.folder)
    foreign = tmp_path / "c" / CACHE_FOLDER if which == "cache folder" else Path(cache.folder)
    os.chown(foreign, 12345, 12345)
    with pytest.raises(ValueError) as caught:
        list(ShardDataset(url, read=ReadOptions(remote=options)))
    assert str(caught.value) == (
        f"{foreign}: owned by another user (uid 12345), who could change what the cache reads "
        "and deletes there; choose a cache_dir of your own"
    )
