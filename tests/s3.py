"""A real S3-compatible server on 127.0.0.1 for tests and benchmarks, and a TCP proxy that
makes loopback behave like a remote region (latency, per-connection bandwidth) or a bad one
(connections cut mid-body, answers held back until the client gives up).

``S3Server`` runs moto's server mode (``moto[server]``) as a child process in its own
session; ``stop()`` SIGKILLs the whole session, and every wait has a deadline. ``Proxy`` runs
an asyncio loop in a daemon thread; ``stop()`` closes its listener and every open connection.

    with S3Server() as s3, Proxy(s3.port, latency=0.02, bandwidth=100e6) as proxy:
        s3.create_bucket("data")
        options = s3.storage_options(endpoint=proxy.endpoint)
        fs = fsspec.filesystem("s3", **options)

Any credentials work against moto; ``storage_options()`` gives fixed dummy ones and
``environment()`` the same as the AWS variables boto reads, for child processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from types import TracebackType
from typing import Any

__all__ = ["Proxy", "S3Server", "free_port"]

_KEY = "testing"
_REGION = "us-east-1"
_METHODS = frozenset({b"GET", b"HEAD", b"PUT", b"POST", b"DELETE"})


def _die_with_parent() -> None:
    """In the server's child process: SIGKILL it when its parent dies, even by SIGKILL (a
    killed pytest runs no teardown; the server is in a session of its own)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """moto's S3 server in a child process on 127.0.0.1 (``module``: the ``python -m`` module
    that serves it, ``moto.server`` or a wrapper that takes its arguments, e.g. the bench's
    control server ``bench.moto_ranged``)."""

    def __init__(self, start_timeout: float = 30.0, module: str = "moto.server") -> None:
        self.port = free_port()
        self.module = module
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._start_timeout = start_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def start(self) -> S3Server:
        # stderr goes to a file: werkzeug logs every request there, and a pipe nobody reads
        # fills up after a few hundred requests and blocks the server
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self._process = subprocess.Popen(
            [sys.executable, "-m", self.module, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + self._start_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._log.seek(0)
                err = self._log.read().decode(errors="replace")
                raise RuntimeError(
                    f"moto server exited with {self._process.returncode}: {err[-2000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1):
                    return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)  # polling a child's readiness, bounded by the deadline
        self.stop()
        raise RuntimeError(
            f"moto server did not answer on {self.endpoint} within {self._start_timeout} s"
        )

    def stop(self) -> None:
        if self._process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait(timeout=30)
        self._log.close()
        self._process = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def reset(self) -> None:
        """Forget every bucket and object (moto's reset endpoint)."""
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=10):
            pass

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        """fsspec/s3fs ``storage_options`` for this server (or a proxy in front of it)."""
        return {
            "key": _KEY,
            "secret": _KEY,
            "client_kwargs": {"endpoint_url": endpoint or self.endpoint, "region_name": _REGION},
        }

    def environment(self, endpoint: str | None = None) -> dict[str, str]:
        """Environment variables that point boto-based clients at this server."""
        return {
            "AWS_ACCESS_KEY_ID": _KEY,
            "AWS_SECRET_ACCESS_KEY": _KEY,
            "AWS_DEFAULT_REGION": _REGION,
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
        }

    def create_bucket(self, name: str) -> None:
        import s3fs  # the tests' extra

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())
        fs.call_s3(
            "create_bucket", Bucket=name
        )  # mkdir would send a LocationConstraint moto refuses for us-east-1


class Proxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream_port``.

    ``latency`` seconds are added before every client→server chunk (one request, in
    practice), server→client bytes are paced at ``bandwidth`` bytes/s per connection
    (None: unpaced), ``requests`` records every request line it forwards, and ``cut_next(n, after)`` closes the next ``n`` connections that carry
    more than ``after`` bytes server→client right after those bytes (a body cut mid-transfer),
    and ``stall(match)`` holds back the answer to every request whose request line ``match``
    accepts until the client closes that connection (``stalled``: such requests seen,
    ``abandoned``: their connections the client closed; ``wait_for`` waits for a count).
    """

    def __init__(
        self, upstream_port: int, latency: float = 0.0, bandwidth: float | None = None
    ) -> None:
        self.upstream_port = upstream_port
        self.latency = latency
        self.bandwidth = bandwidth
        self.port = 0
        self.connections = 0
        self.cuts = 0
        self.requests: list[str] = []  # "GET /bucket/key?query" per request, in arrival order
        self.stalled = 0
        self.abandoned = 0
        self._stall: Callable[[str], bool] | None = None
        self._changed = threading.Condition()
        self._cut_budget = 0
        self._cut_after = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="s3-proxy")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut_next(self, n: int, after: int) -> None:
        with self._lock:
            self._cut_budget = n
            self._cut_after = after

    def stall(self, match: Callable[[str], bool] | None) -> None:
        """Hold back the answers to requests whose line (``"GET /bucket/key?query"``) ``match``
        accepts, from now on (None: none)."""
        self._stall = match

    def wait_for(self, counter: str, n: int, timeout: float) -> bool:
        """Whether ``counter`` (``"stalled"`` or ``"abandoned"``) reached ``n`` within ``timeout``."""
        with self._changed:
            return self._changed.wait_for(lambda: getattr(self, counter) >= n, timeout)

    def _count(self, counter: str) -> None:
        with self._changed:
            setattr(self, counter, getattr(self, counter) + 1)
            self._changed.notify_all()

    def start(self) -> Proxy:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._listen(), self._loop)
        self.port = future.result(timeout=10)
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def _listen(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _close(self) -> None:
        """Stop listening and end every connection: their tasks cancelled and awaited, so that
        nothing is left to the collector once the loop is closed (an open ``StreamWriter`` or
        a pending task then warns, in whichever later test collects it)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        for _ in range(100):  # (connections accepted before the close start theirs meanwhile)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if not tasks:
                break
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.sleep(0)  # their connection_made callbacks run: see the next round

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(client_w)
        tasks: list[asyncio.Future[None]] = []
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.close()
            self._writers.discard(client_w)
            return
        self._writers.add(server_w)
        try:
            held = asyncio.Event()  # the answer to this connection's request is held back (stall)
            up = asyncio.ensure_future(self._upstream(client_r, server_w, held))
            down = asyncio.ensure_future(self._downstream(server_r, client_w, held))
            tasks += [up, down]
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            if held.is_set() and up.done():  # the client closed while its answer was held
                self._count("abandoned")
        finally:
            for task in tasks:
                task.cancel()
            for writer in (client_w, server_w):
                writer.close()
                self._writers.discard(writer)

    async def _upstream(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, held: asyncio.Event
    ) -> None:
        while data := await reader.read(65536):
            method, _, rest = data[:2048].partition(b" ")
            if method in _METHODS:  # a chunk that starts a request (aiohttp does not pipeline)
                line = f"{method.decode()} {rest.split(b' ', 1)[0].decode()}"
                with self._lock:
                    self.requests.append(line)
                match = self._stall
                if match is not None and match(line):
                    held.set()
                    self._count("stalled")
            if self.latency:
                await asyncio.sleep(self.latency)
            writer.write(data)
            await writer.drain()

    async def _downstream(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, held: asyncio.Event
    ) -> None:
        sent = 0
        while data := await reader.read(65536):
            if held.is_set():  # stalled: nothing more reaches the client (it gives up first)
                await asyncio.Future()
            if sent + len(data) > self._cut_after and self._take_cut():
                writer.write(data[: max(0, self._cut_after - sent)])
                await writer.drain()
                return  # the caller closes both sides: the body ends early
            writer.write(data)
            await writer.drain()
            sent += len(data)
            if self.bandwidth:
                await asyncio.sleep(len(data) / self.bandwidth)

    def _take_cut(self) -> bool:
        with self._lock:
            if self._cut_budget <= 0:
                return False
            self._cut_budget -= 1
            self.cuts += 1
            return True
