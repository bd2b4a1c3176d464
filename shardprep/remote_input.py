"""Remote input: the sizes (at scan time) and payloads (at write time) of listed URLs.

A listing may name objects by URL (``s3://bucket/img/0001.jpg``); they are read through
fsspec with the build's ``storage_options`` (see :mod:`shardprep.storage`).

- Sizes: one listing request per folder that holds many of the listed objects (S3 lists
  1,000 objects per request), else one ``info`` per object; both run ``SIZE_THREADS``
  at a time.
- Labels: :func:`read_heads` reads the first bytes of many small objects (a keyed prefix's
  ``.cls`` parts) with one concurrent ``cat_ranges`` call per ``BATCH_PARTS``.
- Payloads: a writer asks for a shard's parts in order; :class:`RemoteParts` fetches the next
  batch of them (up to ``BATCH_BYTES`` and ``BATCH_PARTS``) with one ``cat_ranges`` call, which
  async backends such as s3fs run concurrently, and fetches the batch after it in a
  background thread while the writer copies the current one: at most two batches
  (``2 * BATCH_BYTES`` plus one part larger than that) are in memory per writer. Every read
  is bounded: a whole-object part is requested as the byte range ``[0, size + 1)`` of its
  scanned size, so an object that grew is detected without reading it whole; a member of a
  remote tar as exactly its range ``[offset, offset + size)`` (from the tar scan).
"""

from __future__ import annotations

import errno
import posixpath
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from shardprep.storage import describe_error, open_url

__all__ = ["BATCH_BYTES", "BATCH_PARTS", "RemoteParts", "read_heads", "remote_sizes"]

SIZE_THREADS = 16
LIST_FOLDER_AT = 32  # list a folder instead of one info per object from this many objects in it
BATCH_BYTES = 32 << 20
BATCH_PARTS = 256


def remote_sizes(
    urls: Sequence[str], storage_options: Mapping[str, Any] | None
) -> list[int | OSError]:
    """The size in bytes of each object in ``urls`` (all of one filesystem), or the error
    that says why not (an ``OSError`` whose message names the URL)."""
    if not urls:
        return []
    fs, _ = open_url(urls[0], storage_options)
    paths = [fs._strip_protocol(u) for u in urls]
    by_folder: dict[str, list[int]] = {}
    for i, path in enumerate(paths):
        by_folder.setdefault(posixpath.dirname(path), []).append(i)
    sizes: list[int | OSError | None] = [None] * len(urls)

    def from_listing(folder: str) -> None:
        try:
            listed = {e["name"]: e for e in fs.ls(folder, detail=True)}
        except FileNotFoundError:
            listed = {}
        for i in by_folder[folder]:
            entry = listed.get(paths[i])
            if entry is not None and entry.get("type") == "file":
                sizes[i] = int(entry["size"])
        for i in by_folder[folder]:  # not listed as a file: ask for it, for the exact error
            if sizes[i] is None:
                one(i)

    def one(i: int) -> None:
        try:
            info = fs.info(paths[i])
            if info.get("type") != "file":
                raise IsADirectoryError(f"{urls[i]}: not a file")
            sizes[i] = int(info["size"])
        except OSError as err:
            sizes[i] = OSError(err.errno, describe_error(urls[i], err))
        except Exception as err:  # a backend's own transport error, not an OSError
            sizes[i] = OSError(describe_error(urls[i], err))

    tasks: list[Callable[[], None]] = []
    for folder, members in by_folder.items():
        if len(members) >= LIST_FOLDER_AT:
            tasks.append(lambda folder=folder: from_listing(folder))  # type: ignore[misc]
        else:
            tasks.extend(lambda i=i: one(i) for i in members)  # type: ignore[misc]
    with ThreadPoolExecutor(SIZE_THREADS, thread_name_prefix="shardprep-size") as pool:
        for future in [pool.submit(task) for task in tasks]:
            future.result()
    return [
        s if s is not None else OSError(f"{u}: no size") for s, u in zip(sizes, urls, strict=True)
    ]


