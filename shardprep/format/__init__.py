"""The format contract: what a shardprep output is, shared by the builder and the loader.

Everything a reader needs and nothing it does not: the on-disk layout of
shards and their indexes (``shardformat``), the manifest and its validation
(``manifest``), the checksums and tar-header checks (``integrity``), the
deterministic RNG every seeded choice comes from (``rng``), the class-weight
spec (``classweights``), how storage options combine (``storage_options``),
the error tree (``errors``), a worker's tie to its parent (``lifeline``) and the
thread start both sides use (``threads``). The builder writes what these modules
define; the ``loader`` package imports nothing else from ``shardprep``.

Nothing here imports torch, click, tqdm or a builder module; importing it
runs ``shardprep/__init__.py``, which loads the build only when asked.
"""
