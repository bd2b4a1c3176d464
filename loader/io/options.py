"""Remote options: how a remote output is read (timeouts, read-ahead, cache, backend)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BACKENDS", "RemoteOptions"]

BACKENDS = ("auto", "fsspec", "obstore")  # RemoteOptions.backend (``loader.io.fetch``)


@dataclass(frozen=True, slots=True)
class RemoteOptions:
    """How a remote output is read.

    ``connect_timeout_s`` bounds opening a connection, ``read_timeout_s`` a
    wait for the next bytes of an answer (not a whole transfer). They become
    fsspec options (``client_kwargs={"timeout": aiohttp.ClientTimeout(...)}``
    for http(s), ``config_kwargs`` for s3, with botocore's retries off:
    ``"retries": {"total_max_attempts": 1, "mode": "standard"}``); other
    protocols keep their own. Options in ``fsspec.config.conf`` for the
    protocol (or ``FSSPEC_*`` environment variables) replace these defaults,
    and ``storage_options`` replace both, one key deep
    (``config_kwargs={"region_name": ...}`` keeps the timeouts). Whatever the
    client's settings, one attempt of a ranged read is cut after
    ``attempt_deadline_s`` (from these two timeouts), and a read makes
    ``RETRIES`` attempts: see :func:`worst_case_s`.

    Read-ahead (``loader.io.readahead``): each worker fetches the ranges it will
    read next, ``max_requests`` ranged requests of at most ``request_bytes``
    in flight, holding at most ``read_ahead_bytes`` fetched ahead of what it
    is reading (0 turns read-ahead off: one synchronous read per window).
    ``read_ahead_bytes=None`` (the default) is 128 MiB per DataLoader, split
    between its workers (at least 64 MiB each): 128 MiB in process, 64 MiB in
    each of 2 or more workers. ``max_requests=None`` (the default) keeps 16
    requests in flight per DataLoader, split between its workers (at least 4
    each), each of at most the budget over that count (and ``request_bytes``):
    16 of 8 MiB in process, 8 of 8 MiB in each of 2 workers. Object stores pace
    each connection, so the connections in flight set the throughput of a
    node, and the budget is spent on as many of them as it holds; every request
    costs the store (and the bill) too, so they are as large as the budget
    allows (``loader.io.readahead.concurrency``; docs/benchmarks-remote.md).

    Cache (``loader.io.cache``): with ``cache_dir``, whole shards and their
    indexes are kept there, shared safely by every worker and rank of a
    node, evicted least recently used beyond ``cache_limit`` bytes (None: no
    limit). See docs/loader.md, "Remote outputs".

    ``backend`` (``loader.io.fetch``): ``"auto"`` reads ``s3://``, ``gs://`` and
    ``az://`` with obstore when it is installed and the ``storage_options``
    translate (else fsspec, with one warning), ``"obstore"`` insists (refusing
    an option it cannot translate, naming it), ``"fsspec"`` never uses obstore.
    The timeouts, the attempts and the deadlines are the same with both.
    """

    connect_timeout_s: float = 10.0
    read_timeout_s: float = 30.0
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    read_ahead_bytes: int | None = None
    request_bytes: int = 8 << 20
    max_requests: int | None = None
    cache_dir: str | None = None
    cache_limit: int | None = None
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {self.backend!r}")
        if not (self.connect_timeout_s > 0 and self.read_timeout_s > 0):
            raise ValueError("connect_timeout_s and read_timeout_s must be positive")
        if (
            (self.read_ahead_bytes is not None and self.read_ahead_bytes < 0)
            or self.request_bytes < 1
            or (self.max_requests is not None and self.max_requests < 1)
        ):
            raise ValueError(
                "read_ahead_bytes must be >= 0 (0: no read-ahead; None: 128 MiB per DataLoader), "
                "request_bytes >= 1 and "
                "max_requests >= 1 (or None: 16 per DataLoader, split between its workers)"
            )
        if self.cache_limit is not None and self.cache_limit < 1:
            raise ValueError("cache_limit must be a positive number of bytes (or None: no limit)")
        if self.cache_limit is not None and self.cache_dir is None:
            raise ValueError("cache_limit needs a cache_dir")
        if self.cache_dir is not None:
            from loader.io.cachedir import check_cache_dir  # imported only when a cache is set

            check_cache_dir(self.cache_dir)
