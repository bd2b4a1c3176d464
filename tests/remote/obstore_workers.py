"""Read a remote output with DataLoader workers in a fresh process; report JSON on stdout.

    python -m tests.remote.obstore_workers URL OPTIONS_JSON WORKERS CONTEXT [--iterate-first]

``OPTIONS_JSON``: ``RemoteOptions`` keywords. With ``--iterate-first`` the process reads the
whole epoch itself first (starting obstore here) before the DataLoader forks its workers.
Reports the sha256 of every (key, bytes) in sorted order, the count, and for each worker
whether it read with obstore (``loader.io.obstore_backend`` started in that very process).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch.utils.data


class Reporting(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """The dataset's samples, then one report of the worker that read them."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __iter__(self) -> Iterator[Any]:
        yield from self.inner
        from loader.io import obstore_backend

        yield {"report": obstore_backend._started_pid == os.getpid(), "pid": os.getpid()}


def main() -> None:
    url, spec, workers, context = sys.argv[1:5]
    from loader import ReadOptions, RemoteOptions, ShardDataset

    ds = ShardDataset(
        url, shuffle=False, read=ReadOptions(remote=RemoteOptions(**json.loads(spec)))
    )
    if "--iterate-first" in sys.argv:
        sum(1 for _ in ds)
    loader = torch.utils.data.DataLoader(
        Reporting(ds), batch_size=None, num_workers=int(workers), multiprocessing_context=context
    )
    got, reports = [], []
    for item in loader:
        if "report" in item:
            reports.append(item["report"])
        else:
            got.append((item["__key__"], bytes(item["bin"])))
    digest = hashlib.sha256()
    for key, data in sorted(got):
        digest.update(key.encode() + b"\0" + data)
    print(json.dumps({"count": len(got), "sha256": digest.hexdigest(), "obstore": reports}))


if __name__ == "__main__":
    main()
