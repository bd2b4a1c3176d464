"""Child process of tests/faults/test_mapped_shards.py: a shard changed under a mapped reader.

    python -m tests.faults.mapped_child truncate-while-mapped OUT SHARD
    python -m tests.faults.mapped_child truncate-between OUT SHARD

A touch of a mapped page past a file's new end is SIGBUS, which kills the process: run here,
not in the test process. Prints one line: what the reader handed out or raised.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import sys

from loader.errors import CorruptShardError
from loader.io.ranges import BufferPool
from loader.io.source import Source
from loader.options import ReadOptions
from loader.plan.order import SampleRange
from loader.read.reader import ShardReader


def _reader(out: str) -> ShardReader:
    source = Source(out)
    mapped = os.environ.get("MAPPED_CHILD_MAPS", "1") == "1"  # the test's switch, not the loader's
    return ShardReader(
        source, source.manifest(), pool=BufferPool(), read=ReadOptions(mapped=mapped)
    )


def _kind(data: bytes | memoryview) -> str:
    # a read-only view of an mmap: the shard's pages (the read buffers are writable mmaps)
    mapped = isinstance(data, memoryview) and isinstance(data.obj, mmap.mmap) and data.readonly
    return "mapped" if mapped else "read"


def main() -> None:
    action, out, shard = sys.argv[1], sys.argv[2], int(sys.argv[3])
    reader = _reader(out)
    index = reader.index(shard)
    path = os.path.join(out, reader._manifest.shards[shard].file)
    n = index.num_samples
    if action == "truncate-while-mapped":
        # the whole shard in one chunk, then the file cut to nothing while it is mapped
        chunk = reader.read(SampleRange(shard, 0, n))
        print(_kind(chunk._data), flush=True)
        os.truncate(path, 0)
        digest = hashlib.sha256(chunk._data).hexdigest()  # SIGBUS here when mapped
        print(f"survived {digest}", flush=True)
    elif action == "truncate-between":
        # the first two samples read (mapped), the file then cut inside sample 3, the rest read
        first = reader.read(SampleRange(shard, 0, 2))
        print(_kind(first._data), flush=True)
        os.truncate(path, int(index.sample_offset[3]) + 100)
        try:
            reader.read(SampleRange(shard, 2, n))
        except CorruptShardError as err:
            print(f"raised {err}", flush=True)
        # the first chunk's pages all lie before the cut: still readable, still exact
        print(f"first {[first.sample(j)['__key__'] for j in range(2)]}", flush=True)
    else:
        raise SystemExit(f"unknown action {action}")


if __name__ == "__main__":
    main()
