"""Cache: whole remote shards (and their indexes) kept in a local folder, shared by a node.

``RemoteOptions(cache_dir=..., cache_limit=...)`` turns it on. The unit is a
whole file, as LitData and MosaicML Streaming do: a file is either complete
and verified or absent, it is checked against what the manifest already
holds for it (size and sha256), eviction deletes whole files, and no
shared state exists besides the files and their locks.

Layout. The cache owns one folder, ``cache_dir/shardprep-cache/``, marked by
a ``CACHEDIR.TAG`` that names the layout; it never writes, reads for its
own use or deletes anything else under ``cache_dir``. A folder of that name
that holds files but no marker is refused (:func:`check_cache_dir`, called
when ``RemoteOptions`` is made), so is an empty ``cache_dir`` or a file::

    cache_dir/shardprep-cache/
        CACHEDIR.TAG                    marker (layout 1)
        .evict.lock                     held while room is made or a file renamed
        <16 hex: URL + manifest>/       one folder per output (a rebuilt output gets a new one)
            shard-00007.tar             a cached file, under its manifest name
            shard-00007.tar.ok          its stamp: sha256 and file identity when verified
            shard-00007.tar.lock        flock: one download at a time
            .shard-00007.tar.<pid>.<n>.part   a download in progress

Only names of that form, as plain files (never through a symlink) inside
folders of that form, are ever deleted; an output's folder that is a symlink
is refused (ValueError), never written or deleted through.

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
import re
import stat
import threading
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, BinaryIO

from shardprep.errors import ChecksumMismatchError
from shardprep.manifest import Manifest, ShardEntry

if TYPE_CHECKING:
    from loader.source import Source

__all__ = ["CACHE_FOLDER", "ShardCache", "cache_bytes", "check_cache_dir"]

log = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 600.0  # waiting for another process's download of the same file
DOWNLOAD_PARALLEL = 4  # ranged GETs of one file in flight (memory: 4 x request_bytes)
CACHE_FOLDER = "shardprep-cache"
MARKER = "CACHEDIR.TAG"
LAYOUT = 1
MARKER_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    f"# shardprep cache, layout {LAYOUT}: remote shards kept by shardprep's loader.\n"
    "# Delete this folder to empty the cache (no job may be reading through it).\n"
)
PART = ".part"
LOCK = ".lock"
STAMP = ".ok"
EVICT_LOCK = ".evict.lock"
READ_BLOCK = 1 << 20
_OUTPUT_FOLDER = re.compile(r"[0-9a-f]{16}")
_NAME = r"shard-\d{5,}\.(?:tar|tar\.zst|idx)"  # shardformat.shard_name / index_name
_ENTRY = re.compile(_NAME)
_PART = re.compile(rf"\.({_NAME})\.\d+\.\d+\.part")
_counter = itertools.count()
_warned: set[str] = set()  # cache folders whose failed local write this process reported
_warned_lock = threading.Lock()


class _CacheWriteError(Exception):
    """A local write of the cache failed (disk full, quota, file size limit, I/O error)."""

    def __init__(self, path: str, err: OSError) -> None:
        super().__init__(f"{path}: {err.strerror or err}")
        self.path, self.err = path, err


# --- the folder -------------------------------------------------------------------------


def check_cache_dir(cache_dir: object) -> None:
    """Refuse a ``cache_dir`` the cache cannot own safely; touches nothing.

    Raises:
        ValueError: ``cache_dir`` is not a str, is empty, is a file, or its
            ``shardprep-cache`` entry is a file, a folder of files that is not a
            shardprep cache, or a cache of another layout (the message says what to do).
    """
    if isinstance(cache_dir, os.PathLike):
        cache_dir = os.fspath(cache_dir)
    if not isinstance(cache_dir, str):
        raise ValueError(f"RemoteOptions.cache_dir must be a folder path (str), not {cache_dir!r}")
    if not cache_dir.strip():
        raise ValueError(
            f"RemoteOptions.cache_dir={cache_dir!r} is empty: give the folder to keep cached "
            "shards in (e.g. '/tmp/shardprep'), or None to read without a cache"
        )
    if "\0" in cache_dir:
        raise ValueError(f"RemoteOptions.cache_dir={cache_dir!r} holds a NUL character")
    if os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
        raise ValueError(
            f"RemoteOptions.cache_dir={cache_dir!r} is a file, not a folder: give a folder "
            f"(the cache keeps its files in {os.path.join(cache_dir, CACHE_FOLDER)!r})"
        )
    _check_home(os.path.join(cache_dir, CACHE_FOLDER))


def _check_home(home: str) -> None:
    """``home`` is absent, empty (being made), or a shardprep cache of this layout."""
    if not os.path.lexists(home):
        return
    if os.path.islink(home) and not os.path.isdir(home):
        raise ValueError(f"{home}: a broken symlink; remove it or choose another cache_dir")
    if not os.path.isdir(home):
        raise ValueError(
            f"{home}: a file is in the way of the cache folder; move it or choose another cache_dir"
        )
    _check_owner(home)
    try:
        with open(os.path.join(home, MARKER), "rb") as f:
            text = f.read(len(MARKER_TEXT) + 1).decode("utf-8", "replace")
    except FileNotFoundError:
        if os.listdir(home):
            raise ValueError(
                f"{home}: holds files but is not a shardprep cache (no {MARKER}); the cache "
                "never deletes files it did not make: move them away or choose another "
                "cache_dir"
            ) from None
        return
    if not MARKER_TEXT.startswith(text):  # a prefix: another process is writing it right now
        raise ValueError(
            f"{home}: {MARKER} is not the one of a shardprep cache of layout {LAYOUT} (made by "
            "another tool or shardprep version?); delete that folder or choose another cache_dir"
        )


def _check_folder(folder: str) -> None:
    """``folder`` (an output's folder in the cache) is a real folder, not a link to one: the
    cache deletes and replaces files named like shards in it."""
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode):
        what = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a folder"
        raise ValueError(
            f"{folder}: {what} where the cache keeps an output's files; the cache never "
            "writes or deletes through links: remove it (the cache makes the folder again)"
        )
    _check_owner(folder)


def _check_owner(folder: str) -> None:
    """``folder`` belongs to this user: in a folder another user owns (a shared ``/tmp``),
    that user could swap files or links under the cache between its checks and its uses."""
    owner = os.lstat(folder).st_uid
    if owner != os.geteuid():
        raise ValueError(
            f"{folder}: owned by another user (uid {owner}), who could change what the cache "
            "reads and deletes there; choose a cache_dir of your own"
        )


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
    _check_home(home)


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
            for path in _own_parts(self.home):
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
        _check_folder(self.folder)  # every path below goes through it
        with _locked(final + LOCK, self.lock_timeout_s):
            pinned, damage = self._open_pinned(final, size, sha256)
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
        for path in _own_parts(self.home):
            if _try_remove_dead_part(path):
                continue
            total += _size(path)
        for path in _own_entries(self.home):
            nbytes = _size(path)
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


def cache_bytes(cache_dir: str | os.PathLike[str]) -> int:
    """Bytes of the cache in ``cache_dir``: cached files and downloads in progress (not stamps,
    locks or anything that is not the cache's)."""
    home = os.path.join(cache_dir, CACHE_FOLDER)
    return sum(_size(p) for p in itertools.chain(_own_entries(home), _own_parts(home)))


# --- what the cache owns -------------------------------------------------------------------


def _own_files(home: str, pattern: re.Pattern[str]) -> Iterator[str]:
    """Plain files (not symlinks) named like ``pattern`` in the output folders of ``home``."""
    try:
        outputs = list(os.scandir(home))
    except (FileNotFoundError, NotADirectoryError):
        return
    for output in outputs:
        if not (_OUTPUT_FOLDER.fullmatch(output.name) and output.is_dir(follow_symlinks=False)):
            continue
        try:
            files = list(os.scandir(output.path))
        except FileNotFoundError:
            continue
        for f in files:
            if pattern.fullmatch(f.name) and f.is_file(follow_symlinks=False):
                yield f.path


def _own_entries(home: str) -> Iterator[str]:
    return _own_files(home, _ENTRY)


def _own_parts(home: str) -> Iterator[str]:
    return _own_files(home, _PART)


def _size(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


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
