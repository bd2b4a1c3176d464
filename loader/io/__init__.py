"""I/O: where a build lives and how its bytes are fetched. No torch.

``source`` (a local folder or a URL: bounded, retried reads), the fetch backends (``fetch``,
``obstore_backend``, ``s3client``), the node's remote-shard cache (``cache``, ``cachedir``),
open shard files and positioned reads (``files``), and the read-ahead that performs a plan's
reads before they are asked for (``readahead``, on the threads of ``executor``), through the ``RangeIO`` seam
and the reused buffers of ``ranges``. Imports ``loader.plan`` (what to read) and nothing above.
"""
