"""The obstore fetch backend against a real S3 server (moto on 127.0.0.1) and real sockets.

The same batches as fsspec and as the local build (exact bytes and order, read-ahead on and
off, with the cache), the same bounds on a silent or stalling endpoint, a flipped byte named
as locally, bad credentials named and not retried, the storage options translated or refused
by name, and DataLoader workers forked from a process that has (or has not) used obstore.
"""

from __future__ import annotations

import contextlib
import json
import sys
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("obstore")

from loader import (  # noqa: E402
    CorruptShardError,
    ReadOptions,
    RemoteOptions,
    ShardDataset,
)
from loader.io import obstore_backend  # noqa: E402
from loader.io import source as source_module  # noqa: E402
from loader.io.fetch import backend_for  # noqa: E402
from loader.io.obstore_backend import UntranslatableOption, translate  # noqa: E402
from loader.io.source import RETRIES, Source, worst_case_s  # noqa: E402
from tests.processes import run_bounded  # noqa: E402
from tests.remote.test_silent_endpoint import Endpoint, probe, s3_options  # noqa: E402
from tests.s3 import Proxy, S3Server  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = {"batch_size": 8, "shuffle": True, "seed": 3}


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_module, "BACKOFF_S", 0.01)


def read(s3: S3Server, proxy: Proxy, backend: str, **kw: Any) -> ReadOptions:
    options = s3.storage_options(proxy.endpoint)
    return ReadOptions(remote=RemoteOptions(storage_options=options, backend=backend, **kw))


def batches(ds: ShardDataset) -> list[list[tuple[str, bytes]]]:
    return [list(zip(b["__key__"].tolist(), b["bin"].tolist(), strict=True)) for b in ds]


def gets(proxy: Proxy, since: int, suffix: str) -> int:
    lines = [r.split("?")[0] for r in proxy.requests[since:]]
    return sum(1 for r in lines if r.startswith("GET ") and r.endswith(suffix))


def obstore_stores(bucket: str) -> int:
    """How many obstore stores this process made for ``bucket`` (0: obstore read nothing)."""
    return sum(1 for key in obstore_backend._stores if key[2] == bucket)


# --- the same bytes ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tar", "zstd"])
@pytest.mark.parametrize(
    "extra",
    [{}, {"read_ahead_bytes": 0}, {"request_bytes": 3000, "read_ahead_bytes": 20_000}],
    ids=["read-ahead", "direct", "small-requests"],
)
def test_obstore_gives_the_batches_of_fsspec_and_of_the_local_build(
    s3: S3Server,
    proxy: Proxy,
    uploaded: dict[str, str],
    built: Path,
    built_zstd: Path,
    kind: str,
    extra: dict[str, Any],
) -> None:
    local = batches(ShardDataset(str(built if kind == "tar" else built_zstd), **OPTIONS))
    bucket = uploaded[kind][len("s3://") :].split("/")[0]
    before = obstore_stores(bucket)
    through_obstore = ShardDataset(
        uploaded[kind], read=read(s3, proxy, "obstore", **extra), **OPTIONS
    )
    assert batches(through_obstore) == local
    assert obstore_stores(bucket) == before + 1  # obstore did read (one store per bucket)
    through_fsspec = ShardDataset(
        uploaded[kind], read=read(s3, proxy, "fsspec", **extra), **OPTIONS
    )
    assert batches(through_fsspec) == local
    assert obstore_stores(bucket) == before + 1  # and fsspec did not use it


