"""The test server itself: objects round-trip, the proxy adds latency and cuts bodies."""

from __future__ import annotations

import fsspec

from tests.s3 import Proxy, S3Server


def test_round_trip_through_a_cutting_proxy(s3: S3Server, bucket: str, proxy: Proxy) -> None:
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options(proxy.endpoint))
    body = bytes(range(256)) * 8192  # 2 MiB
    fs.pipe(f"{bucket}/x", body)
    proxy.cut_next(1, after=1000)
    assert fs.cat(f"{bucket}/x") == body  # s3fs retried the cut body
    assert proxy.cuts == 1