def read_heads(
    urls: Sequence[str], limit: int, storage_options: Mapping[str, Any] | None
) -> list[bytes | OSError]:
    """The first ``limit`` bytes of each object in ``urls`` (all of one filesystem), or the
    error that says why not (an ``OSError`` whose message names the URL)."""
    if not urls:
        return []
    fs, _ = open_url(urls[0], storage_options)
    found: list[bytes | OSError] = []
    for lo in range(0, len(urls), BATCH_PARTS):
        batch = list(urls[lo : lo + BATCH_PARTS])
        try:
            data = fs.cat_ranges(
                [fs._strip_protocol(u) for u in batch],
                [0] * len(batch),
                [limit] * len(batch),
                on_error="return",
            )
        except Exception as err:  # the whole call failed: every object gets the error
            data = [err] * len(batch)
        for url, item in zip(batch, data, strict=True):
            if isinstance(item, BaseException):
                found.append(OSError(getattr(item, "errno", None), describe_error(url, item)))
            else:
                found.append(bytes(item))
    return found


class RemoteParts:
    """The payloads of one shard's remote parts, fetched ahead in batches (see module doc)."""

    def __init__(
        self,
        parts: Sequence[tuple[str, int] | tuple[str, int, int]],
        storage_options: Mapping[str, Any] | None,
    ) -> None:
        # (url, size[, tar data offset]) in the order the writer reads them; kept as
        # (url, offset, size), offset -1 for a whole object
        self._parts = [(p[0], p[2] if len(p) > 2 else -1, p[1]) for p in parts]
        self._options = storage_options
        self._fs: Any = None
        self._next = 0  # first part not yet requested
        self._ready: dict[int, bytes | BaseException] = {}
        self._position = 0  # the part the writer reads next
        self._pending: Future[dict[int, bytes | BaseException]] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _batch(self) -> list[int]:
        start, total, end = self._next, 0, self._next
        while end < len(self._parts) and end - start < BATCH_PARTS:
            if end > start and total + self._parts[end][2] > BATCH_BYTES:
                break
            total += self._parts[end][2]
            end += 1
        self._next = end
        return list(range(start, end))

    def _fetch(self, batch: list[int]) -> dict[int, bytes | BaseException]:
        if self._fs is None:
            with self._lock:
                if self._fs is None:
                    self._fs, _ = open_url(self._parts[0][0], self._options)
        fs = self._fs
        # an empty tar member is not fetched: a zero-length range is not a valid request
        fetched = [i for i in batch if self._parts[i][1] < 0 or self._parts[i][2]]
        starts: list[int | None] = []
        ends: list[int | None] = []
        for i in fetched:
            _url, offset, size = self._parts[i]
            if offset >= 0:  # a member of a tar: exactly its bytes
                starts.append(offset)
                ends.append(offset + size)
            else:  # a whole object: one byte more tells an object that grew
                starts.append(0 if size else None)
                ends.append(size + 1 if size else None)
        try:
            data = fs.cat_ranges(
                [fs._strip_protocol(self._parts[i][0]) for i in fetched],
                starts,
                ends,
                on_error="return",
            )
        except Exception as err:  # the whole call failed: every part gets the error
            data = [err] * len(fetched)
        got: dict[int, bytes | BaseException] = dict.fromkeys(batch, b"")
        got.update(zip(fetched, data, strict=True))
        return got

    def _schedule(self) -> None:
        if self._pending is None and self._next < len(self._parts):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardprep-fetch")
            self._pending = self._pool.submit(self._fetch, self._batch())

    def read(self, url: str, size: int, offset: int = -1) -> bytes:
        """The bytes of part ``url`` at ``offset`` (-1: the whole object), the next in order.

        Raises:
            OSError: the object could not be read or has another size; naming the URL.
        """
        position = self._position
        if position >= len(self._parts) or self._parts[position][:2] != (url, offset):
            raise RuntimeError(f"{url}: read out of order")  # a caller bug, not the data's
        self._position += 1
        if position not in self._ready:
            self._schedule()
            assert self._pending is not None
            self._ready.update(self._pending.result())
            self._pending = None
        self._schedule()  # the next batch, while the writer copies this one
        data = self._ready.pop(position)
        if isinstance(data, BaseException):  # the caller prefixes the URL
            what = describe_error(url, data).removeprefix(f"{url}: ")
            raise OSError(getattr(data, "errno", None) or errno.EIO, what) from data
        if len(data) != size:
            now = f"more than {size}" if len(data) > size else str(len(data))
            raise OSError(errno.EIO, f"size changed since the scan ({size} -> {now} bytes)")
        return bytes(data)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
