"""One module per measured system; each is imported only inside the subprocess
that measures it, so peers' import cost and memory never leak into another run. A build
imports only what the system's builder needs (shardprep's builder never
imports torch; the peers' writers all do).

Every peer module provides::

    BUILD_IMPORTS, LOAD_IMPORTS: tuple[str, ...]  # modules timed as "import s"
    build(raw, out, meta, params) -> dict       # writes shards into ``out``
    loader(out, batch_size, num_workers, collate, params) -> Iterable[batch]
"""

from __future__ import annotations

PEERS = {
    "shardprep": "bench.peers.shardprep_",
    "webdataset": "bench.peers.webdataset_",
    "mds": "bench.peers.mds",
    "litdata": "bench.peers.litdata_",
}
