"""Issue 37 items 4-6 on object storage: ``--append`` into ``s3://`` (a real moto server).

An append into a URL OUT writes the same objects, byte for byte, as into a folder; it resumes
after kill -9; and its journal is OUT's lock: a conditional put (``If-None-Match: *``), so two
appends (real processes) never both publish, whichever way they race.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import pytest

import shardprep
import shardprep.append
from shardprep.format.errors import InputError
from shardprep.format.manifest import JOURNAL_NAME
from shardprep.format.versions import version_file
from tests.integration.test_append import BASE, NEW, make_raw
from tests.processes import run_bounded
from tests.s3 import S3Server
from tests.stalled_build import kill_stalled_build

ROOT = Path(__file__).resolve().parents[2]


def _fs(s3: S3Server) -> Any:
    return fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())


def _objects(fs: Any, prefix: str) -> dict[str, bytes]:
    """Path under ``prefix`` → bytes of every object below it (versions/ included)."""
    fs.invalidate_cache()
    return {p[len(prefix) + 1 :]: fs.cat_file(p) for p in sorted(fs.find(prefix))}


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.fixture
def raws(tmp_path: Path) -> tuple[Path, Path]:
    return make_raw(tmp_path / "base", BASE, 0), make_raw(tmp_path / "new", NEW, 1000)


def _base_build(s3: S3Server, raw: Path, url: str) -> None:
    shardprep.build(
        str(raw), url, shards=4, workers=1, progress=False, storage_options=s3.storage_options()
    )


def _local_reference(raws: tuple[Path, Path], tmp_path: Path) -> dict[str, bytes]:
    out = tmp_path / "local"
    shardprep.build(str(raws[0]), str(out), shards=4, workers=1, progress=False)
    shardprep.build(str(raws[1]), str(out), shards=3, append=True, workers=2, progress=False)
    return _files(out)


def test_append_into_s3_is_the_local_append(
    s3: S3Server, bucket: str, raws: tuple[Path, Path], tmp_path: Path
) -> None:
    url = f"s3://{bucket}/out"
    _base_build(s3, raws[0], url)
    fs = _fs(s3)
    version1 = fs.cat_file(f"{bucket}/out/manifest.json")
    summary = shardprep.build(
        str(raws[1]), url, shards=3, append=True, workers=2, progress=False,
        storage_options=s3.storage_options(),
    )  # fmt: skip
    assert (summary.version, summary.first_shard, summary.num_shards) == (2, 4, 3)
    objects = _objects(fs, f"{bucket}/out")
    assert objects == _local_reference(raws, tmp_path)
    assert objects[version_file(1)] == version1
    assert objects[version_file(2)] == objects["manifest.json"]
    with pytest.raises(InputError, match="is already in s3://"):
        shardprep.build(
            str(raws[1]), url, shards=3, append=True, progress=False,
            storage_options=s3.storage_options(),
        )  # fmt: skip
    assert _objects(fs, f"{bucket}/out") == objects


def test_s3_append_killed_then_resumed(
    s3: S3Server, bucket: str, raws: tuple[Path, Path], tmp_path: Path
) -> None:
    url = f"s3://{bucket}/out"
    _base_build(s3, raws[0], url)
    fs = _fs(s3)
    version1 = fs.cat_file(f"{bucket}/out/manifest.json")

    def stuck() -> bool:
        fs.invalidate_cache()
        return bool(fs.exists(f"{bucket}/out/shard-00004.tar"))

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    options = {"shards": 3, "append": True, "workers": 1}
    kill_stalled_build(raws[1], url, 8, options, stuck, tmp, s3.environment())
    fs.invalidate_cache()
    assert fs.cat_file(f"{bucket}/out/manifest.json") == version1
    assert fs.exists(f"{bucket}/out/{JOURNAL_NAME}")
    summary = shardprep.build(
        str(raws[1]), url, shards=3, append=True, resume=True, progress=False,
        storage_options=s3.storage_options(),
    )  # fmt: skip
    assert (summary.version, summary.reused_shards) == (2, 1)
    assert _objects(fs, f"{bucket}/out") == _local_reference(raws, tmp_path)


def _cli_append(s3: S3Server, raw: Path, url: str, *more: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "shardprep", "build", str(raw), url, "-n", "2", "--append"]
    return run_bounded(
        [*command, "-q", *more], timeout=120, cwd=ROOT, env={**os.environ, **s3.environment()}
    )


def test_s3_append_while_another_holds_the_journal(
    s3: S3Server,
    bucket: str,
    raws: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Append B (this process) read version 1; append A (a real process) then puts its journal
    and writes (killed mid-append, so its journal stays). B is refused at its own journal's
    conditional put and writes nothing; a third append (a real process) is refused at once;
    A resumed then publishes alone."""
    url = f"s3://{bucket}/out"
    _base_build(s3, raws[0], url)
    fs = _fs(s3)
    other = make_raw(tmp_path / "other", {"cat": 4}, 5000)
    held: dict[str, bytes] = {}
    seen: list[subprocess.CompletedProcess[str]] = []
    check = shardprep.append.check_new_keys
    tmp = tmp_path / "tmp"
    tmp.mkdir()

    def stuck() -> bool:
        fs.invalidate_cache()
        return bool(fs.exists(f"{bucket}/out/shard-00004.tar"))

    def racing(*args: Any, **kwargs: Any) -> None:
        check(*args, **kwargs)
        options = {"shards": 3, "append": True, "workers": 1}
        kill_stalled_build(raws[1], url, 8, options, stuck, tmp, s3.environment())
        held.update(_objects(fs, f"{bucket}/out"))
        seen.append(_cli_append(s3, other, url))

    monkeypatch.setattr("shardprep.builder.check_new_keys", racing)
    with pytest.raises(InputError, match="another build or append is writing into"):
        shardprep.build(
            str(other), url, shards=2, append=True, progress=False,
            storage_options=s3.storage_options(),
        )  # fmt: skip
    assert JOURNAL_NAME in held and "shard-00004.tar" in held
    assert _objects(fs, f"{bucket}/out") == held  # B wrote nothing, A's journal kept
    (third,) = seen
    assert third.returncode == 1 and "is in progress, or was interrupted" in third.stderr
    monkeypatch.undo()
    shardprep.build(
        str(raws[1]), url, shards=3, append=True, resume=True, progress=False,
        storage_options=s3.storage_options(),
    )  # fmt: skip
    assert _objects(fs, f"{bucket}/out") == _local_reference(raws, tmp_path)


