"""Fixtures for object-storage tests: one moto S3 server per session, a fresh bucket per test."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from tests.s3 import Proxy, S3Server  # noqa: E402

_names = itertools.count()


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    """A real S3-compatible server (moto) on 127.0.0.1, killed at the end of the session."""
    with S3Server() as server:
        yield server


@pytest.fixture
def bucket(s3: S3Server) -> str:
    """The name of a new, empty bucket on ``s3``."""
    name = f"test-{next(_names)}"
    s3.create_bucket(name)
    return name


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[Proxy]:
    """An unthrottled proxy in front of ``s3``; tests set ``latency``/``bandwidth`` or ``cut_next``."""
    with Proxy(s3.port) as p:
        yield p


@pytest.fixture
def uploaded(s3: S3Server, bucket: str, built: Path, built_zstd: Path) -> dict[str, str]:
    """``built`` and ``built_zstd`` uploaded with s3fs ``put``: {"tar": url, "zstd": url}."""
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
    fs.put(str(built), f"{bucket}/tar", recursive=True)
    fs.put(str(built_zstd), f"{bucket}/zstd", recursive=True)
    return {"tar": f"s3://{bucket}/tar", "zstd": f"s3://{bucket}/zstd"}
