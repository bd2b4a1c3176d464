"""The S3 filesystem the loader reads with: s3fs's, trying each call once.

s3fs retries a call that timed out or was cut short ``S3FileSystem.retries``
times (a class attribute, 5), and ``cat_file`` nests two such loops (up to 25
tries of one read), each try of which botocore may retry again. The loader
has one retry policy of its own (``loader.io.source``: ``RETRIES`` attempts with
backoff, each under a total deadline), so here s3fs tries once. ``retries`` is
also a keyword here, so a user can still ask for more in ``storage_options``.

Imported only for ``s3://`` URLs (s3fs is an optional dependency). A class of
its own keeps fsspec's instance cache apart from plain ``S3FileSystem``
instances, and, defined at module level, pickles by reference.
"""

from __future__ import annotations

from typing import Any

import s3fs

__all__ = ["OneTryS3FileSystem"]


class OneTryS3FileSystem(s3fs.S3FileSystem):  # type: ignore[misc]  # s3fs has no type hints
    """``s3fs.S3FileSystem`` with ``retries=1`` unless told otherwise."""

    retries = 1

    def __init__(self, *args: Any, retries: int = 1, **kwargs: Any) -> None:
        if retries < 1:
            raise ValueError(f"retries must be at least 1 (one try), not {retries}")
        super().__init__(*args, **kwargs)
        self.retries = retries
