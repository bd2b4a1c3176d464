"""``tests.s3.Proxy`` in a process of its own, for benchmarks.

The proxy is the simulated link (latency, per-connection pacing): in the driver's process its
event loop shares the GIL with the driver's PSS sampler (``bench.memory``), which reads the
measured process's ``smaps_rollup`` every 20 ms (~10 ms per read of a process that imported
torch, ~1 ms of one that did not), so the link slowed down with the size of the process being
measured. In its own process it paces every system alike.

``with ProxyProcess(upstream_port, latency, bandwidth) as proxy: proxy.endpoint``; the child
(``python -m bench.proxy PORT LATENCY BANDWIDTH``) prints its port, then serves until its
stdin closes (the driver exits, or is killed: the pipe closes with it).
"""

from __future__ import annotations

import subprocess
import sys
from types import TracebackType

from bench.harness import REPO

START_S = 30.0


class ProxyProcess:
    def __init__(self, upstream_port: int, latency: float, bandwidth: float) -> None:
        self._args = [str(upstream_port), repr(latency), repr(bandwidth)]
        self._process: subprocess.Popen[str] | None = None
        self.endpoint = ""

    def __enter__(self) -> ProxyProcess:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.proxy", *self._args],
            cwd=str(REPO),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._process.stdout is not None
        line = self._process.stdout.readline()  # the port, once it listens
        if not line.strip().isdigit():
            self._process.kill()
            raise RuntimeError(f"the proxy process did not start: {line!r}")
        self.endpoint = f"http://127.0.0.1:{int(line)}"
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._process is None:
            return
        assert self._process.stdin is not None
        self._process.stdin.close()
        try:
            self._process.wait(START_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def main() -> int:
    sys.path.insert(0, str(REPO))
    from tests.s3 import Proxy

    port, latency, bandwidth = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    with Proxy(port, latency=latency, bandwidth=bandwidth) as proxy:
        print(proxy.port, flush=True)
        sys.stdin.read()  # until the driver closes it
    return 0


if __name__ == "__main__":
    sys.exit(main())
