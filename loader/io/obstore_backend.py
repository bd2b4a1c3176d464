"""The obstore fetch backend: ranged GETs of S3, GCS and Azure objects in Rust, outside the GIL.

obstore (``pip install obstore``, the Rust ``object_store`` crate) moves the
bytes on its own tokio threads; Python only starts each request and receives
its finished body. ``loader.io.source.Source`` uses it for ``s3://``, ``gs://`` and
``az://`` data reads when it is installed (``RemoteOptions(backend="auto")``),
behind the same seam and the same policy as fsspec: one HTTP try per attempt
(obstore's own retries are off), ``RETRIES`` attempts in ``Source.call``, and
every attempt cut at its total deadline (``attempt_deadline_s``): the request
runs as a coroutine on this process's event-loop thread under
``asyncio.wait_for``, which drops the Rust future (closing its connection).
``connect_timeout_s`` and ``read_timeout_s`` become obstore's
``connect_timeout`` and ``read_timeout``.

``storage_options`` (fsspec's, as s3fs takes them) are translated by
:func:`translate`; an option it cannot translate raises
:class:`UntranslatableOption` naming it (``Source`` then uses fsspec, with one
warning, or refuses when obstore was asked for by name).

Fork: tokio's threads do not survive ``fork()``; a child of a process that has
used obstore hangs on its first request, whatever store it makes. This module
records the process that started obstore (:func:`usable` is False in its
forked children) so that ``Source`` reads with fsspec there instead. A process
that never made an obstore request forks safely.

Exit: obstore's threads hand every finished request to the loop
(``call_soon_threadsafe``) and check a cancelled one (``Future.cancelled``) with the GIL.
A thread that does so while the interpreter finalizes is stopped by CPython in the
middle of Rust code, which aborts the process (SIGABRT), even after the program printed
its result. So the loop's futures note when obstore's thread is done with them, and at
exit (``atexit``) no request starts any more (a request submitted just before is refused on
the loop thread), the requests in flight are cancelled, and the exit waits, up to
``QUIESCE_S``, until obstore's threads have let go of every one and have left the Python
code they were running when they did (tests/remote/test_obstore_exit.py).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import re
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlsplit

import obstore
from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

from loader.errors import RequestRefusedError
from loader.io.executor import Cancelled, result_on
from shardprep.format.threads import start_thread

__all__ = [
    "ObstoreBackend",
    "PROTOCOLS",
    "UntranslatableOption",
    "translate",
    "usable",
]

T = TypeVar("T")
PROTOCOLS = ("s3", "s3a", "gs", "gcs", "az", "abfs")
LOOP_SLACK_S = 5.0  # beyond an attempt's deadline, for the loop thread itself to answer
QUIESCE_S = 5.0  # at exit: how long to wait for obstore's threads to let go of the requests
# fsspec-only keys with no meaning for a ranged GET: accepted and ignored
_IGNORED = frozenset(
    {
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
        "default_block_size",
        "default_fill_cache",
        "default_cache_type",
        "cache_regions",
    }
)
_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]{1,100})</Code>")
_MESSAGE = re.compile(r"<Message>([^<]{1,300})</Message>")
_TRANSIENT_HTTP = frozenset({408, 425, 429, 500, 502, 503, 504})

_lock = threading.Lock()
_started_pid: int | None = None  # the process that made obstore's first request
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid = 0
_stores: dict[tuple[Any, ...], Any] = {}
_outstanding: set[_Request] = set()  # requests obstore's threads have not let go of yet
_releasers: set[int] = set()  # the threads (obstore's) that let go of a request
_closing = False  # the interpreter is exiting: no new request


class _Request(asyncio.Future[Any]):
    """The future of one obstore request (made by ``_Loop.create_future``): it notes when
    obstore's thread has made its last call into Python for it (the ``cancelled()``
    check of a cancelled request, or the hand-over of its result)."""

    released = False

    def cancelled(self) -> bool:
        cancelled = super().cancelled()
        if cancelled and threading.get_ident() != self.get_loop()._thread_id:  # type: ignore[attr-defined]
            _release(self)  # obstore's thread drops a cancelled request after this check
        return cancelled


class _Loop(asyncio.SelectorEventLoop):
    """This process's obstore loop: its futures are ``_Request``s, and a result handed over
    from obstore's thread releases its request once the hand-over has returned."""

    def create_future(self) -> asyncio.Future[Any]:
        return _Request(loop=self)

    def call_soon_threadsafe(  # type: ignore[override]
        self, callback: Callable[..., object], *args: Any, context: Any = None
    ) -> asyncio.Handle:
        handle = super().call_soon_threadsafe(callback, *args, context=context)
        if threading.get_ident() != self._thread_id:  # type: ignore[attr-defined]
            for arg in args:
                if isinstance(arg, _Request):
                    _release(arg)
        return handle


