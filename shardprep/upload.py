"""Upload: put a finished shard into a URL OUT, its index first, from wherever it was written.

Two callers share :func:`put_shard`: the driver's upload threads
(:class:`~shardprep.destination.RemoteDestination`, shards staged on the driver) and a write
task that runs away from the driver (:class:`ShardUpload`, ``--engine ray``): that task
writes its one shard into a staging folder on its own node (``tempfile``, so the node's
``TMPDIR``), uploads it and removes it, and returns only the shard's record.

The index goes first, so "the shard object exists" implies "its index exists"; each object
is visible under its name only once complete (a PUT, or a multipart upload that s3fs
completes last and aborts on an error; a killed upload's parts stay invisible), so an
object under a final name is always whole.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardprep.format.interface import CLI, Interface
from shardprep.scratch import OwnedFolder
from shardprep.storage import describe_error, open_url
from shardprep.write import ShardRecord

__all__ = ["ShardUpload", "put_shard"]

_filesystems: dict[str, tuple[Any, str]] = {}  # per worker process: one client per OUT
_lock = threading.Lock()


def put_shard(fs: Any, root: str, folder: str, record: ShardRecord) -> None:
    """Upload ``record``'s index, then its shard, from ``folder`` to ``root``; each local file is
    removed once uploaded. Raises the backend's exception as it came."""
    for name in (record.index_file, record.file):
        local = os.path.join(folder, name)
        fs.put_file(local, f"{root}/{name}")
        os.remove(local)


@dataclass(frozen=True)
class ShardUpload:
    """Where a write task puts its shard itself: OUT's URL and its storage options (picklable;
    with Ray, the options, credentials included, travel to the nodes)."""

    url: str
    storage_options: Mapping[str, Any] | None = None
    interface: Interface = CLI  # how a failure's hints name the storage options (the build's)

    def write(self, write: Callable[[str], ShardRecord]) -> ShardRecord:
        """``write(folder)`` writes the shard into a new staging folder on this machine; the
        shard is then uploaded (:func:`put_shard`) and the folder removed.

        Raises:
            UploadError: the upload failed (an ``OSError``, so the write task's error names
                the shard; its errno says whether a retry may help).
        """
        with OwnedFolder("shardprep-staging-") as folder:
            record = write(folder)
            fs, root = self._filesystem()
            try:
                put_shard(fs, root, folder, record)
            except Exception as err:
                raise UploadError(self.url, err, self.interface) from err
        return record

    def _filesystem(self) -> tuple[Any, str]:
        key = json.dumps([self.url, self.storage_options], sort_keys=True, default=repr)
        with _lock:
            if key not in _filesystems:
                fs, path = open_url(self.url, self.storage_options, self.interface)
                _filesystems[key] = (fs, path.rstrip("/"))
            return _filesystems[key]


class UploadError(OSError):
    """A write task's upload into OUT failed; ``errno`` is EACCES for a refusal (credentials,
    permissions, a missing bucket: a retry cannot help), else EIO (may pass)."""

    def __init__(self, url: str, err: BaseException, interface: Interface = CLI) -> None:
        lasting = isinstance(err, PermissionError | FileNotFoundError)
        code = errno.EACCES if lasting else errno.EIO
        super().__init__(code, f"upload into {describe_error(url, err, interface)}")
