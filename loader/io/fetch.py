"""Fetch backends: one attempt at "these bytes of this object", and which client makes it.

``loader.io.source.Source`` owns the policy (``RETRIES`` attempts with backoff,
each under ``attempt_deadline_s``, errors named with the URL); a backend makes
one attempt within the deadline it is given and raises what ``Source.call``
classifies (``FileNotFoundError``/``PermissionError`` final, ``OSError``
retried). Two backends:

* :class:`FsspecBackend`: fsspec's filesystem for the protocol (s3fs, gcsfs,
  adlfs, http, ...), every request on fsspec's one event-loop thread;
* ``loader.io.obstore_backend.ObstoreBackend``: obstore (Rust), for ``s3://``,
  ``gs://`` and ``az://``, the transfers outside the GIL.

:func:`backend_for` chooses (``RemoteOptions.backend``): ``"auto"`` takes
obstore for its protocols when it is installed, the ``storage_options``
translate and this process may use it (not a fork of a process that did);
fsspec otherwise, with one warning naming why when obstore was installed but
not used. ``"obstore"`` refuses (naming the option) what ``"auto"`` would
fall back from, except in such a forked child, where it reads with fsspec and
warns. ``"fsspec"`` is today's client everywhere.

Reads made while a dataset is set up (the manifest: ``setup=True``) use fsspec
when it can open the protocol, so that the process which will fork DataLoader
workers has not started obstore's threads (tokio does not survive a fork).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import warnings
from typing import Any, Protocol

from loader.io.executor import result_on
from loader.io.options import BACKENDS, RemoteOptions
from shardprep.format.errors import ManifestError
from shardprep.format.storage_options import merge_options

__all__ = [
    "BACKENDS",
    "Backend",
    "FsspecBackend",
    "backend_for",
    "filesystem",
]

log = logging.getLogger(__name__)
_S3 = ("s3", "s3a")
_HTTP = ("http", "https")
_warned: set[str] = set()
LOOP_SLACK_S = 5.0  # beyond an attempt's deadline, for fsspec's loop thread itself to answer


class Backend(Protocol):
    """One attempt at ranged reads of one object, within ``deadline_s`` seconds in all."""

    name: str

    def cat(self, url: str, start: int, stop: int, deadline_s: float) -> bytes | memoryview:
        """Bytes ``[start, stop)`` of ``url``; fewer where it ends, none past its end (a view
        where the client's buffer is handed over without a copy)."""

    def cat_ranges(self, url: str, ranges: list[tuple[int, int]], deadline_s: float) -> list[bytes]:
        """``cat`` of each range, concurrently, within one deadline (they share the link)."""


class FsspecBackend:
    """Ranged reads through fsspec (``filesystem``): ``cat_file`` and ``cat_ranges``."""

    name = "fsspec"

    def __init__(self, protocol: str, root: str, options: RemoteOptions) -> None:
        self.protocol, self.root, self.options = protocol, root, options

    def cat(self, url: str, start: int, stop: int, deadline_s: float) -> bytes:
        fs = filesystem(self.protocol, self.root, self.options)
        try:
            data: bytes = _attempt(fs, "cat_file", deadline_s, url, start=start, end=stop)
        except OSError as err:
            if _past_the_end(err):
                return b""
            raise
        return data

    def cat_ranges(self, url: str, ranges: list[tuple[int, int]], deadline_s: float) -> list[bytes]:
        """One asyncio gather for s3fs, gcsfs, http (``cat_ranges``)."""
        fs = filesystem(self.protocol, self.root, self.options)
        starts, stops = [a for a, _ in ranges], [b for _, b in ranges]
        try:
            data: list[bytes] = _attempt(
                fs, "cat_ranges", deadline_s, [url] * len(ranges), starts, stops, on_error="raise"
            )
        except OSError as err:
            if _past_the_end(err):  # the file is shorter than expected: range by range
                return [self.cat(url, a, b, deadline_s) for a, b in ranges]
            raise
        return data


def backend_for(protocol: str, root: str, options: RemoteOptions, setup: bool = False) -> Backend:
    """The backend that reads ``root`` (see the module docstring).

    Raises:
        ManifestError: ``backend="obstore"`` and obstore is not installed.
        ValueError: ``backend="obstore"`` for a protocol obstore does not read, or with a
            storage option it cannot translate (``UntranslatableOption``, naming it).
    """
    choice = options.backend
    fsspec = FsspecBackend(protocol, root, options)
    if choice == "fsspec":
        return fsspec
    try:
        from loader.io import obstore_backend
    except ImportError as err:
        if choice == "obstore":
            raise ManifestError(
                f"reading {root} with RemoteOptions(backend='obstore') needs obstore: "
                "pip install 'shardprep[obstore]'",
                root,
            ) from err
        return fsspec
    if protocol not in obstore_backend.PROTOCOLS:
        if choice == "obstore":
            raise ValueError(
                f"RemoteOptions(backend='obstore') reads {', '.join(obstore_backend.PROTOCOLS)}"
                f" URLs, not {root}; use backend='auto' or 'fsspec'"
            )
        return fsspec
    if setup and _fsspec_opens(protocol):
        return fsspec  # keep this process free of obstore's threads: it may fork workers
    if not obstore_backend.usable():
        _log_once(
            "fork",
            "obstore was used in the process this one was forked from, and its threads do not "
            "survive a fork: this process reads with fsspec. To read with obstore in DataLoader "
            "workers, do not iterate in the parent before forking them, or use "
            "multiprocessing_context='forkserver' (or 'spawn')",
        )
        return fsspec
    try:
        return obstore_backend.ObstoreBackend(
            protocol,
            _with_fsspec_config(protocol, options.storage_options),
            options.connect_timeout_s,
            options.read_timeout_s,
        )
    except obstore_backend.UntranslatableOption as err:
        if choice == "obstore":
            raise
        _warn_once(f"option {err.key}", f"{root}: {err}; reading with fsspec")
        return fsspec


def filesystem(protocol: str, root: str, options: RemoteOptions) -> Any:
    """The fsspec filesystem for ``protocol`` with the loader's defaults, ``fsspec.config.conf``
    and ``options.storage_options`` (fsspec caches instances per process and options)."""
    try:
        import fsspec
        import fsspec.config
    except ImportError as err:
        extra = "s3" if protocol in _S3 else "remote"  # s3: fsspec + s3fs; remote: + aiohttp
        raise ManifestError(
            f"reading {root} needs fsspec: pip install 'shardprep[{extra}]'", root
        ) from err
    cls = fsspec.get_filesystem_class(protocol)
    if protocol in _S3:
        cls = _one_try_s3(cls)
    protocols = cls.protocol if isinstance(cls.protocol, (tuple, list)) else [cls.protocol]
    merged = default_options(protocol, options)
    for p in protocols:
        merged = merge_options(merged, fsspec.config.conf.get(p, {}))
    return cls(**merge_options(merged, options.storage_options))


def default_options(protocol: str, options: RemoteOptions) -> dict[str, Any]:
    """fsspec options carrying the connect and read timeouts (http(s), s3), one try for s3."""
    connect, read = options.connect_timeout_s, options.read_timeout_s
    if protocol in _HTTP:
        import aiohttp

        timeout = aiohttp.ClientTimeout(
            total=None, connect=connect, sock_connect=connect, sock_read=read
        )
        return {"client_kwargs": {"timeout": timeout}}
    if protocol in _S3:
        # one HTTP attempt per call: RETRIES in Source.call is the only retry policy
        retries = {"total_max_attempts": 1, "mode": "standard"}
        return {
            "config_kwargs": {"connect_timeout": connect, "read_timeout": read, "retries": retries}
        }
    return {}


def _attempt(fs: Any, method: str, deadline_s: float, *args: Any, **kwargs: Any) -> Any:
    """``fs.<method>(*args, **kwargs)``, one attempt within ``deadline_s``.

    An async filesystem's call runs as fsspec's own blocking call runs it (the coroutine
    ``_<method>`` on fsspec's event-loop thread under ``asyncio.wait_for``, which cancels the
    request at the deadline: nothing is left waiting, and ``TimeoutError`` is raised), and is
    also dropped at once when the read-ahead running it is closed (``cancel_on_close``: an
    epoch left midway does not wait for its reads in flight). Other filesystems are called as
    they are."""
    if not getattr(fs, "async_impl", False) or getattr(fs, "asynchronous", False):
        return getattr(fs, method)(*args, **kwargs)
    request = asyncio.wait_for(getattr(fs, f"_{method}")(*args, **kwargs), deadline_s)
    return result_on(fs.loop, request, deadline_s + LOOP_SLACK_S)


def _one_try_s3(cls: Any) -> Any:
    """s3fs's filesystem class with ``retries=1`` (``loader.io.s3client``), or ``cls`` itself when
    another implementation is registered for ``s3://``."""
    import s3fs

    if cls is not s3fs.S3FileSystem:
        return cls
    from loader.io.s3client import OneTryS3FileSystem

    return OneTryS3FileSystem


def _past_the_end(err: OSError) -> bool:
    """A ranged GET that starts past the end of the object (HTTP 416, s3fs's EINVAL)."""
    text = str(err).lower()
    return "range" in text and ("not satisfiable" in text or "416" in text)


@functools.cache
def _fsspec_opens(protocol: str) -> bool:
    """Whether fsspec and its implementation of ``protocol`` (s3fs, gcsfs, adlfs) import."""
    try:
        import fsspec

        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError):
        return False
    return True


def _with_fsspec_config(protocol: str, storage_options: Any) -> dict[str, Any]:
    """``storage_options`` over fsspec's configuration for ``protocol`` (``FSSPEC_S3_*``
    environment variables, fsspec's config files), as fsspec would combine them."""
    try:
        import fsspec.config
    except ImportError:
        return dict(storage_options)
    return merge_options(fsspec.config.conf.get(protocol, {}), storage_options)


def _log_once(reason: str, message: str) -> None:
    """Log a warning once per process and reason (a condition of the process, not of the
    user's options: not a ``warnings`` warning, which test suites turn into errors)."""
    if reason not in _warned:
        _warned.add(reason)
        log.warning("shardprep: %s", message)


def _warn_once(reason: str, message: str) -> None:
    """Warn once per process and reason (every worker of a DataLoader warns once)."""
    if reason in _warned:
        log.info("%s", message)
        return
    _warned.add(reason)
    warnings.warn(f"shardprep: {message}", stacklevel=3)
