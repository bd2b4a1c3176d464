"""Missing or invalid credentials are reported as a credentials problem naming the URL and what
to set, not as storage that "cannot be reached" (against the moto S3 server on 127.0.0.1)."""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import shardprep
from shardprep.format.errors import InputError, OutputError
from tests.conftest import write_class_folders
from tests.processes import run_bounded
from tests.s3 import S3Server

WHAT_TO_SET = "set the credentials the backend uses (for S3: AWS_PROFILE or AWS_ACCESS_KEY_ID"
# the storage options as each caller gives them (was: --storage-option for shardprep.build too)
CLI_OPTIONS = "or --storage-option profile=..., key=..., secret=..., anon=true for a public"
PYTHON_OPTIONS = "or storage_options={'profile': ...}, {'key': ..., 'secret': ...} or {'anon'"


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_class_folders(tmp_path_factory.mktemp("creds") / "raw", {"a": 3, "b": 3})


def _no_credentials_env(tmp_path: Path, endpoint: str) -> dict[str, str]:
    """This environment without any AWS credentials: no variables, no config files, no
    instance metadata; only the endpoint and region."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-credentials"),
        AWS_CONFIG_FILE=str(tmp_path / "no-config"),
        AWS_EC2_METADATA_DISABLED="true",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
    )
    return env


def test_cli_without_credentials_says_so(
    raw: Path, s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    result = run_bounded(
        [sys.executable, "-m", "shardprep", "build", str(raw), f"s3://{bucket}/out", "-n", "2"],
        timeout=120,
        env=_no_credentials_env(tmp_path, s3.endpoint),
    )
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        f"Error: s3://{bucket}/out: no credentials found (NoCredentialsError: "
    ), lines[0]
    assert WHAT_TO_SET in lines[0] and CLI_OPTIONS in lines[0]
    assert "cannot reach" not in lines[0]


def test_raw_prefix_without_credentials_says_so(
    s3: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in _no_credentials_env(tmp_path, s3.endpoint).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(InputError) as info:
        shardprep.build(f"s3://{bucket}/train", str(tmp_path / "out"), shards=2, progress=False)
    message = str(info.value)
    assert message.startswith(f"s3://{bucket}/train: no credentials found"), message
    assert WHAT_TO_SET in message and PYTHON_OPTIONS in message, message
    assert "--storage-option" not in message


@pytest.fixture(scope="module")
def s3_with_auth() -> Iterator[S3Server]:
    """A moto server of its own that checks access keys (moto's auth enforcement): an
    unknown key is refused with 403 InvalidAccessKeyId."""
    with S3Server() as server:
        server.create_bucket("auth")  # before enforcement starts
        request = urllib.request.Request(
            f"{server.endpoint}/moto-api/reset-auth",
            data=b"0",
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(request, timeout=10):
            pass
        yield server


def test_invalid_access_key_says_so(raw: Path, s3_with_auth: S3Server) -> None:
    options = s3_with_auth.storage_options()  # a key moto's IAM does not know
    with pytest.raises(OutputError) as info:
        shardprep.build(
            str(raw), "s3://auth/out", shards=2, progress=False, storage_options=options
        )
    message = str(info.value)
    assert message.startswith(
        "s3://auth/out: the credentials are not valid (InvalidAccessKeyId: "
    ), message
    assert WHAT_TO_SET in message and PYTHON_OPTIONS in message, message
    assert "cannot reach" not in message and "access denied" not in message