def test_s3_append_whose_base_was_published_meanwhile(
    s3: S3Server,
    bucket: str,
    raws: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Append B (this process) read version 1; append A (a real process) publishes version 2
    before B puts its journal: B is refused once it holds the journal, lets go of it, and
    OUT stays exactly what A published."""
    url = f"s3://{bucket}/out"
    _base_build(s3, raws[0], url)
    fs = _fs(s3)
    other = make_raw(tmp_path / "other", {"cat": 4}, 5000)
    published: dict[str, bytes] = {}
    check = shardprep.append.check_new_keys

    def racing(*args: Any, **kwargs: Any) -> None:
        check(*args, **kwargs)
        result = _cli_append(s3, other, url)
        assert result.returncode == 0, result.stderr
        published.update(_objects(fs, f"{bucket}/out"))

    monkeypatch.setattr("shardprep.builder.check_new_keys", racing)
    with pytest.raises(InputError, match="another build or append published into OUT"):
        shardprep.build(
            str(raws[1]), url, shards=3, append=True, progress=False,
            storage_options=s3.storage_options(),
        )  # fmt: skip
    assert version_file(2) in published and JOURNAL_NAME not in published
    assert _objects(fs, f"{bucket}/out") == published


def test_s3_overwrite_of_a_versioned_build_removes_its_versions(
    s3: S3Server, bucket: str, raws: tuple[Path, Path], tmp_path: Path
) -> None:
    url = f"s3://{bucket}/out"
    _base_build(s3, raws[0], url)
    options: dict[str, Any] = {"storage_options": s3.storage_options(), "progress": False}
    shardprep.build(str(raws[1]), url, shards=3, append=True, **options)
    shardprep.build(str(raws[1]), url, shards=2, overwrite=True, **options)
    reference = tmp_path / "reference"
    shardprep.build(str(raws[1]), str(reference), shards=2, progress=False)
    assert _objects(_fs(s3), f"{bucket}/out") == _files(reference)


def test_loader_reads_a_version_from_s3(
    s3: S3Server, bucket: str, raws: tuple[Path, Path], tmp_path: Path
) -> None:
    """ShardDataset(s3://..., version=1) reads the immutable versions/ object, sample for
    sample what a plain local build of BASE gives; a changed version object is refused."""
    from loader import ReadOptions, RemoteOptions, ShardDataset
    from shardprep.format.errors import ManifestError

    url = f"s3://{bucket}/out"
    _base_build(s3, raws[0], url)
    options: dict[str, Any] = {"storage_options": s3.storage_options(), "progress": False}
    shardprep.build(str(raws[1]), url, shards=3, append=True, **options)
    plain = tmp_path / "plain"
    shardprep.build(str(raws[0]), str(plain), shards=4, workers=1, progress=False)
    read = ReadOptions(remote=RemoteOptions(storage_options=s3.storage_options()))
    one: dict[str, Any] = {"rank": 0, "world_size": 1, "seed": 5}
    keys = [s["__key__"] for s in ShardDataset(str(plain), **one)]
    assert [s["__key__"] for s in ShardDataset(url, version=1, read=read, **one)] == keys
    assert len(list(ShardDataset(url, read=read, **one))) == 81
    fs = _fs(s3)
    path = f"{bucket}/out/{version_file(1)}"
    fs.pipe_file(path, fs.cat_file(path).replace(b'"seed": 0', b'"seed": 7'))
    with pytest.raises(ManifestError, match="not the manifest of version 1 that version 2"):
        ShardDataset(url, version=1, read=read, **one)
