"""The pure parts of building into object storage: URL detection, --storage-option parsing,
default options under the user's, and the batches a writer fetches listed URLs in."""

from __future__ import annotations

import click
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardprep.cli import _storage_options
from shardprep.format.storage_options import merge_options
from shardprep.remote_input import BATCH_BYTES, BATCH_PARTS, RemoteParts
from shardprep.storage import S3_DEFAULTS, is_url, local_path


def test_urls_and_local_paths() -> None:
    assert is_url("s3://bucket/out")
    assert is_url("gs://b/o")
    assert is_url("memory://x")
    assert is_url("simplecache::s3://b/k")
    assert not is_url("file:///tmp/out")
    assert not is_url("/tmp/out")
    assert not is_url("s3:/bucket")  # a local folder named "s3:", as the user typed it
    assert not is_url("out/s3://x")
    assert local_path("file:///tmp/out") == "/tmp/out"
    assert local_path("rel/out") == "rel/out"


def test_storage_option_values_are_json_when_they_parse() -> None:
    assert _storage_options(()) is None
    assert _storage_options(
        (
            "anon=true",
            "max_concurrency=4",
            "profile=prod",
            'client_kwargs={"endpoint_url": "http://127.0.0.1:9000"}',
            "key=a=b",
            "secret=",
        )
    ) == {
        "anon": True,
        "max_concurrency": 4,
        "profile": "prod",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"},
        "key": "a=b",
        "secret": "",
    }
    for bad in ("novalue", "=x"):
        with pytest.raises(click.BadParameter, match="is not KEY=VALUE"):
            _storage_options((bad,))


def test_user_options_replace_defaults_one_key_deep() -> None:
    merged = merge_options(S3_DEFAULTS, {"config_kwargs": {"read_timeout": 120}, "anon": True})
    assert merged == {
        "config_kwargs": {
            "connect_timeout": 5,
            "read_timeout": 120,
            "retries": {"max_attempts": 3, "mode": "standard"},
        },
        "anon": True,
    }
    assert merge_options(S3_DEFAULTS, {"config_kwargs": None}) == {"config_kwargs": None}


@given(st.lists(st.integers(0, 3 * BATCH_BYTES // 2), min_size=1, max_size=600))
def test_batches_cover_every_part_once_in_order_and_stay_bounded(sizes: list[int]) -> None:
    parts = RemoteParts([(f"s3://b/{i}.bin", size) for i, size in enumerate(sizes)], None)
    batches = []
    while True:
        batch = parts._batch()
        if not batch:
            break
        batches.append(batch)
    assert [i for batch in batches for i in batch] == list(range(len(sizes)))
    for batch in batches:
        assert 1 <= len(batch) <= BATCH_PARTS
        assert len(batch) == 1 or sum(sizes[i] for i in batch) <= BATCH_BYTES


def test_storage_options_the_client_refuses_are_named() -> None:
    """A key s3fs does not take (boto's name for it) fails at the client's first request, as a
    TypeError from aiobotocore's session; the loader names the options and what to pass (no
    server needed: the session is made before any connection)."""
    from loader import ReadOptions, RemoteOptions, ShardDataset

    options = {"aws_access_key_id": "x", "endpoint_url": "http://127.0.0.1:9"}
    read = ReadOptions(remote=RemoteOptions(storage_options=options))
    with pytest.raises(ValueError, match=r"refused the storage options \['aws_access_key_id'"):
        ShardDataset("s3://bucket/out", read=read)
