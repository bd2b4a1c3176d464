"""Cache: whole remote shards (and their indexes) kept in a local folder, shared by a node.

``RemoteOptions(cache_dir=..., cache_limit=...)`` turns it on. The unit is a
whole file, as LitData and MosaicML Streaming do: a file is either complete
and verified or absent, it is checked against what the manifest already
holds for it (size and sha256), eviction deletes whole files, and no
shared state exists besides the files and their locks.

Safety rules (every worker and rank of one node may share the folder):

* **One download per file.** ``<name>.lock`` is taken with ``fcntl.flock``
  (exclusive) around "is it there? else download it"; a second process
  waits for the first, then finds the file. flock locks die with their
  process, so a crash leaves no stale lock and no shared memory.
* **Never a half-written file.** A download goes to a hidden temporary
  ``.<name>.<pid>.<n>.part`` (created at its final size, exclusively
  locked while written), is checked (size, then the manifest's sha256) and
  only then renamed over ``<name>`` (``os.replace``, atomic). A file of the
  wrong size found under the final name is deleted and downloaded again.
* **Pinned files are never evicted.** A reader holds a shared flock on
  each cached file it reads from. Eviction (under ``.evict.lock``) deletes
  least-recently-used files (by mtime, which every use refreshes) until the
  new file fits under ``cache_limit``; a file is only deleted while the
  evictor holds its ``.lock`` and an exclusive flock on it, so a file being
  read or being checked is skipped. ``.part`` files whose writer died
  (their lock is free) are deleted too; live ones count at full size.
* **Never over the limit.** Room is made, and the ``.part`` file created at
  full size, in one step under ``.evict.lock``, so the folder's bytes stay
  within ``cache_limit`` at every moment. If room cannot be made (everything
  else pinned), the data is streamed without caching for that read.

A ``cache_limit`` smaller than the largest shard cannot cache anything:
``for_output`` warns once and the loader streams without the cache.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import logging
import os
import time
import warnings
from collections.abc import Iterator
from typing import BinaryIO

from loader.source import Source
from shardprep.errors import ChecksumMismatchError
from shardprep.manifest import Manifest, ShardEntry

__all__ = ["ShardCache", "cache_bytes"]

log = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 600.0
DOWNLOAD_PARALLEL = 4  # ranged GETs of one file in flight (memory: 4 x request_bytes)  # waiting for another process's download of the same file
PART = ".part"
LOCK = ".lock"
EVICT_LOCK = ".evict.lock"
_counter = itertools.count()


class ShardCache:
    """The cache folder of one output: ``cache_dir/<hash of URL and manifest>/<file>``."""

    lock_timeout_s = LOCK_TIMEOUT_S

    def __init__(self, source: Source, manifest: Manifest, cache_dir: str, limit: int | None):
        self._source = source
        self.root = cache_dir
        self.limit = limit
        key = hashlib.sha256(f"{source.root}\n{manifest.fingerprint}".encode()).hexdigest()[:16]
        self.folder = os.path.join(cache_dir, key)  # a rebuilt output gets a new folder
        self._request_bytes = source.options.request_bytes

    @classmethod
    def for_output(cls, source: Source, manifest: Manifest) -> ShardCache | None:
        """The cache configured in ``source.options``, or None when its limit cannot hold a shard."""
        options = source.options
        if options.cache_dir is None:
            return None
        limit = options.cache_limit
        largest = max((s.num_bytes + s.index_bytes for s in manifest.shards), default=0)
        if limit is not None and limit < largest:
            warnings.warn(
                f"RemoteOptions.cache_limit={limit} bytes is smaller than the largest shard of "
                f"{source.root} ({largest} bytes with its index): streaming without the cache "
                f"in {options.cache_dir}; raise cache_limit to cache",
                stacklevel=2,
            )
            return None
        return cls(source, manifest, options.cache_dir, limit)

    # --- public -----------------------------------------------------------------

    def open(self, entry: ShardEntry) -> BinaryIO | None:
        """The cached shard file of ``entry``, open and pinned (shared lock) until closed.

        Downloads it first if needed. None if room cannot be made under the limit.

        Raises:
            ChecksumMismatchError: the downloaded file is not the one the manifest lists.
            TimeoutError: another process held the file's lock for ``LOCK_TIMEOUT_S``.
        """
        return self._acquire(entry.file, entry.num_bytes, entry.sha256)

    def read_index(self, entry: ShardEntry) -> bytes | None:
        """The index file of ``entry`` through the cache (None: no room; read it directly)."""
        f = self._acquire(entry.index_file, entry.index_bytes, entry.index_sha256)
        if f is None:
            return None
        with f:
            return f.read(entry.index_bytes + 1)

    # --- acquire ----------------------------------------------------------------

    def _acquire(self, name: str, size: int, sha256: str) -> BinaryIO | None:
        os.makedirs(self.folder, exist_ok=True)
        final = os.path.join(self.folder, name)
        with _locked(final + LOCK, self.lock_timeout_s):
            pinned = self._open_pinned(final, size)
            if pinned is not None:
                return pinned
            part = self._reserve(name, size)
            if part is None:
                log.info("cache %s is full of pinned files; streaming %s uncached", self.root, name)
                return None
            try:
                self._download(name, part, size, sha256)
                # under the evict lock: a scan never sees the file under neither (or both) names
                with _locked(os.path.join(self.root, EVICT_LOCK), self.lock_timeout_s):
                    os.replace(part.name, final)
            finally:
                part.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part.name)
            pinned = self._open_pinned(final, size)
            if pinned is None:  # pragma: no cover - we hold its lock: nobody can remove it
                raise RuntimeError(f"{final}: vanished right after it was cached")
            return pinned

    @staticmethod
    def _open_pinned(final: str, size: int) -> BinaryIO | None:
        """``final`` opened with a shared lock if it is there and complete (caller holds its .lock)."""
        try:
            f = open(final, "rb", buffering=0)  # noqa: SIM115 - returned open
        except FileNotFoundError:
            return None
        try:
            actual = os.fstat(f.fileno()).st_size
            if actual != size:
                log.warning(
                    "cache: %s has %d bytes, not %d; downloading it again", final, actual, size
                )
                os.unlink(final)
                f.close()
                return None
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)  # never waits: evictors hold .lock first
            os.utime(final)  # least recently used = oldest mtime
        except BaseException:
            f.close()
            raise
        return f

    def _reserve(self, name: str, size: int) -> BinaryIO | None:
        """Make room for ``size`` bytes and create the locked ``.part`` file at that size."""
        with _locked(os.path.join(self.root, EVICT_LOCK), self.lock_timeout_s):
            if self.limit is not None and not self._make_room(size):
                return None
            path = os.path.join(self.folder, f".{name}.{os.getpid()}.{next(_counter)}{PART}")
            f = open(path, "w+b")  # noqa: SIM115 - returned open
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
                os.ftruncate(f.fileno(), size)
            except BaseException:
                f.close()
                os.unlink(path)
                raise
            return f

    def _make_room(self, size: int) -> bool:
        """Delete unpinned files, least recently used first, until ``size`` more bytes fit."""
        assert self.limit is not None
        files = []
        total = 0
        for path, st in _files(self.root):
            if path.endswith(PART) and _try_remove_dead_part(path):
                continue
            total += st.st_size
            if not path.endswith(PART):
                files.append((st.st_mtime_ns, path, st.st_size))
        for _, path, nbytes in sorted(files):
            if total + size <= self.limit:
                break
            if _try_evict(path):
                total -= nbytes
        return total + size <= self.limit

    def _download(self, name: str, part: BinaryIO, size: int, sha256: str) -> None:
        """Fill ``part`` with the remote file in ranged GETs; check its size and sha256."""
        digest = hashlib.sha256()
        step = self._request_bytes
        # ranged GETs of request_bytes, DOWNLOAD_PARALLEL at a time; the last asks for one more
        # byte than the manifest says, to notice a file that grew
        ranges = [(a, min(a + step, size)) for a in range(0, size, step)]
        if ranges:
            ranges[-1] = (ranges[-1][0], size + 1)
        offset = 0  # bytes of the file seen so far (one more than size: it grew)
        for i in range(0, len(ranges), DOWNLOAD_PARALLEL):
            batch = ranges[i : i + DOWNLOAD_PARALLEL]
            ended = False
            for (start, stop), data in zip(
                batch, self._source.fetch_ranges(name, batch), strict=True
            ):
                kept = data[: max(0, size - start)]  # never past the manifest's size
                os.pwrite(part.fileno(), kept, start)
                digest.update(kept)
                offset = start + len(data)
                if len(data) < stop - start:  # the file ends here
                    ended = True
                    break
            if ended:
                break
        url = self._source.path(name)
        if offset != size:
            raise ChecksumMismatchError(
                f"{url}: has {'fewer' if offset < size else 'more'} bytes than the {size} its "
                "manifest lists; not cached. The output changed after its manifest was written: "
                "rebuild it",
                url,
            )
        if digest.hexdigest() != sha256:
            raise ChecksumMismatchError.for_file(url, sha256, digest.hexdigest())


def cache_bytes(cache_dir: str) -> int:
    """Bytes of every file in ``cache_dir`` (cached files and downloads in progress; not locks)."""
    return sum(st.st_size for _, st in _files(cache_dir))


def _files(root: str) -> Iterator[tuple[str, os.stat_result]]:
    """Cached and ``.part`` files under ``root`` (lock files are not data)."""
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(LOCK):
                continue
            path = os.path.join(folder, name)
            with contextlib.suppress(FileNotFoundError):
                yield path, os.stat(path)


def _try_remove_dead_part(path: str) -> bool:
    """Delete a ``.part`` file whose writer died (its lock is free); whether it was deleted."""
    try:
        f = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        return True
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # being written
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return True


def _try_evict(path: str) -> bool:
    """Delete cached file ``path`` unless someone holds its ``.lock`` or reads it (pinned)."""
    try:
        lock = os.open(path + LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # being downloaded or opened right now
        try:
            f = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
        except BlockingIOError:
            return False  # pinned by a reader
        finally:
            os.close(f)
        log.debug("cache: evicted %s", path)
        return True
    finally:
        os.close(lock)


@contextlib.contextmanager
def _locked(path: str, timeout: float) -> Iterator[None]:
    """An exclusive flock on ``path`` (created if needed), waited for at most ``timeout`` s."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        delay = 0.002
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{path}: held by another process for more than {timeout:.0f} s (a download "
                    "that does not progress?); check the other jobs using this cache_dir"
                )
            time.sleep(delay)  # polling a lock held by another process, bounded by the deadline
            delay = min(delay * 2, 0.05)
        yield
    finally:
        os.close(fd)
