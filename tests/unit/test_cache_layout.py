"""Issue 23: which ``cache_dir`` the remote cache accepts, and the folder it makes and owns.

The cache is driven here through a local output (``Source`` of a folder: the cache code is the
same, fsspec's local filesystem serves the ranged reads); tests/remote/test_cache_faults.py
runs it against S3.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from loader import RemoteOptions
from loader.io.cache import ShardCache
from loader.io.cachedir import CACHE_FOLDER, MARKER, MARKER_TEXT, cache_bytes
from loader.io.source import Source


@pytest.mark.parametrize("empty", ["", "   "])
def test_an_empty_cache_dir_is_refused(
    empty: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"cache_dir={empty!r} is empty: give the folder"):
        RemoteOptions(cache_dir=empty)
    assert os.listdir(tmp_path) == []  # nothing made in the current folder


def test_a_file_as_cache_dir_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "train.py"
    path.write_bytes(b"print()\n")
    with pytest.raises(ValueError, match=rf"cache_dir='{path}' is a file, not a folder"):
        RemoteOptions(cache_dir=str(path))
    assert path.read_bytes() == b"print()\n"


def test_a_cache_folder_that_is_not_a_cache_is_refused(tmp_path: Path) -> None:
    home = tmp_path / CACHE_FOLDER
    home.mkdir()
    (home / "notes.txt").write_bytes(b"mine")
    with pytest.raises(ValueError, match=rf"{home}: holds files but is not a shardprep cache"):
        RemoteOptions(cache_dir=str(tmp_path))
    (home / MARKER).write_bytes(b"Signature: 8a477f597d28d172789f06886806bc55\n# backup tool\n")
    with pytest.raises(ValueError, match=rf"{home}: {MARKER} is not the one of a shardprep"):
        RemoteOptions(cache_dir=str(tmp_path))
    (home / MARKER).unlink()
    (home / "notes.txt").unlink()
    home.rmdir()
    home.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"{home}: a file is in the way"):
        RemoteOptions(cache_dir=str(tmp_path))


def test_options_touch_nothing_and_a_path_object_is_accepted(tmp_path: Path) -> None:
    where: Any = tmp_path / "new" / "cache"  # a Path, as users pass it
    options = RemoteOptions(cache_dir=where, cache_limit=1 << 30)
    assert str(options.cache_dir) == str(where)
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="must be a folder path"):
        RemoteOptions(cache_dir=b"/tmp")  # type: ignore[arg-type]


def test_the_cache_makes_its_own_marked_folder_and_counts_only_its_files(
    built: Path, tmp_path: Path
) -> None:
    user = tmp_path / "shard-00000.tar"  # the user's, named like a cached file
    user.write_bytes(b"x" * 1000)
    source = Source(str(built), RemoteOptions(cache_dir=str(tmp_path)))
    manifest = source.manifest()
    cache = ShardCache.for_output(source, manifest)
    assert cache is not None
    entry = manifest.shards[0]
    f = cache.open(entry)
    assert f is not None
    with f:
        assert f.read() == (built / entry.file).read_bytes()
    home = tmp_path / CACHE_FOLDER
    assert (home / MARKER).read_text() == MARKER_TEXT
    assert sorted(os.listdir(tmp_path)) == ["shard-00000.tar", CACHE_FOLDER]
    [folder] = [p for p in home.iterdir() if p.is_dir()]
    assert sorted(os.listdir(folder)) == [entry.file, entry.file + ".lock", entry.file + ".ok"]
    (folder / "extra.bin").write_bytes(b"y" * 5000)  # not the cache's: not counted
    assert cache_bytes(str(tmp_path)) == entry.num_bytes
    RemoteOptions(cache_dir=str(tmp_path))  # a cache folder of this layout is accepted