def _track(future: Awaitable[T]) -> Awaitable[T]:
    """Count ``future`` (an obstore request) as held by obstore's threads until released."""
    if isinstance(future, _Request):
        _outstanding.add(future)
        if future.released:  # released before it was counted (a thread switch in between)
            _outstanding.discard(future)
    return future


def _read_error(future: asyncio.Future[Any]) -> None:
    """Mark ``future``'s error as read: a gather cancelled with its awaiting task (the exit's
    cancel) holds a CancelledError that asyncio would otherwise log as never retrieved."""
    if not future.cancelled():
        future.exception()


def _release(request: _Request) -> None:
    """Called by obstore's thread: its last call into Python for ``request`` (it returns
    from Python soon after: ``_quiesce`` waits for that too)."""
    _releasers.add(threading.get_ident())
    request.released = True
    _outstanding.discard(request)


def _held() -> bool:
    """Whether obstore's threads may still call into Python: a request not released, or a
    thread that released one still running Python code (it would take the GIL back)."""
    running = set(sys._current_frames()) - {threading.get_ident()}
    return bool(_outstanding) or not _releasers.isdisjoint(running)


class UntranslatableOption(ValueError):
    """A ``storage_options`` key the obstore backend has no equivalent for."""

    def __init__(self, key: str, protocol: str) -> None:
        super().__init__(
            f"storage option {key!r} has no obstore equivalent for {protocol}:// "
            f"(see docs/loader.md, Remote outputs); use RemoteOptions(backend='fsspec')"
        )
        self.key = key


def usable() -> bool:
    """Whether obstore can make requests in this process: False in a process forked from one
    that had made obstore requests (their tokio threads are gone; a request would hang)."""
    return _started_pid is None or _started_pid == os.getpid()


def translate(protocol: str, storage_options: Mapping[str, Any]) -> dict[str, Any]:
    """obstore store arguments (``config``, ``client_options``) for fsspec ``storage_options``.

    S3 (s3fs's options): ``key``/``secret``/``token``, ``anon``, ``endpoint_url`` (top level or
    in ``client_kwargs``), ``client_kwargs`` ``region_name``/``aws_*``/``verify``,
    ``config_kwargs`` ``region_name``/``connect_timeout``/``read_timeout``/``retries``
    (ignored: the loader's own policy)/``s3.addressing_style``, ``requester_pays``.
    GCS: ``token="anon"``, ``token=<service account file>``, ``anon``. Azure:
    ``account_name``, ``account_key``, ``sas_token``, ``anon``. fsspec's caching keys are
    ignored. Credentials not given here come from the environment (``AWS_*``,
    ``GOOGLE_*``, ``AZURE_*``), as for fsspec.

    Raises:
        UntranslatableOption: any other key (e.g. ``profile``), naming it.
    """
    kind = _kind(protocol)
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    for key, value in storage_options.items():
        if key in _IGNORED:
            continue
        if kind == "s3":
            _s3_option(key, value, config, client, protocol)
        elif kind == "gcs":
            _gcs_option(key, value, config, protocol)
        else:
            _azure_option(key, value, config, protocol)
    endpoint = str(config.get("endpoint") or _environment_endpoint(kind))
    if endpoint.startswith("http://"):
        client.setdefault("allow_http", True)  # as fsspec's clients: the URL says the scheme
    return {"config": config, "client_options": client}


def _environment_endpoint(kind: str) -> str:
    """The endpoint obstore reads from the environment (``AWS_ENDPOINT_URL``, ...), if any."""
    if kind != "s3":
        return ""
    return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT") or ""


def _kind(protocol: str) -> str:
    if protocol in ("s3", "s3a"):
        return "s3"
    if protocol in ("gs", "gcs"):
        return "gcs"
    if protocol in ("az", "abfs"):
        return "azure"
    raise ValueError(f"obstore backend: no store for {protocol}:// (only {', '.join(PROTOCOLS)})")


