"""Issue 19 item 1: RAW as an S3 URL prefix (class folders, keyed files, tar shards), against
a real S3 server (moto).

Every build from a prefix is compared file by file, byte for byte (manifest.json included:
the manifest records no input location), with a build of a local copy of the same files.
The scan's requests are counted at a proxy: listings only, never a request per object.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest

import shardprep
from shardprep.format.errors import InputError
from shardprep.scan import InputFormat, scan
from tests.conftest import payload, write_class_folders
from tests.processes import run_bounded
from tests.s3 import Proxy, S3Server, free_port

COUNTS = {"cat": 9, "dog": 6, "emu": 4}
SHARDS = 3


def _class_folders(root: Path) -> Path:
    write_class_folders(root, COUNTS, repeat=3)
    deep = root / "dog" / "puppies"  # a sub-folder: read after the class folder's own files
    deep.mkdir()
    (deep / "p1.bin").write_bytes(payload(1, 99) * 2)
    (deep / "p0.txt").write_bytes(b"puppy")
    (root / "emu" / ".DS_Store").write_bytes(b"hidden")  # skipped, as locally
    return root


def _keyed(root: Path) -> Path:
    for folder, labels in (("a", ["x", "y", "x", "z"]), ("b/c", ["y", "z", "x"])):
        path = root / folder
        path.mkdir(parents=True)
        for i, label in enumerate(labels):
            (path / f"s{i:03d}.jpg").write_bytes(payload(i, i + len(folder)) * 2)
            (path / f"s{i:03d}.json").write_bytes(b'{"i": %d}' % i)
            (path / f"s{i:03d}.cls").write_bytes(label.encode())
    return root


def _tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))


def _tars(root: Path) -> Path:
    root.mkdir(parents=True)
    for t in range(3):
        members: list[tuple[str, bytes]] = []
        for i in range(7 + t):
            key = f"t{t}/{i:04d}"
            members.append((f"{key}.png", payload(t, i) * (1 + i % 3)))
            members.append((f"{key}.cls", str((i + t) % 4).encode()))
        _tar(root / f"part-{t}.tar", members)
    # a member larger than the scan's read block: skipped by a seek, read by a ranged GET
    _tar(root / "part-3.tar", [("big/0000.png", os.urandom(9 << 20)), ("big/0000.cls", b"1")])
    return root


LAYOUTS = {"class-folders": _class_folders, "keyed": _keyed, "tar": _tars}


def _fs(s3: S3Server, endpoint: str | None = None) -> Any:
    return fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options(endpoint))


def _upload(s3: S3Server, local: Path, target: str) -> None:
    fs = _fs(s3)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            fs.pipe_file(f"{target}/{path.relative_to(local).as_posix()}", path.read_bytes())


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_prefix_builds_the_bytes_of_its_local_copy(
    layout: str, s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    raw = LAYOUTS[layout](tmp_path / "raw")
    _upload(s3, raw, f"{bucket}/train")
    local = shardprep.build(str(raw), str(tmp_path / "local"), shards=SHARDS, seed=5, workers=1)
    url = f"s3://{bucket}/train/"  # a trailing slash names the same prefix
    remote = shardprep.build(
        url,
        str(tmp_path / "remote"),
        shards=SHARDS,
        seed=5,
        workers=2,  # class folders and tars: one scan task each, in worker processes
        storage_options=s3.storage_options(),
        progress=False,
    )
    assert (remote.layout, remote.layout_detected) == (layout, True)
    assert remote.num_samples == local.num_samples > 0
    assert _files(tmp_path / "remote") == _files(tmp_path / "local")


def _scan_requests(s3: S3Server, url: str) -> tuple[list[str], int]:
    """The requests the scan of ``url`` sends (through a proxy) and its sample count."""
    with Proxy(s3.port) as proxy:
        inventory = scan(url, InputFormat.AUTO, storage_options=s3.storage_options(proxy.endpoint))
        return list(proxy.requests), len(inventory)


def _is_listing(request: str, bucket: str) -> bool:
    method, _, target = request.partition(" ")
    path, _, query = target.partition("?")
    return method == "GET" and path.rstrip("/") == f"/{bucket}" and "list-type=2" in query


def test_the_scan_of_class_folders_sends_listings_only(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    raw = _class_folders(tmp_path / "raw")
    _upload(s3, raw, f"{bucket}/train")
    requests, samples = _scan_requests(s3, f"s3://{bucket}/train")
    assert samples == sum(COUNTS.values()) + 2
    assert [r for r in requests if not _is_listing(r, bucket)] == []  # no HEAD, no GET of a key
    # the top level and the first class folder (detection), the top again (class names: the
    # scan takes no state from the detection), then one paginated listing per class folder
    assert len(requests) == 3 + len(COUNTS), requests


def test_the_scan_of_keyed_files_reads_the_labels_only(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    raw = _keyed(tmp_path / "raw")
    _upload(s3, raw, f"{bucket}/train")
    requests, samples = _scan_requests(s3, f"s3://{bucket}/train")
    assert samples == 7
    reads = sorted(r for r in requests if not _is_listing(r, bucket))
    labels = sorted(f"GET /{bucket}/train/{p.relative_to(raw)}" for p in raw.rglob("*.cls"))
    assert reads == labels  # each .cls once (its label is data); never a .jpg or .json
    assert len(requests) - len(reads) <= 4, requests  # top level, first folders, one find


def test_the_scan_of_tar_shards_reads_each_tar_in_ranged_reads(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    raw = _tars(tmp_path / "raw")
    _upload(s3, raw, f"{bucket}/train")
    requests, samples = _scan_requests(s3, f"s3://{bucket}/train")
    assert samples == 7 + 8 + 9 + 1
    gets = [r for r in requests if r.startswith("GET ") and not _is_listing(r, bucket)]
    # part-0..2 fit one read block each; part-3's 9 MiB member is skipped: two reads
    assert sorted(gets) == [f"GET /{bucket}/train/part-{t}.tar" for t in (0, 1, 2, 3, 3)]


def _refusal(raw: str, out: Path, **options: Any) -> str:
    with pytest.raises(InputError) as caught:
        shardprep.build(raw, str(out), shards=2, progress=False, **options)
    assert not out.exists()  # nothing written
    return str(caught.value)


@pytest.mark.parametrize(
    ("stray", "fmt"),
    [("README.txt", "auto"), ("README.txt", "class-folders"), ("dog/notes", "auto")],
)
def test_a_stray_object_is_refused_as_a_stray_file_is(
    stray: str, fmt: str, s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    raw = _class_folders(tmp_path / "raw")
    (raw / stray).write_bytes(b"not a sample")
    _upload(s3, raw, f"{bucket}/train")
    url = f"s3://{bucket}/train"
    local = _refusal(str(raw), tmp_path / "out", input_format=fmt)
    remote = _refusal(url, tmp_path / "out", input_format=fmt, storage_options=s3.storage_options())
    assert remote == local.replace(str(raw), url)
    assert stray.rsplit("/", 1)[-1] in remote


def test_an_empty_or_missing_prefix_is_refused(s3: S3Server, bucket: str, tmp_path: Path) -> None:
    options = s3.storage_options()
    out = tmp_path / "out"
    assert _refusal(f"s3://{bucket}", out, storage_options=options) == (
        f"s3://{bucket}: the prefix holds no objects; point RAW at the dataset"
    )
    _fs(s3).pipe_file(f"{bucket}/other/a.bin", b"x")
    for fmt in ("auto", "class-folders", "keyed", "tar"):
        assert _refusal(f"s3://{bucket}/train", out, input_format=fmt, storage_options=options) == (
            f"s3://{bucket}/train: no objects under this prefix (it is empty or does not "
            "exist); point RAW at the dataset"
        )
    missing_bucket = _refusal("s3://no-such-bucket/train", out, storage_options=options)
    assert missing_bucket.startswith("s3://no-such-bucket/train: the bucket does not exist")


def test_an_unreachable_endpoint_is_refused_in_bounded_time(tmp_path: Path) -> None:
    options = {
        "key": "k",
        "secret": "s",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"},
    }
    started = time.monotonic()
    message = _refusal("s3://data/train", tmp_path / "out", storage_options=options)
    assert message.startswith("s3://data/train: cannot reach the storage"), message
    assert time.monotonic() - started < 60


def test_ray_builds_a_prefix_like_the_local_engine(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    """On Ray, one listing task per class folder and the tasks read the objects themselves."""
    pytest.importorskip("ray")
    raw = _class_folders(tmp_path / "raw")
    _upload(s3, raw, f"{bucket}/train")
    shardprep.build(str(raw), str(tmp_path / "local"), shards=SHARDS, workers=1)
    script = (
        "import json, sys, ray, shardprep\n"
        "ray.init(address='local', num_cpus=2, include_dashboard=False, log_to_driver=False)\n"
        "try:\n"
        f"    shardprep.build(sys.argv[1], sys.argv[2], shards={SHARDS}, engine='ray',\n"
        "                    progress=False,\n"
        "                    storage_options=json.loads(sys.argv[3]))\n"
        "finally:\n"
        "    ray.shutdown()\n"
    )
    options = json.dumps(s3.storage_options())
    url, out = f"s3://{bucket}/train", str(tmp_path / "ray")
    env = {**os.environ, "RAY_ADDRESS": ""}
    result = run_bounded([sys.executable, "-c", script, url, out, options], timeout=240, env=env)
    assert result.returncode == 0, result.stderr
    assert _files(tmp_path / "ray") == _files(tmp_path / "local")


@pytest.mark.parametrize("export", ["spark-partitioned", "hugging-face"])
def test_a_parquet_export_with_sidecars_on_a_prefix_builds_its_local_bytes(
    export: str, s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    """Spark's partitionBy export (_SUCCESS, .crc, _started_/_committed_, label=N/) and a Hugging
    Face export (README.md, dataset_info.json) are Parquet on a prefix as in a folder."""
    exports = pytest.importorskip("tests.integration.test_parquet_exports")
    make = exports.spark_partitioned if export == "spark-partitioned" else exports.hugging_face
    raw = make(tmp_path / "raw")
    _upload(s3, raw, f"{bucket}/export")
    local = shardprep.build(str(raw), str(tmp_path / "local"), shards=2, progress=False)
    remote = shardprep.build(
        f"s3://{bucket}/export",
        str(tmp_path / "remote"),
        shards=2,
        storage_options=s3.storage_options(),
        progress=False,
    )
    assert (remote.layout, remote.layout_detected) == ("parquet", True)
    assert remote.num_samples == local.num_samples == 14  # one per row
    assert remote.num_classes == local.num_classes == (11 if export == "spark-partitioned" else 0)
    assert _files(tmp_path / "remote") == _files(tmp_path / "local")