def test_the_cache_fills_from_obstore_and_serves_the_next_epoch_without_a_request(
    s3: S3Server, proxy: Proxy, uploaded: dict[str, str], built_zstd: Path, tmp_path: Path
) -> None:
    local = batches(ShardDataset(str(built_zstd), **OPTIONS))
    options = read(s3, proxy, "obstore", cache_dir=str(tmp_path), request_bytes=20_000)
    before = len(proxy.requests)
    assert batches(ShardDataset(uploaded["zstd"], read=options, **OPTIONS)) == local
    # every shard downloaded once, in ranged GETs of 20 kB (obstore's get_ranges)
    sizes = [p.stat().st_size for p in built_zstd.glob("shard-*.tar.zst")]
    assert gets(proxy, before, ".tar.zst") == sum(-(-(n + 1) // 20_000) for n in sizes)
    cached = {p.name: p.read_bytes() for p in tmp_path.rglob("shard-*.tar.zst")}
    assert cached == {p.name: p.read_bytes() for p in built_zstd.glob("shard-*.tar.zst")}
    before = len(proxy.requests)
    assert batches(ShardDataset(uploaded["zstd"], read=options, **OPTIONS)) == local
    assert gets(proxy, before, ".tar.zst") == 0


def test_a_connection_cut_mid_body_is_retried_with_exact_bytes(
    s3: S3Server, proxy: Proxy, uploaded: dict[str, str], built_zstd: Path
) -> None:
    source = Source(uploaded["zstd"], read(s3, proxy, "obstore").remote)
    expected = (built_zstd / "shard-00003.tar.zst").read_bytes()
    proxy.cut_next(2, after=5000)
    assert source.fetch("shard-00003.tar.zst", 0, len(expected) + 10) == expected
    assert proxy.cuts == 2
    assert source.fetch("shard-00003.tar.zst", len(expected), len(expected) + 10) == b""
    assert source.fetch_ranges("shard-00003.tar.zst", [(0, 10), (len(expected) - 5, 10**9)]) == [
        expected[:10],
        expected[-5:],
    ]


def test_a_flipped_byte_is_named_as_in_the_local_build(
    s3: S3Server, proxy: Proxy, bucket: str, built: Path, tmp_path: Path
) -> None:
    import shutil

    import fsspec

    damaged = tmp_path / "out"
    shutil.copytree(built, damaged)
    shard = damaged / "shard-00002.tar"
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF  # inside the first member's payload (its tar header is bytes 0-511)
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError) as local:
        batches(ShardDataset(str(damaged), **OPTIONS))
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
    fs.put(str(damaged), f"{bucket}/out", recursive=True)
    url = f"s3://{bucket}/out"
    with pytest.raises(CorruptShardError) as remote:
        batches(ShardDataset(url, read=read(s3, proxy, "obstore"), **OPTIONS))
    assert str(remote.value) == str(local.value).replace(str(shard), f"{url}/shard-00002.tar")
    assert f"{url}/shard-00002.tar" in str(remote.value)


# --- bounds -----------------------------------------------------------------------------


def test_a_silent_endpoint_is_unreachable_within_the_bound() -> None:
    endpoint = Endpoint()
    try:
        spec: dict[str, Any] = {
            "connect_timeout_s": 1,
            "read_timeout_s": 1,
            "backend": "obstore",
            "storage_options": s3_options(endpoint.url),
        }
        bound = worst_case_s(RemoteOptions(**spec), 1000)
        outcome = probe("s3://bucket/out", "shard-00000.tar", 0, 1000, spec, bound)
    finally:
        endpoint.stop()
    assert outcome["error"] == "UnreachableError", outcome
    assert outcome["url"] == "s3://bucket/out/shard-00000.tar"
    assert outcome["message"].startswith(
        "s3://bucket/out/shard-00000.tar: could not reach the server: 3 attempts failed in "
    )
    assert "connect timeout 1 s, read timeout 1 s, 3 attempts" in outcome["message"]
    assert endpoint.connections == RETRIES == 3  # one HTTP attempt per loader attempt
    assert 3.0 <= outcome["elapsed"] <= bound  # three 1 s read timeouts, no more


def test_a_trickle_is_cut_by_the_attempt_deadline_not_the_read_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A byte every 0.3 s never trips obstore's read timeout (1 s): only the attempt deadline
    (asyncio.wait_for on the backend's loop) ends each attempt."""
    import socket
    import threading
    import time

    from tests.remote.test_silent_endpoint import STALLED_ANSWER

    stop = threading.Event()
    accepted: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.3)

        def serve() -> None:
            while not stop.is_set():
                try:
                    connection, _ = listener.accept()
                    accepted.append(connection)
                    connection.settimeout(5)
                    request = b""
                    while b"\r\n\r\n" not in request and (chunk := connection.recv(65536)):
                        request += chunk
                    connection.sendall(STALLED_ANSWER)
                except TimeoutError:
                    for c in accepted:
                        with contextlib.suppress(OSError):  # a connection the client gave up
                            c.sendall(b"x")
                except OSError:
                    return

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        options = RemoteOptions(
            connect_timeout_s=1,
            read_timeout_s=1,
            backend="obstore",
            storage_options=s3_options(f"http://127.0.0.1:{listener.getsockname()[1]}"),
        )
        began = time.monotonic()
        try:
            with pytest.raises(source_module.UnreachableError) as caught:
                Source("s3://bucket/out", options).fetch("shard-00000.tar", 0, 1000)
        finally:
            stop.set()
            thread.join(10)
            for c in accepted:
                c.close()
    elapsed = time.monotonic() - began
    assert caught.value.url == "s3://bucket/out/shard-00000.tar"
    assert "deadline" in str(caught.value)
    assert len(accepted) == 3
    assert 3 * 2.0 <= elapsed <= worst_case_s(options, 1000)


# --- refusals ---------------------------------------------------------------------------


def test_bad_credentials_are_named_and_not_retried(built: Path) -> None:
    import fsspec

    with S3Server() as server, Proxy(server.port) as proxy:
        server.create_bucket("auth")
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **server.storage_options())
        fs.put(str(built), "auth/out", recursive=True)
        # from now on moto checks every request's credentials
        request = urllib.request.Request(
            f"{server.endpoint}/moto-api/reset-auth",
            data=b"0",
            method="POST",
            headers={"Content-Type": "text/plain"},  # a form body would hide it from moto
        )
        urllib.request.urlopen(request, timeout=10).close()
        options = RemoteOptions(backend="obstore", storage_options=s3_options(proxy.endpoint))
        before = len(proxy.requests)
        with pytest.raises(PermissionError) as caught:
            Source("s3://auth/out", options).fetch("shard-00000.tar", 0, 100)
    message = str(caught.value)
    assert message.startswith("s3://auth/out/shard-00000.tar: the server refused the credentials")
    assert "HTTP 403" in message and "InvalidAccessKeyId" in message
    assert "RemoteOptions.storage_options" in message
    assert len(proxy.requests) - before == 1  # final: not retried