def _s3_option(
    key: str, value: Any, config: dict[str, Any], client: dict[str, Any], protocol: str
) -> None:
    simple = {"key": "access_key_id", "secret": "secret_access_key", "token": "session_token"}
    if key in simple:
        if value is not None:
            config[simple[key]] = value
    elif key == "anon":
        if value:
            config["skip_signature"] = True
    elif key == "endpoint_url":
        if value is not None:
            config["endpoint"] = value
    elif key == "requester_pays":
        if value:
            config["request_payer"] = True
    elif key == "retries":
        pass  # s3fs's own retry loop: the loader tries once per attempt anyway
    elif key == "client_kwargs" and isinstance(value, Mapping):
        names = {
            "endpoint_url": "endpoint",
            "region_name": "region",
            "aws_access_key_id": "access_key_id",
            "aws_secret_access_key": "secret_access_key",
            "aws_session_token": "session_token",
        }
        for k, v in value.items():
            if k in names:
                if v is not None:
                    config[names[k]] = v
            elif k == "verify" and v is False:
                client["allow_invalid_certificates"] = True
            elif k == "verify" and v is True:
                pass
            else:
                raise UntranslatableOption(f"client_kwargs.{k}", protocol)
    elif key == "config_kwargs" and isinstance(value, Mapping):
        for k, v in value.items():
            if k == "region_name":
                config["region"] = v
            elif k in ("connect_timeout", "read_timeout"):
                client[k] = timedelta(seconds=float(v))
            elif k == "retries":
                pass  # botocore's retries: the loader tries once per attempt anyway
            elif k == "s3" and isinstance(v, Mapping) and set(v) <= {"addressing_style"}:
                style = v.get("addressing_style", "auto")
                if style == "virtual":
                    config["virtual_hosted_style_request"] = True
                elif style == "path":
                    config["virtual_hosted_style_request"] = False
            else:
                raise UntranslatableOption(f"config_kwargs.{k}", protocol)
    else:
        raise UntranslatableOption(key, protocol)


def _gcs_option(key: str, value: Any, config: dict[str, Any], protocol: str) -> None:
    if key == "anon" or (key == "token" and value == "anon"):
        if value:
            config["skip_signature"] = True
    elif key == "token" and isinstance(value, str) and os.path.isfile(value):
        config["service_account_path"] = value
    else:
        raise UntranslatableOption(key, protocol)


def _azure_option(key: str, value: Any, config: dict[str, Any], protocol: str) -> None:
    simple = {"account_name": "account_name", "account_key": "account_key", "sas_token": "sas_key"}
    if key in simple:
        if value is not None:
            config[simple[key]] = value
    elif key == "anon":
        if value:
            config["skip_signature"] = True
    else:
        raise UntranslatableOption(key, protocol)


class ObstoreBackend:
    """One attempt at a ranged read through obstore (see the module docstring).

    Holds only plain values (picklable); the stores and the event loop live per process.
    """

    name = "obstore"

    def __init__(
        self,
        protocol: str,
        storage_options: Mapping[str, Any],
        connect_timeout_s: float,
        read_timeout_s: float,
    ) -> None:
        self.protocol = protocol
        self._kind = _kind(protocol)
        translated = translate(protocol, storage_options)
        client = {
            "connect_timeout": timedelta(seconds=connect_timeout_s),
            "read_timeout": timedelta(seconds=read_timeout_s),
            # the whole request: cut earlier by the attempt's deadline (asyncio.wait_for)
            "timeout": timedelta(days=1),
            **translated["client_options"],
        }
        self._config: dict[str, Any] = translated["config"]
        self._client: dict[str, Any] = client

    def cat(self, url: str, start: int, stop: int, deadline_s: float) -> memoryview:
        """Bytes ``[start, stop)`` of ``url`` (fewer where the object ends, none past it): a
        read-only view of the body obstore received (not copied)."""
        store, key = self._store(url)
        try:
            return memoryview(
                _run(
                    lambda: _track(obstore.get_range_async(store, key, start=start, end=stop)),
                    deadline_s,
                )
            )
        except Cancelled:
            raise
        except Exception as err:
            if _past_the_end(err):
                return memoryview(b"")
            raise _mapped(err, url, deadline_s) from err

    def cat_ranges(self, url: str, ranges: list[tuple[int, int]], deadline_s: float) -> list[bytes]:
        """``cat`` of every range, each range one GET, all in flight at once (one connection
        each); a range past the end makes it range by range.

        Not ``obstore.get_ranges``: with ``coalesce=0`` it still merges ranges that touch
        (gap 0) into one request, so the adjacent ranges of a cache download went over one
        connection (about 4x slower where each connection is paced)."""
        store, key = self._store(url)

        def get() -> Awaitable[list[Any]]:
            gathered = asyncio.gather(
                *(_track(obstore.get_range_async(store, key, start=a, end=b)) for a, b in ranges)
            )
            gathered.add_done_callback(_read_error)
            return gathered

        try:
            return [bytes(part) for part in _run(get, deadline_s)]
        except Cancelled:
            raise
        except Exception as err:
            if _past_the_end(err):
                return [bytes(self.cat(url, a, b, deadline_s)) for a, b in ranges]
            raise _mapped(err, url, deadline_s) from err

    def _store(self, url: str) -> tuple[Any, str]:
        """This process's store for ``url``'s bucket (made once) and the object's key."""
        parts = urlsplit(url)
        bucket, key = parts.netloc, parts.path.lstrip("/")
        ident: tuple[Any, ...] = (os.getpid(), self._kind, bucket)
        ident += (repr(sorted(self._config.items())), repr(sorted(self._client.items())))
        with _lock:
            store = _stores.get(ident)
            if store is None:
                store = _make_store(self._kind, bucket, self._config, self._client)
                _stores[ident] = store
        return store, key


