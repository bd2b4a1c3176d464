"""Issue 19 item 4: ``shardprep inspect URL`` and ``shardprep verify URL`` against a real S3
server (moto), each compared with the same command on a local copy of the same objects:
the same output, the same exit code, the same problems named.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import fsspec
import pytest

from tests.faults.shard_surgery import index_of
from tests.processes import run_bounded
from tests.s3 import Proxy, S3Server


def _cli(command: str, out: str, s3: S3Server | None, *args: str, endpoint: str = "") -> Any:
    options: list[str] = []
    if s3 is not None:
        kwargs = json.dumps({"endpoint_url": endpoint or s3.endpoint, "region_name": "us-east-1"})
        options = ["--storage-option", "key=testing", "--storage-option", "secret=testing"]
        options += ["--storage-option", f"client_kwargs={kwargs}"]
    return run_bounded(
        [sys.executable, "-m", "shardprep", command, out, *options, *args],
        timeout=120,
        env={**os.environ},
    )


def _put_folder(s3: S3Server, local: Path, prefix: str) -> str:
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
    for path in sorted(local.iterdir()):
        fs.pipe_file(f"{prefix}/{path.name}", path.read_bytes())
    return f"s3://{prefix}"


@pytest.mark.parametrize("kind", ["tar", "zstd"])
def test_verify_url_passes_as_local_does(
    kind: str, uploaded: dict[str, str], built: Path, built_zstd: Path, s3: S3Server
) -> None:
    local = _cli("verify", str(built if kind == "tar" else built_zstd), None, "-q")
    with Proxy(s3.port) as proxy:
        remote = _cli("verify", uploaded[kind], s3, "-q", endpoint=proxy.endpoint)
        requests = list(proxy.requests)
    assert (remote.returncode, remote.stdout) == (local.returncode, local.stdout)
    assert local.returncode == 0 and local.stdout.startswith("ok: ")
    # the manifest, one listing, then ranged GETs of the shards and indexes only
    bucket = uploaded[kind].split("/")[2]
    assert requests[0] == f"GET /{bucket}/{kind}/manifest.json"
    assert all(r.startswith("GET ") for r in requests), requests  # no HEAD, no write
    shard_files = {
        n for n in os.listdir(built if kind == "tar" else built_zstd) if n != "manifest.json"
    }
    read = {r.split("/")[-1] for r in requests[1:] if "list-type=2" not in r}
    assert read == shard_files


def test_verify_url_names_the_shard_with_a_flipped_byte(
    built: Path, s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    damaged = Path(shutil.copytree(built, tmp_path / "damaged"))
    shard = damaged / "shard-00003.tar"
    index = index_of(damaged, 3)
    at = int(index.member_offset[2]) + 1  # inside the data of sample 1's... first member
    data = bytearray(shard.read_bytes())
    data[at] ^= 0x01
    shard.write_bytes(bytes(data))
    url = _put_folder(s3, damaged, f"{bucket}/out")
    local = _cli("verify", str(damaged), None, "-q")
    remote = _cli("verify", url, s3, "-q")
    assert local.returncode == remote.returncode == 1
    assert remote.stdout == local.stdout == ""
    problems = remote.stderr.strip().splitlines()
    assert problems == local.stderr.replace(str(damaged), url).strip().splitlines()
    assert (
        problems[0] == "shard-00003.tar: sha256 of the shard does not match the manifest "
        "(corrupt or modified)"
    )
    assert problems[1].startswith("shard-00003.tar: 1 damaged sample(s)")
    assert problems[-1] == f"Error: 2 problem(s) in {url}"


def test_verify_url_names_a_missing_shard_and_a_missing_manifest(
    built: Path, s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    partial = Path(shutil.copytree(built, tmp_path / "partial"))
    (partial / "shard-00005.tar").unlink()
    url = _put_folder(s3, partial, f"{bucket}/out")
    local, remote = _cli("verify", str(partial), None, "-q"), _cli("verify", url, s3, "-q")
    assert local.returncode == remote.returncode == 1
    assert remote.stderr == local.stderr.replace(str(partial), url)
    assert "shard-00005.tar: missing file shard-00005.tar" in remote.stderr

    nothing = _cli("verify", f"s3://{bucket}/nothing", s3)
    assert nothing.returncode == 1
    assert nothing.stderr.strip() == (
        f"Error: s3://{bucket}/nothing/manifest.json: no manifest; s3://{bucket}/nothing is "
        "not the output of shardprep build (it holds no shards)"
    )
    inspect_nothing = _cli("inspect", f"s3://{bucket}/nothing", s3)
    assert (inspect_nothing.returncode, inspect_nothing.stderr) == (1, nothing.stderr)


@pytest.mark.parametrize("as_json", [False, True])
def test_inspect_url_prints_what_local_inspect_prints(
    as_json: bool, uploaded: dict[str, str], built: Path, s3: S3Server
) -> None:
    flags = ["--json"] if as_json else []
    local = _cli("inspect", str(built), None, *flags)
    remote = _cli("inspect", uploaded["tar"], s3, *flags)
    assert local.returncode == remote.returncode == 0, remote.stderr
    expected = local.stdout.replace(json.dumps(str(built)) if as_json else str(built), "")
    got = remote.stdout.replace(json.dumps(uploaded["tar"]) if as_json else uploaded["tar"], "")
    assert got == expected
    assert "shard-00007.tar" in remote.stdout
