"""Source: where a build lives (local folder or URL) and reading its files, with bounded retries.

Local paths and ``file://`` URLs use plain file I/O. Any other URL
(``http(s)://``, ``s3://``, ...) goes through fsspec, which must be installed
(``pip install "shardprep[remote]"``, plus s3fs for S3). Transient errors are
retried a few times with backoff; a missing file is not transient.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import BinaryIO, TypeVar

from shardprep.errors import ManifestError
from shardprep.manifest import Manifest, parse_manifest
from shardprep.shardformat import MANIFEST_NAME

__all__ = ["Source"]

T = TypeVar("T")
RETRIES = 3
BACKOFF_S = 0.5
_NOT_TRANSIENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


class Source:
    """Read access to the files of one shardprep output. Holds no open files (picklable)."""

    def __init__(self, root: str) -> None:
        self.root = root[len("file://") :] if root.startswith("file://") else root
        self.remote = "://" in self.root

    def path(self, name: str) -> str:
        """Full path or URL of file ``name`` of the output."""
        return f"{self.root.rstrip('/')}/{name}" if self.remote else os.path.join(self.root, name)

    def open(self, name: str) -> BinaryIO:
        """Open file ``name`` for binary reading (seekable)."""
        if not self.remote:
            return open(self.path(name), "rb", buffering=0)  # noqa: SIM115 - caller closes
        try:
            import fsspec
        except ImportError as err:
            raise ManifestError(
                f"reading {self.root} needs fsspec: pip install 'shardprep[remote]'", self.root
            ) from err
        return fsspec.open(self.path(name), "rb").open()  # type: ignore[no-any-return]

    def read_bytes(self, name: str) -> bytes:
        """The whole content of file ``name``."""

        def read() -> bytes:
            with self.open(name) as f:
                return f.read()

        return retry(read, self.path(name))

    def manifest(self) -> Manifest:
        """Read and validate the output's manifest.

        Raises:
            ManifestError: missing (the build did not finish) or invalid.
        """
        try:
            data = self.read_bytes(MANIFEST_NAME)
        except FileNotFoundError as err:
            raise ManifestError(
                f"{self.path(MANIFEST_NAME)}: no manifest; is this a finished shardprep "
                "output? (run shardprep build, or --resume an interrupted one)",
                self.path(MANIFEST_NAME),
            ) from err
        return parse_manifest(data, self.path(MANIFEST_NAME))


def retry(action: Callable[[], T], what: str, attempts: int = RETRIES) -> T:
    """Run ``action``; on a transient OSError try again (``attempts`` in all), then re-raise."""
    for attempt in range(attempts):
        try:
            return action()
        except _NOT_TRANSIENT:
            raise
        except OSError:
            if attempt == attempts - 1:
                raise
            time.sleep(BACKOFF_S * 2**attempt)
    raise AssertionError(f"unreachable: {what}")  # pragma: no cover