def _make_store(kind: str, bucket: str, config: dict[str, Any], client: dict[str, Any]) -> Any:
    from obstore.store import AzureStore, GCSStore, S3Store

    # one HTTP try: Source.call's RETRIES is the only retry policy
    arguments: dict[str, Any] = {
        "config": config,
        "client_options": client,
        "retry_config": {"max_retries": 0},
    }
    if kind == "s3":
        return S3Store(bucket, **arguments)
    if kind == "gcs":
        return GCSStore(bucket, **arguments)
    return AzureStore(bucket, **arguments)


def _run(request: Callable[[], Awaitable[T]], deadline_s: float) -> T:
    """The result of ``request()``, awaited on this process's loop thread (obstore's futures
    need a running loop where they are made), cancelled at ``deadline_s``."""
    global _started_pid
    with _lock:
        if _closing:
            raise ConnectionError("the interpreter is exiting: no new obstore request")
        if _started_pid is None:
            _started_pid = os.getpid()
        loop = _process_loop()

    async def bounded() -> T:
        if _closing:  # submitted before the exit began, run after it: no request starts
            raise ConnectionError("the interpreter is exiting: no new obstore request")
        return await asyncio.wait_for(request(), deadline_s)

    # (a read-ahead closed meanwhile, an epoch left midway, drops the request at once)
    return result_on(loop, bounded(), deadline_s + LOOP_SLACK_S)


def _process_loop() -> asyncio.AbstractEventLoop:
    """The event loop of this process's ``shardprep-obstore`` thread (started once)."""
    global _loop, _loop_pid
    if _loop is None or _loop_pid != os.getpid():
        _loop = _Loop()
        _loop_pid = os.getpid()
        thread = threading.Thread(target=_loop.run_forever, name="shardprep-obstore", daemon=True)
        start_thread(thread)
        atexit.register(_quiesce, _loop)
    return _loop


def _quiesce(loop: asyncio.AbstractEventLoop) -> None:
    """At exit: cancel the requests still in flight and wait (up to ``QUIESCE_S``) until
    obstore's threads have let go of every request (see the module docstring)."""
    global _closing
    if _loop_pid != os.getpid() or loop is not _loop:
        return  # a forked child: obstore's threads are not here
    with _lock:
        _closing = True

    async def cancel_all() -> None:
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()

    end = time.monotonic() + QUIESCE_S
    # always: a request may have started but not be counted yet (a thread switch in between)
    # (a loop that does not answer in time: still wait for the threads)
    concurrent.futures.wait([asyncio.run_coroutine_threadsafe(cancel_all(), loop)], QUIESCE_S)
    while _held() and time.monotonic() < end:
        time.sleep(0.002)


def _status(err: BaseException) -> int | None:
    match = _STATUS.search(str(err))
    return int(match.group(1)) if match else None


def _past_the_end(err: BaseException) -> bool:
    """A ranged GET that starts at or past the end of the object (HTTP 416)."""
    return _status(err) == 416


def _detail(err: BaseException) -> str:
    """The server's error code and message when its XML body says them, else the first line."""
    text = str(err)
    code, message = _CODE.search(text), _MESSAGE.search(text)
    if code:
        return f"{code.group(1)}: {message.group(1) if message else ''}".rstrip(": ")
    return text.splitlines()[0][:300] if text else type(err).__name__


def _mapped(err: Exception, url: str, deadline_s: float) -> Exception:
    """``err`` as the exception ``Source.call`` classifies: FileNotFoundError, PermissionError
    and RequestRefusedError are final, ConnectionError and TimeoutError are retried."""
    detail = _detail(err)
    if isinstance(err, FileNotFoundError):
        return FileNotFoundError(f"{url}: no such object ({detail})")
    status = _status(err)
    if isinstance(err, (PermissionDeniedError, UnauthenticatedError)) or status in (401, 403):
        return PermissionError(
            f"{url}: the server refused the credentials or the access (HTTP {status or '403'}: "
            f"{detail}); check the key and secret in RemoteOptions.storage_options or the "
            "AWS_*/GOOGLE_*/AZURE_* environment variables"
        )
    if status is not None and 400 <= status < 500 and status not in _TRANSIENT_HTTP:
        return RequestRefusedError(f"{url}: the server refused the request ({detail})")
    if isinstance(err, TimeoutError):
        return TimeoutError(
            f"no complete answer within the attempt's deadline of {deadline_s:.1f} s"
        )
    return ConnectionError(f"{url}: {detail}")