def test_options_translate_or_are_refused_by_name() -> None:
    options = s3_options("http://127.0.0.1:9")
    assert translate("s3", {**options, "anon": False, "skip_instance_cache": True}) == {
        "config": {
            "access_key_id": "x",
            "secret_access_key": "y",
            "endpoint": "http://127.0.0.1:9",
            "region": "us-east-1",
        },
        "client_options": {"allow_http": True},
    }
    with pytest.raises(UntranslatableOption, match="'profile' has no obstore equivalent for s3"):
        translate("s3", {"profile": "dev"})
    with pytest.raises(UntranslatableOption, match="'client_kwargs.proxies'"):
        translate("s3", {"client_kwargs": {"proxies": {}}})
    # auto: fsspec, with one warning naming the option; obstore by name: refused
    auto = RemoteOptions(storage_options={**options, "profile": "dev"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert backend_for("s3", "s3://b/o", auto).name == "fsspec"
        assert backend_for("s3", "s3://b/o", auto).name == "fsspec"
    assert [str(w.message) for w in caught] == [
        "shardprep: s3://b/o: storage option 'profile' has no obstore equivalent for s3:// "
        "(see docs/loader.md, Remote outputs); use RemoteOptions(backend='fsspec'); reading "
        "with fsspec"
    ]
    with pytest.raises(UntranslatableOption, match="'profile'"):
        backend_for(
            "s3", "s3://b/o", RemoteOptions(backend="obstore", storage_options=auto.storage_options)
        )
    with pytest.raises(
        ValueError, match="backend must be one of auto, fsspec, obstore, not 'boto'"
    ):
        RemoteOptions(backend="boto")
    with pytest.raises(ValueError, match="reads s3, s3a, gs, gcs, az, abfs URLs, not https://h/o"):
        backend_for("https", "https://h/o", RemoteOptions(backend="obstore"))
    # the choice: obstore for data, fsspec for the set-up reads (keeps the process forkable)
    plain = RemoteOptions(storage_options=options)
    assert backend_for("s3", "s3://b/o", plain).name == "obstore"
    assert backend_for("s3", "s3://b/o", plain, setup=True).name == "fsspec"
    assert backend_for("s3", "s3://b/o", RemoteOptions(backend="fsspec")).name == "fsspec"
    assert backend_for("https", "https://h/o", plain).name == "fsspec"


# --- workers and fork -------------------------------------------------------------------


def workers(url: str, spec: dict[str, Any], context: str, first: bool) -> dict[str, Any]:
    command = [sys.executable, "-m", "tests.remote.obstore_workers", url, json.dumps(spec), "2"]
    command += [context] + (["--iterate-first"] if first else [])
    result = run_bounded(command, timeout=180, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return {**json.loads(result.stdout), "stderr": result.stderr}


@pytest.fixture(scope="module")
def local_reference(built_zstd: Path) -> dict[str, Any]:
    """What 2 forked workers read from the local build (one run for the module's cases)."""
    return workers(str(built_zstd), {}, "fork", False)


@pytest.mark.parametrize(
    ("context", "first", "obstore"),
    [("fork", False, True), ("fork", True, False), ("forkserver", True, True)],
    ids=["fork", "fork-after-reading", "forkserver-after-reading"],
)
def test_workers_read_with_obstore_unless_forked_from_a_process_that_did(
    s3: S3Server,
    proxy: Proxy,
    uploaded: dict[str, str],
    local_reference: dict[str, Any],
    context: str,
    first: bool,
    obstore: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    reference = local_reference
    assert reference["count"] == 1001
    spec = {"storage_options": s3.storage_options(proxy.endpoint)}
    got = workers(uploaded["zstd"], spec, context, first)
    assert (got["count"], got["sha256"]) == (1001, reference["sha256"])
    assert got["obstore"] == [obstore, obstore]  # each worker's own backend
    fallback = "obstore was used in the process this one was forked from"
    assert got["stderr"].count(fallback) == (0 if obstore else 2)  # once per worker
