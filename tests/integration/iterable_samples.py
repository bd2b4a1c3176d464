"""Deterministic sample dicts for the iterable-input tests, and the child processes they run.

``python -m tests.integration.iterable_samples memory OUT COUNT SIZE`` builds COUNT samples
of SIZE bytes each from a generator and prints JSON: this process's peak RSS before and after
the build (VmHWM) and the peak RSS of its worker processes (``ru_maxrss``), in KiB.

``python -m tests.integration.iterable_samples stall OUT COUNT STALL_AFTER OPTIONS_JSON``
builds ``samples(COUNT)`` with every write worker stalled (as on a hung disk) once it has
read STALL_AFTER samples, for the test that kills it and resumes.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

CLASSES = ("cat", "dog", "eel")  # 50 %, 30 %, 20 % of the samples


def class_of(i: int) -> str:
    """The class name of sample ``i`` (uneven classes, interleaved)."""
    r = i % 10
    return CLASSES[0] if r < 5 else CLASSES[1] if r < 8 else CLASSES[2]


def jpg_of(i: int) -> bytes:
    """Sample ``i``'s binary payload: unique, of varying size."""
    head = f"sample {i};".encode()
    return head + bytes((i * 31 + k) % 251 for k in range(13 * (i % 37) + 1))


def sample(i: int, label: Any = None) -> dict[str, Any]:
    """Sample ``i`` as a WebDataset-style dict: bytes, a dict (JSON) and a str member."""
    return {
        "__key__": f"s{i:05d}",
        "cls": class_of(i) if label is None else label,
        "jpg": jpg_of(i),
        "json": {"index": i, "caption": f"a photo №{i}", "tags": ["x", str(i % 7)]},
        "txt": f"caption {i} ü",
    }


def samples(count: int) -> Iterator[dict[str, Any]]:
    """Samples 0 .. count-1 in key order."""
    for i in range(count):
        yield sample(i)


def _peak_rss_kib() -> int:
    """This process image's peak RSS (VmHWM: unlike ``ru_maxrss``, not carried over from the
    process that exec-ed it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/self/status")


def _memory(out: str, count: int, size: int) -> None:
    import shardprep
    import shardprep.builder
    import shardprep.from_iterable  # noqa: F401 (imported before the first measure)

    def big() -> Iterator[dict[str, Any]]:
        for i in range(count):
            yield {"__key__": f"b{i:05d}", "cls": i % 2, "bin": bytes([i % 251]) * size}

    before = _peak_rss_kib()
    shardprep.build(big(), out, shards=4, workers=2, progress=False)
    after = _peak_rss_kib()
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"before_kib": before, "after_kib": after, "workers_kib": workers}))


def _stall(out: str, count: int, stall_after: int, options: dict[str, Any]) -> None:
    import shardprep
    import shardprep.write as write

    read_members, seen = write._read_members, 0

    def stalling(ref: Any, reader: Any) -> Any:
        nonlocal seen
        seen += 1
        while seen > stall_after:
            time.sleep(3600)  # stalled: the test kills this process tree
        return read_members(ref, reader)

    write._read_members = stalling  # type: ignore[assignment]  # inherited by forked workers
    shardprep.build(samples(count), out, progress=False, **options)


if __name__ == "__main__":
    mode, where, *rest = sys.argv[1:]
    if mode == "memory":
        _memory(where, int(rest[0]), int(rest[1]))
    else:
        _stall(where, int(rest[0]), int(rest[1]), json.loads(rest[2]))
