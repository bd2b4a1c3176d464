"""Cache: whole remote shards (and their indexes) kept in a local folder, shared by a node.

``RemoteOptions(cache_dir=..., cache_limit=...)`` turns it on. The unit is a
whole file, as LitData and MosaicML Streaming do: a file is either complete
and verified or absent, it is checked against what the manifest already
holds for it (size and sha256), eviction deletes whole files, and no
shared state exists besides the files and their locks.

Layout. The cache owns one folder, ``cache_dir/shardprep-cache/``, and
nothing else under ``cache_dir``: the names it may write, count and delete
there, and the checks made before it writes anything, are in
``loader.io.cachedir``.

Safety rules (every worker and rank of one node may share the folder):

* **One download per file.** ``<name>.lock`` is taken with ``fcntl.flock``
  (exclusive) around "is it there? else download it"; a second process
  waits for the first, then finds the file. flock locks die with their
  process, so a crash leaves no stale lock and no shared memory.
* **Never a half-written file.** A download goes to ``.part`` (space
  reserved with ``posix_fallocate``, exclusively locked while written).
  Every write is checked (short writes, ENOSPC, EDQUOT, EFBIG, EIO). The
  file is then read back and its sha256 computed over the bytes on disk;
  only a match with the manifest is renamed over ``<name>`` (atomic). A
  local write that fails drops the download: the read goes on from the
  remote, uncached, with one warning per process.
* **A damaged entry is fetched again once.** The stamp records the cached
  file's inode, size, mtime and ctime when its sha256 was checked. Opening
  a file whose identity differs from its stamp (written to, truncated,
  replaced) or that has no stamp checks its sha256 again (else an open costs
  one ``fstat``); a mismatch deletes it and downloads it again. If that
  download is wrong too, the error names the cache file and the remote one.
* **Pinned files are never evicted.** A reader holds a shared flock on
  each cached file it reads from. Eviction (under ``.evict.lock``) deletes
  least-recently-used files (by their stamp's mtime, which every use
  refreshes) until the new file fits under ``cache_limit``; a file is only
  deleted while the evictor holds its ``.lock`` and an exclusive flock on
  it, so a file being read or being checked is skipped.
* **Stale downloads are swept.** ``.part`` files whose writer died (their
  flock is free) are deleted when a cache is opened and when room is made;
  live ones count at full size.
* **Never over the limit.** Room is made, and the ``.part`` file created at
  full size, in one step under ``.evict.lock``, so the cached and
  downloading bytes stay within ``cache_limit`` at every moment (stamps and
  locks, a few bytes each, are not counted). If room cannot be made
  (everything else pinned), the data is streamed without caching for that read.

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
import stat
import threading
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, BinaryIO

from loader.io.cachedir import (
    CACHE_FOLDER,
    EVICT_LOCK,
    LOCK,
    MARKER,
    MARKER_TEXT,
    PART,
    STAMP,
    check_folder,
    check_home,
    file_size,
    own_entries,
    own_parts,
)
from shardprep.format.errors import ChecksumMismatchError
from shardprep.format.manifest import Manifest, ShardEntry

if TYPE_CHECKING:
    from loader.io.source import Source

__all__ = ["ShardCache"]

log = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 600.0  # waiting for another process's download of the same file
DOWNLOAD_PARALLEL = 4  # ranged GETs of one file in flight (memory: 4 x request_bytes)
READ_BLOCK = 1 << 20
_counter = itertools.count()
_warned: set[str] = set()  # cache folders whose failed local write this process reported
_warned_lock = threading.Lock()


class _CacheWriteError(Exception):
    """A local write of the cache failed (disk full, quota, file size limit, I/O error)."""

    def __init__(self, path: str, err: OSError) -> None:
        super().__init__(f"{path}: {err.strerror or err}")
        self.path, self.err = path, err


def _make_home(home: str) -> None:
    """Create the cache folder and its marker (idempotent, safe against other processes)."""
    os.makedirs(home, exist_ok=True)
    marker = os.path.join(home, MARKER)
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        pass
    else:
        try:
            _pwrite_all(fd, MARKER_TEXT.encode(), 0, marker)
        except _CacheWriteError:
            os.close(fd)
            os.unlink(marker)
            raise
        os.close(fd)
    check_home(home)


# --- the cache ----------------------------------------------------------------------------


class ShardCache:
    """The cache folder of one output: ``cache_dir/shardprep-cache/<hash of URL and manifest>/``."""

    lock_timeout_s = LOCK_TIMEOUT_S
    preallocate = True  # reserve a download's space up front (posix_fallocate)

    def __init__(
        self,
        source: Source,
        manifest: Manifest,
        cache_dir: str | os.PathLike[str],
        limit: int | None,
    ):
        self._source = source
        self.root = cache_dir = os.fspath(cache_dir)
        self.home = os.path.join(cache_dir, CACHE_FOLDER)
        self.limit = limit
        key = hashlib.sha256(f"{source.root}\n{manifest.fingerprint}".encode()).hexdigest()[:16]
        self.folder = os.path.join(self.home, key)
        self._evict_lock = os.path.join(self.home, EVICT_LOCK)
        self._request_bytes = source.options.request_bytes

    @classmethod
    def for_output(cls, source: Source, manifest: Manifest) -> ShardCache | None:
        """The cache configured in ``source.options``, opened (made if needed, stale
        downloads swept), or None when its limit cannot hold a shard or it cannot be made.

        Raises:
            ValueError: the folder is not a shardprep cache (see :func:`check_cache_dir`),
                or the output's folder in it is a symlink.
        """
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
        cache = cls(source, manifest, options.cache_dir, limit)
        try:
            cache.prepare()
        except _CacheWriteError as err:
            cache._warn_write_failed(err)
            return None
        except TimeoutError:
            raise  # another process holds .evict.lock: its own message says so
        except OSError as err:  # e.g. a read-only or full disk: no folder, marker or lock file
            cache._warn_write_failed(_CacheWriteError(cache.home, err))
            return None
        return cache

    def prepare(self) -> None:
        """Make the folders (and marker) if needed and delete downloads whose writer died."""
        _make_home(self.home)
        os.makedirs(self.folder, exist_ok=True)
        with _locked(self._evict_lock, self.lock_timeout_s):
            for path in own_parts(self.home):
                _try_remove_dead_part(path)

    # --- public -----------------------------------------------------------------

    def open(self, entry: ShardEntry) -> BinaryIO | None:
        """The cached shard file of ``entry``, open and pinned (shared lock) until closed.

        Downloads it first if needed. None if it cannot be cached now (no room
        under the limit, or a local write failed): read it from the remote.

        Raises:
            ChecksumMismatchError: the remote file is not the one the manifest
                lists (naming the cache file too when a damaged copy was dropped).
            TimeoutError: another process held the file's lock for ``LOCK_TIMEOUT_S``.
            ValueError: the output's folder in the cache became a symlink.
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
        final = os.path.join(self.folder, name)
        check_folder(self.folder)  # every path below goes through it
        with _locked(final + LOCK, self.lock_timeout_s):
            pinned, damage = self._open_pinned(final, size, sha256)
            self._source.counts().cache(hit=pinned is not None)
            if pinned is not None:
                return pinned
            try:
                cached = self._fetch_into_cache(name, final, size, sha256)
            except ChecksumMismatchError as err:
                if damage is None:
                    raise
                url = self._source.path(name)
                raise ChecksumMismatchError(
                    f"{final}: the cached copy of {url} was damaged ({damage}) and was deleted; "
                    f"fetching it again failed too: {err}",
                    url,
                    err.expected,
                    err.actual,
                ) from err
            if not cached:
                return None
            pinned, damage = self._open_pinned(final, size, sha256)
            if pinned is None:  # pragma: no cover - we hold its lock and just checked it
                raise RuntimeError(f"{final}: vanished or changed right after it was cached")
            return pinned

    def _open_pinned(
        self, final: str, size: int, sha256: str
    ) -> tuple[BinaryIO | None, str | None]:
        """``final`` opened with a shared lock if it is there and intact (caller holds its
        .lock); else None and, if a damaged copy was deleted, what was wrong with it."""
        try:
            fd = os.open(final, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None, None
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            return None, None  # a symlink under our name: the download replaces the link itself
        f = open(fd, "rb", buffering=0)  # noqa: SIM115 - returned open
        try:
            st = os.fstat(fd)
            damage = None
            if not stat.S_ISREG(st.st_mode):
                raise IsADirectoryError(f"{final}: not a plain file; delete it")
            if st.st_size != size:
                damage = f"{st.st_size} bytes, not {size}"
            elif _read_stamp(final + STAMP) != _stamp(sha256, st):
                actual = _sha256_of(fd, size)  # changed since checked (or never stamped)
                if actual != sha256:
                    damage = f"sha256 {actual}, not {sha256}"
                else:
                    self._write_stamp(final, sha256, st)
            if damage is not None:
                log.warning("cache: %s is damaged (%s); downloading it again", final, damage)
                f.close()
                _unlink_quietly(final + STAMP)
                _unlink_quietly(final)
                return None, damage
            fcntl.flock(fd, fcntl.LOCK_SH)  # never waits: evictors hold .lock first
            _touch(final + STAMP)  # least recently used = oldest stamp mtime
        except BaseException:
            f.close()
            raise
        return f, None

    def _fetch_into_cache(self, name: str, final: str, size: int, sha256: str) -> bool:
        """Download ``name`` to ``final``, verified on disk; False if it cannot be cached now."""
        try:
            reserved = self._reserve(name, size)
        except _CacheWriteError as err:
            self._warn_write_failed(err)
            return False
        if reserved is None:
            log.info("cache %s is full of pinned files; streaming %s uncached", self.home, name)
            return False
        part, part_path = reserved
        try:
            received = self._download(name, part, part_path, size)
            url = self._source.path(name)
            if received != sha256:
                raise ChecksumMismatchError.for_file(url, sha256, received)
            on_disk = _sha256_of(part.fileno(), size)
            if on_disk != sha256:  # the remote's bytes were right: the local disk lost them
                raise _CacheWriteError(
                    part_path,
                    OSError(errno.EIO, f"read back with sha256 {on_disk}, not {sha256}"),
                )
            # under the evict lock: a scan never sees the file under neither (or both) names
            with _locked(self._evict_lock, self.lock_timeout_s):
                os.replace(part_path, final)
            self._write_stamp(final, sha256, os.fstat(part.fileno()))
            return True
        except _CacheWriteError as err:
            self._warn_write_failed(err)
            return False
        finally:
            part.close()
            _unlink_quietly(part_path)

    def _write_stamp(self, final: str, sha256: str, st: os.stat_result) -> None:
        """Record that ``final`` (as ``st`` describes it) had ``sha256``; a failed write only
        costs a check at the next open."""
        path = final + STAMP
        try:
            # a new file, never an old one truncated: a hard link planted under the stamp's
            # name loses its name here, and the file it links to is left as it was
            _unlink_quietly(path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            log.warning(
                "cache: cannot write %s (%s); it is checked again at its next use", path, err
            )
            return
        try:
            _pwrite_all(fd, _stamp(sha256, st).encode(), 0, path)
        except _CacheWriteError as err:
            log.warning(
                "cache: cannot write %s (%s); it is checked again at its next use", path, err
            )
            os.close(fd)
            _unlink_quietly(path)
            return
        os.close(fd)

    def _reserve(self, name: str, size: int) -> tuple[BinaryIO, str] | None:
        """Make room for ``size`` bytes and create the locked ``.part`` file at that size
        (open, and its path)."""
        with _locked(self._evict_lock, self.lock_timeout_s):
            if self.limit is not None and not self._make_room(size):
                return None
            path = os.path.join(self.folder, f".{name}.{os.getpid()}.{next(_counter)}{PART}")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except OSError as err:
                raise _CacheWriteError(path, err) from err
            f = open(fd, "w+b")  # noqa: SIM115 - returned open
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                _allocate(fd, size, path, self.preallocate)
            except BaseException:
                f.close()
                _unlink_quietly(path)
                raise
            return f, path

    def _make_room(self, size: int) -> bool:
        """Delete unpinned files, least recently used first, until ``size`` more bytes fit."""
        assert self.limit is not None
        files = []
        total = 0
        for path in own_parts(self.home):
            if _try_remove_dead_part(path):
                continue
            total += file_size(path)
        for path in own_entries(self.home):
            nbytes = file_size(path)
            total += nbytes
            used = _mtime(path + STAMP) or _mtime(path)
            files.append((used, path, nbytes))
        for _, path, nbytes in sorted(files):
            if total + size <= self.limit:
                break
            if _try_evict(path):
                total -= nbytes
        return total + size <= self.limit

    def _download(self, name: str, part: BinaryIO, path: str, size: int) -> str:
        """Fill ``part`` with the remote file in ranged GETs (every write checked); the sha256
        of the bytes received. A file of another size raises ChecksumMismatchError."""
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
                _pwrite_all(part.fileno(), kept, start, path)
                digest.update(kept)
                offset = start + len(data)
                if len(data) < stop - start:  # the file ends here
                    ended = True
                    break
            if ended:
                break
        if offset != size:
            url = self._source.path(name)
            raise ChecksumMismatchError(
                f"{url}: has {'fewer' if offset < size else 'more'} bytes than the {size} its "
                "manifest lists; not cached. The output changed after its manifest was written: "
                "rebuild it",
                url,
            )
        return digest.hexdigest()

    def _warn_write_failed(self, err: _CacheWriteError) -> None:
        """Warn once per process and cache folder that the cache cannot write (reads go on)."""
        with _warned_lock:
            if self.home in _warned:
                log.info("cache: %s; streaming uncached", err)
                return
            _warned.add(self.home)
        warnings.warn(
            f"shardprep cache {self.home}: cannot write ({err}); the file was not cached and "
            "is read from the remote instead, as every file the cache cannot write. Free space "
            "on that disk or lower RemoteOptions.cache_limit to cache again",
            stacklevel=2,
        )


def _mtime(path: str) -> int:
    try:
        return os.lstat(path).st_mtime_ns
    except FileNotFoundError:
        return 0


def _stamp(sha256: str, st: os.stat_result) -> str:
    """What a stamp holds: the sha256 and the identity of the file it was computed over."""
    return f"{sha256} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}\n"


def _read_stamp(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return os.read(fd, 256).decode("ascii", "replace")
    finally:
        os.close(fd)


def _touch(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.utime(path, follow_symlinks=False)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _sha256_of(fd: int, size: int) -> str:
    """sha256 of the first ``size`` bytes of ``fd`` as read back from the file."""
    digest = hashlib.sha256()
    offset = 0
    while offset < size:
        block = os.pread(fd, min(READ_BLOCK, size - offset), offset)
        if not block:
            break  # shorter than size: the digest differs
        digest.update(block)
        offset += len(block)
    return digest.hexdigest()


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int, path: str) -> None:
    """Write all of ``data`` at ``offset``; a failed or stalled write raises _CacheWriteError."""
    view = memoryview(data)
    while view:
        try:
            n = os.pwrite(fd, view, offset)
        except OSError as err:
            raise _CacheWriteError(path, err) from err
        if n <= 0:
            raise _CacheWriteError(path, OSError(errno.ENOSPC, "a write made no progress"))
        view, offset = view[n:], offset + n


def _allocate(fd: int, size: int, path: str, preallocate: bool) -> None:
    """Give the file ``size`` bytes: reserved on disk where the filesystem can, else sparse."""
    if preallocate and size > 0:
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise _CacheWriteError(path, err) from err
    try:
        os.ftruncate(fd, size)
    except OSError as err:
        raise _CacheWriteError(path, err) from err


def _try_remove_dead_part(path: str) -> bool:
    """Delete a ``.part`` file whose writer died (its lock is free); whether it was deleted."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # being written
        _unlink_quietly(path)
        log.debug("cache: deleted %s (its download was abandoned)", path)
        return True
    finally:
        os.close(fd)


def _try_evict(path: str) -> bool:
    """Delete cached file ``path`` unless someone holds its ``.lock`` or reads it (pinned)."""
    try:
        lock = os.open(path + LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # being downloaded or opened right now
        try:
            f = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _unlink_quietly(path + STAMP)
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
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
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
