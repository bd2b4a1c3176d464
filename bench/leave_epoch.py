"""How long leaving a remote epoch midway takes: the time from the loop's ``break`` to going on.

``python -m bench.leave_epoch [--samples 6000] [--bandwidth-mbs 2] [--workers 0] [--backend auto]``

The scenario of ``bench.remote`` (shardprep's build of ``images``, 16 shards, in moto behind
``tests.s3.Proxy``: 20 ms per request, ``--bandwidth-mbs`` per connection), read as
``ShardDataset(batch_size=64)`` + ``DataLoader(batch_size=None, num_workers=W)``. Each round
takes the first batch of a new epoch, then drops the DataLoader's iterator (and collects it):
the second time printed is that drop, which is all a training loop waits when it leaves an epoch
(``break``, ``limit_train_batches``) while the read-ahead has requests in flight.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

from bench.build import BY_NAME, ensure_built
from bench.harness import DEFAULT_WORK, REPO, Config, log

SHARDS = 16


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.leave_epoch", description=__doc__)
    p.add_argument("--samples", type=int, default=6000)
    p.add_argument("--bandwidth-mbs", type=float, default=2.0)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--backend", choices=("auto", "obstore", "fsspec"), default="auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    cfg = Config.make(False, a.work_dir, 1, "")
    out = ensure_built(cfg, "images", a.samples, BY_NAME["shardprep w1"], SHARDS)
    sys.path.insert(0, str(REPO))
    import fsspec
    from torch.utils.data import DataLoader

    from loader import ReadOptions, RemoteOptions, ShardDataset
    from tests.s3 import Proxy, S3Server

    with (
        S3Server() as s3,
        Proxy(s3.port, latency=0.02, bandwidth=a.bandwidth_mbs * 1e6) as proxy,
    ):
        s3.create_bucket("bench")
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
        fs.put(str(out), "bench/shardprep", recursive=True)
        os.environ["AWS_ALLOW_HTTP"] = "true"
        remote = RemoteOptions(
            storage_options=s3.storage_options(proxy.endpoint), backend=a.backend
        )
        ds = ShardDataset("s3://bench/shardprep", batch_size=64, read=ReadOptions(remote=remote))
        for round_ in range(a.repeats):
            ds.set_epoch(round_)
            started = time.perf_counter()
            batches = iter(DataLoader(ds, batch_size=None, num_workers=a.workers))
            next(batches)
            first = time.perf_counter()
            del batches
            gc.collect()
            left = time.perf_counter()
            log(
                f"round {round_ + 1}/{a.repeats}: workers {a.workers}, {a.backend}, "
                f"{a.bandwidth_mbs:g} MB/s per connection: first batch {first - started:.2f} s, "
                f"leaving the epoch {left - first:.2f} s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
