"""Source: where a build lives (local folder or URL) and reading its files, bounded and retried.

Local paths and ``file://`` URLs use plain file I/O. Any other URL
(``http(s)://``, ``s3://``, ...) is read through a fetch backend
(``loader.io.fetch``): obstore for ``s3://``, ``gs://`` and ``az://`` when it is
installed (``pip install "shardprep[obstore]"``), fsspec otherwise
(``pip install "shardprep[remote]"``, plus s3fs for S3); see
``RemoteOptions.backend``.

Remote reads get connect and read timeouts (:class:`RemoteOptions`; for
``http(s)`` and ``s3``) so a server that never answers cannot block for
minutes. Every transient transport error (any ``OSError`` such as a refused
connection or a timeout, aiohttp's client errors such as ``ClientPayloadError``
for a body cut short, botocore's connection errors, HTTP 408/429/5xx) is
retried ``RETRIES`` times in all with exponential backoff; then
:class:`~loader.errors.UnreachableError` names the URL. A missing file or a
refused permission is not transient. Every read has a size bound.

That is the only retry policy: the clients' own retries are set to one
try (botocore ``total_max_attempts=1``, s3fs ``retries=1``; s3fs's default nests
two loops of 5 tries, each of which botocore retried again; obstore
``max_retries=0``), and each attempt of a ranged read has a total deadline
(:func:`attempt_deadline_s`: connect + read timeout + size at ``MIN_RATE``)
enforced on the backend's event loop, which cancels the request. A server that
accepts connections and never answers therefore fails within
:func:`worst_case_s` (about 92 s with the defaults; at most 122 s when
connecting is slow too).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar

from loader.errors import RequestRefusedError, UnreachableError
from loader.io import fetch as backends
from loader.io.options import RemoteOptions
from shardprep.format.errors import ManifestError
from shardprep.format.manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from shardprep.format.shardformat import MANIFEST_NAME

__all__ = ["IOCounts", "Source", "attempt_deadline_s", "is_transient", "worst_case_s"]

T = TypeVar("T")
RETRIES = 3  # attempts per read, in all
BACKOFF_S = 0.5  # sleep before attempt k+1: BACKOFF_S * 2**(k-1) (0.5 s, 1 s)
MIN_RATE = 256 << 10  # bytes/s: an attempt slower than this is cut (its total deadline)
CLIENT_PAUSE_S = 0.2  # s3fs sleeps 0.1 s after a failed call, in each of its two nested loops
_NOT_TRANSIENT = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    RequestRefusedError,
)
_TRANSIENT_HTTP = frozenset({408, 425, 429, 500, 502, 503, 504})
_HTTP = ("http", "https")


IO_KEYS = ("requests", "bytes", "retries", "cache_hits", "cache_misses", "wait_ns")


class IOCounts:
    """One process's I/O counters of a ``Source`` (see :meth:`Source.io_counts`): ints added
    under a lock, once per request, per cache file acquired, per read-ahead wait."""

    __slots__ = ("_lock", *IO_KEYS)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = self.bytes = self.retries = 0
        self.cache_hits = self.cache_misses = self.wait_ns = 0

    def add(self, requests: int = 0, received: int = 0, retries: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.bytes += received
            self.retries += retries

    def cache(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.cache_hits += 1
            else:
                self.cache_misses += 1

    def waited(self, ns: int) -> None:
        with self._lock:
            self.wait_ns += ns

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {key: getattr(self, key) for key in IO_KEYS}


class Source:
    """Read access to the files of one shardprep output. Holds no open files (picklable)."""

    def __init__(self, root: str, remote: RemoteOptions | None = None) -> None:
        self.root = root[len("file://") :] if root.startswith("file://") else root
        self.remote = "://" in self.root
        self.protocol = self.root.split("://", 1)[0] if self.remote else "file"
        self.options = remote or RemoteOptions()
        self._backends: dict[tuple[int, bool], backends.Backend] = {}  # (pid, setup) -> backend
        self._counts: dict[int, IOCounts] = {}  # pid -> this process's counters

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_counts"] = {}  # a lock does not pickle; a process unpickling it counts its own
        return state

    def counts(self) -> IOCounts:
        """This process's counters: a process forked from one that counted starts from zero
        (a fresh lock too: the parent's may have been held by one of its threads at the fork)."""
        pid = os.getpid()
        mine = self._counts.get(pid)
        if mine is None:
            mine = self._counts.setdefault(pid, IOCounts())  # atomic: one object per process
        return mine

    def io_counts(self) -> dict[str, int]:
        """Cumulative I/O counts of this process since the ``Source`` was made (or unpickled,
        or since this process was forked: a forked DataLoader worker counts its own, from 0).

        ``requests``: GETs and ranged GETs sent to the store (``fetch``, ``fetch_ranges``,
        ``read_bytes``: every remote read goes through them), retries included; ``bytes``:
        bytes received in answers that succeeded; ``retries``: attempts made again after a
        transient error; ``cache_hits``/``cache_misses``: shard and index files the cache
        (``loader.io.cache``) was asked for that were present / had to be fetched (0 without a
        cache); ``wait_ns``: nanoseconds the read-ahead's callers waited for bytes
        (``loader.io.readahead``; local read-ahead too). A local output counts no requests.
        Not seen: a request aiohttp (fsspec) sends again by itself when a kept-alive connection
        closes before its answer began. (tested by ``tests/remote/test_io_counts.py``)
        """
        return self.counts().as_dict()

    def path(self, name: str) -> str:
        """Full path or URL of file ``name`` of the output."""
        return f"{self.root.rstrip('/')}/{name}" if self.remote else os.path.join(self.root, name)

    def _filesystem(self) -> Any:
        """The fsspec filesystem (fsspec caches instances per process and options)."""
        return backends.filesystem(self.protocol, self.root, self.options)

    def backend(self, setup: bool = False) -> backends.Backend:
        """This process's fetch backend (``loader.io.fetch.backend_for``; ``setup``: for the reads
        made while a dataset is set up, which keep the process fork-safe)."""
        key = (os.getpid(), setup)
        chosen = self._backends.get(key)
        if chosen is None:
            chosen = backends.backend_for(self.protocol, self.root, self.options, setup)
            self._backends = {
                key: chosen,
                **{k: v for k, v in self._backends.items() if k[0] == key[0]},
            }
        return chosen

    def open(self, name: str, size: int | None = None) -> BinaryIO:
        """Open file ``name`` for binary reading (seekable); ``size``, if known, spares a HEAD."""
        if not self.remote:
            return open(self.path(name), "rb", buffering=0)  # noqa: SIM115 - caller closes
        extra = {"size": size} if size is not None and self.protocol in _HTTP else {}
        return self._filesystem().open(self.path(name), "rb", **extra)  # type: ignore[no-any-return]

    def open_sized(self, name: str, size: int | None = None) -> tuple[BinaryIO, int]:
        """``open(name)`` and the file's actual size in bytes."""
        f = self.open(name, size)
        try:
            actual = int(f.size) if hasattr(f, "size") else os.fstat(f.fileno()).st_size
        except BaseException:
            f.close()
            raise
        return f, actual

    def read_bytes(self, name: str, limit: int, setup: bool = False) -> bytes:
        """The whole content of file ``name``, which must not exceed ``limit`` bytes (``setup``:
        read while a dataset is set up, see :meth:`backend`).

        Raises:
            ManifestError: the file is larger than ``limit``.
            UnreachableError: a remote server could not be reached or kept failing.
        """

        def read() -> bytes:
            with self.open(name) as f:
                return f.read(limit + 1)

        data = self._read_remote(name, limit + 1, setup) if self.remote else self.call(read, name)
        if len(data) > limit:
            raise ManifestError(
                f"{self.path(name)}: larger than the {limit} bytes expected; "
                "not the file the manifest describes: rebuild the output",
                self.path(name),
            )
        return data

    def _read_remote(self, name: str, most: int, setup: bool = False) -> bytes:
        """Up to ``most`` bytes of remote file ``name`` from its start, in ranged GETs of at
        most ``request_bytes`` (no HEAD), each a :meth:`fetch`: its deadline is the one of its
        own size, not of ``most`` (a manifest's bound of 256 MiB gave a server trickling it
        about 17 minutes per attempt)."""
        parts = []
        start = 0
        while start < most:
            stop = min(start + self.options.request_bytes, most)
            part = self.fetch(name, start, stop, setup)
            parts.append(part)
            if len(part) < stop - start:  # the file ends here
                break
            start = stop
        return b"".join(parts)

    def fetch(self, name: str, start: int, stop: int, setup: bool = False) -> bytes | memoryview:
        """Bytes ``[start, stop)`` of remote file ``name`` in one ranged GET, retried.

        Fewer bytes only where the file ends (none if it ends before ``start``).

        Raises:
            FileNotFoundError: the file does not exist.
            PermissionError: the server refused the credentials (obstore backend).
            UnreachableError: the server kept failing (see :meth:`call`).
        """
        if stop <= start:
            return b""
        url, deadline = self.path(name), attempt_deadline_s(self.options, stop - start)

        def attempt() -> bytes | memoryview:
            counts = self.counts()
            counts.add(requests=1)
            data = self.backend(setup).cat(url, start, stop, deadline)
            counts.add(received=len(data))
            return data

        return self.call(attempt, name)

    def fetch_ranges(self, name: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """``fetch(name, start, stop)`` for each range, concurrently (fsspec's ``cat_ranges``,
        obstore's ``get_ranges``), under one deadline for their total size, retried as a whole."""
        url = self.path(name)
        deadline = attempt_deadline_s(self.options, sum(b - a for a, b in ranges))

        def attempt() -> list[bytes]:
            counts = self.counts()
            counts.add(requests=len(ranges))
            parts = self.backend().cat_ranges(url, ranges, deadline)
            counts.add(received=sum(len(p) for p in parts))
            return parts

        return self.call(attempt, name)

    def manifest(self) -> Manifest:
        """Read and validate the output's manifest.

        Raises:
            ManifestError: missing (the build did not finish) or invalid.
            UnreachableError: the server could not be reached (remote outputs).
        """
        if not self.remote and not os.path.isdir(self.root):
            raise ManifestError(self._not_an_output(), self.root)
        try:
            data = self.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES, setup=True)
        except TypeError as err:  # the first request is where fsspec's client takes the options
            if not (self.remote and self.options.storage_options):
                raise
            raise ValueError(
                f"{self.path(MANIFEST_NAME)}: the {self.protocol} client refused the storage "
                f"options {sorted(self.options.storage_options)} ({err}); pass the options its "
                "fsspec filesystem takes (s3fs: key, secret, token, endpoint_url, "
                "client_kwargs, ...)"
            ) from err
        except FileNotFoundError as err:
            raise ManifestError(
                f"{self.path(MANIFEST_NAME)}: no manifest; is this a finished shardprep "
                "output? (run shardprep build, or --resume an interrupted one)",
                self.path(MANIFEST_NAME),
            ) from err
        return parse_manifest(data, self.path(MANIFEST_NAME))

    def _not_an_output(self) -> str:
        """Why the local path ``root`` is not an output folder, and what to pass instead."""
        if not os.path.exists(self.root):
            return (
                f"{self.root}: no such folder; pass the output folder of shardprep build "
                "(the one holding manifest.json)"
            )
        parent = os.path.dirname(os.path.abspath(self.root))
        hint = f" ({parent} is one)" if os.path.exists(os.path.join(parent, MANIFEST_NAME)) else ""
        return (
            f"{self.root}: a file, not a shardprep output folder; pass the folder holding "
            f"manifest.json and the shards{hint}"
        )

    def call(
        self, action: Callable[[], T], name: str, on_failure: Callable[[], None] | None = None
    ) -> T:
        """Run ``action`` (a read of file ``name``), retrying transient errors with backoff.

        ``on_failure`` runs after each failed attempt (e.g. to drop a broken
        open file). A local file's last error is re-raised as it is.

        Raises:
            UnreachableError: a remote read failed ``RETRIES`` times with
                transient errors (naming the URL, the attempts and the last error).
        """
        started = time.monotonic()
        for attempt in range(RETRIES):
            try:
                return action()
            except Exception as err:
                if not is_transient(err):
                    raise
                if on_failure is not None:
                    on_failure()
                if attempt == RETRIES - 1:
                    if not self.remote:
                        raise
                    raise UnreachableError.after(
                        self.path(name),
                        RETRIES,
                        time.monotonic() - started,
                        err,
                        f"connect timeout {self.options.connect_timeout_s:g} s, read timeout "
                        f"{self.options.read_timeout_s:g} s, {RETRIES} attempts",
                    ) from err
                self.counts().add(retries=1)
                time.sleep(BACKOFF_S * 2**attempt)
        raise AssertionError(f"unreachable: {name}")  # pragma: no cover


def attempt_deadline_s(options: RemoteOptions, size: int) -> float:
    """The longest one attempt at a ranged read of ``size`` bytes may take: connecting, the
    first bytes, and the transfer at ``MIN_RATE``."""
    return options.connect_timeout_s + options.read_timeout_s + size / MIN_RATE


def worst_case_s(options: RemoteOptions, size: int = 0) -> float:
    """The longest :meth:`Source.call` of a ``size``-byte ranged read takes before it returns or
    raises ``UnreachableError``: ``RETRIES`` attempts (each within :func:`attempt_deadline_s`,
    plus s3fs's pauses) and the backoff between them.

    A server that accepts connections and never answers fails after ``RETRIES`` read
    timeouts (plus backoff): with the defaults 3 x 30 + 1.5 = 91.5 s; this bound (121.5 s
    plus pauses for ``size=0``) also covers a connect that takes the whole connect timeout.
    """
    backoff = sum(BACKOFF_S * 2.0**attempt for attempt in range(RETRIES - 1))
    return RETRIES * (attempt_deadline_s(options, size) + CLIENT_PAUSE_S) + backoff


def is_transient(err: BaseException) -> bool:
    """Whether ``err`` is a transport failure worth retrying (see the module docstring)."""
    if isinstance(err, FileNotFoundError):
        # fsspec's http turns any failure to reach a URL into FileNotFoundError(url) from it
        cause = err.__cause__
        return (
            cause is not None and not isinstance(cause, FileNotFoundError) and is_transient(cause)
        )
    if isinstance(err, _NOT_TRANSIENT):
        return False
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(err, aiohttp.ClientResponseError):
        return err.status in _TRANSIENT_HTTP
    if isinstance(err, OSError):  # ConnectionError, TimeoutError, aiohttp.ClientOSError, ...
        return True
    if isinstance(err, asyncio.TimeoutError):  # not an OSError before Python 3.11
        return True
    if aiohttp is not None and isinstance(err, aiohttp.ClientError):  # ClientPayloadError, ...
        return True
    botocore = sys.modules.get("botocore.exceptions")
    return botocore is not None and isinstance(
        err, (botocore.HTTPClientError, botocore.ConnectionError, botocore.IncompleteReadError)
    )
