"""moto's S3 server, with a ranged GET that costs what it serves: the control server of
``python -m bench.remote --server ranged``.

``python -m bench.moto_ranged -H 127.0.0.1 -p PORT`` (the arguments of ``moto.server``).

Stock moto (5.x) answers every GET of an object by reading the whole object out of its
spooled temporary file (``FakeKey.value``: a fresh ``bytes`` of the object's size, ~6.5 ms
of CPU for a 25 MB shard here) and then slicing the requested range out of it. A real object
store's ranged GET costs its client nothing proportional to the object's size, so on the
bench's 2 shared cores stock moto penalises a reader that sends many ranged GETs (shardprep's
read-ahead) against one that sends a few whole-object GETs (the floor).

This module changes one thing: ``FakeKey.value`` is read from the file once per key and kept
(``bytes`` are immutable; setting the value drops the kept copy), so a GET costs moto the
copy of the bytes it serves (the range's slice, as stock) and its fixed per-request work.
Everything else, the range parsing and the response, is moto's own code, so the bytes served
are the bytes stock moto serves (``python -m bench.moto_ranged --check`` compares ranges of one
object against a stock server; the bench's "complete" column counts every sample's bytes).
The kept copies cost the server's process the size of every object it holds (not counted in
the bench's PSS, which is the measured reader's).

A control for the bench, not a model of any store's timing: the proxy still adds the round
trip and paces each connection.
"""

from __future__ import annotations

import sys
from typing import Any

_KEPT = "_bench_value"


def patch() -> None:
    """Make ``FakeKey.value`` read its file once per key (see the module docstring)."""
    from moto.s3.models import FakeKey

    stock = FakeKey.value
    if not isinstance(stock, property) or stock.fget is None or stock.fset is None:
        raise RuntimeError(
            f"moto's FakeKey.value is not the property this patch wraps ({stock!r}); "
            "run bench.remote with --server whole, or update bench/moto_ranged.py"
        )
    read, write = stock.fget, stock.fset

    def get(self: Any) -> bytes:
        kept = self.__dict__.get(_KEPT)
        if kept is None:
            kept = read(self)
            self.__dict__[_KEPT] = kept
        return kept

    def set_(self: Any, value: bytes) -> None:
        self.__dict__.pop(_KEPT, None)
        write(self, value)

    FakeKey.value = property(get, set_)


def check() -> int:
    """Upload one 25 MB object to a stock and to a patched server; compare whole, ranged and
    suffix GETs byte for byte, and print the server's CPU per 8 MiB ranged GET."""
    import os

    import s3fs

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.s3 import S3Server

    size = 25_000_003
    payload = os.urandom(size)
    ranges = [(0, 1), (0, 8 << 20), (5, 9_000_001), (size - 1000, size), (3 << 20, 7 << 20)]
    want = [payload[a:b] for a, b in ranges] + [payload, payload[-10:]]
    for module in ("moto.server", "bench.moto_ranged"):
        with S3Server(module=module) as s3:
            s3.create_bucket("check")
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options())
            fs.pipe_file("check/k", payload)
            got = [fs.cat_file("check/k", start=a, end=b) for a, b in ranges]
            got += [fs.cat_file("check/k"), fs.cat_file("check/k", start=-10)]
            for i, (answer, expected) in enumerate(zip(got, want, strict=True)):
                if answer != expected:
                    print(f"{module}: read {i} differs: {len(answer)} bytes, {len(expected)} sent")
                    return 1
            pid = s3._process.pid  # type: ignore[union-attr]  # (the server's CPU, from /proc)
            before = _cpu(pid)
            for i in range(20):
                fs.cat_file("check/k", start=i << 20, end=(i << 20) + (8 << 20))
            per = (_cpu(pid) - before) / 20 * 1000
            print(f"{module}: {len(want)} reads, same bytes; {per:.1f} ms server CPU per 8 MiB GET")
    return 0


def _cpu(pid: int) -> float:
    """User + system CPU seconds of a process (``/proc/PID/stat``)."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    if sys.argv[1:] == ["--check"]:
        sys.exit(check())
    patch()
    from moto.server import main as serve

    serve()


if __name__ == "__main__":
    main()
