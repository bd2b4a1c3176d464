"""Destination: where a build's files go, and their life cycle there (refuse, overwrite,
journal, resume, publish the manifest last).

:func:`open_destination` picks one of two kinds behind the :class:`Destination` seam:

- :class:`LocalDestination`, for a path or a ``file://`` URL: the writers write shards straight
  into the folder under hidden ``.partial`` names renamed when complete; the journal and the
  manifest are written atomically (temp file + rename), the manifest last. The build and its
  writers hold a lock on the folder (:mod:`shardprep.out_lock`): a second build into it waits
  for them, a bounded time, or is refused.
- :class:`RemoteDestination`, for any other fsspec URL (``s3://``, ``gs://``, ``memory://``):
  the writers write into a local staging folder (``tempfile``, so ``TMPDIR`` chooses where);
  each finished shard is uploaded, its index first, by one of ``UPLOAD_THREADS`` threads while
  the next shards are written, then deleted locally. The build starts a shard only while fewer
  than ``workers + UPLOAD_THREADS`` shards are staged (being written, or written and not yet
  uploaded), so the staging folder never holds more than that many shards. When the write
  tasks run away from this machine (``prepare(tasks_elsewhere=True)``: Ray), there is no
  staging folder here: each task writes its shard on its own node and uploads it itself
  (:class:`~shardprep.upload.ShardUpload`, same order), and returns only its record. Either
  way the journal is an object in OUT, so ``--resume`` (which finds the finished shards by
  listing OUT and checks each against its index) and ``--overwrite`` work as locally. The
  manifest is uploaded last, once one listing of OUT shows every object it names with the
  size the writer recorded.

An object store shows an object only once its upload completed (S3: a PUT, or a multipart
upload's CompleteMultipartUpload; GCS and Azure likewise), so no staging key and copy are
needed: an interrupted upload leaves no object (S3 keeps the parts of an unfinished multipart
upload out of sight until a bucket lifecycle rule aborts them). A backend without that
guarantee is not supported as OUT.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import queue
import re
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol, TypeVar

from shardprep.config import BuildConfig
from shardprep.format.errors import InputError, OutputError
from shardprep.format.interface import Interface
from shardprep.format.manifest import JOURNAL_NAME, Manifest, manifest_bytes, write_manifest
from shardprep.format.shardformat import MANIFEST_NAME, index_name, shard_name
from shardprep.format.threads import start_thread
from shardprep.format.versions import VERSIONS_DIR
from shardprep.out_lock import OutLock, hold_out
from shardprep.resume_check import finished_shard_problem
from shardprep.scratch import OwnedFolder
from shardprep.storage import describe_error, endpoint_hint, is_url, local_path, open_url
from shardprep.upload import ShardUpload, put_shard
from shardprep.write import ShardRecord, record_from_index

__all__ = [
    "UPLOAD_THREADS",
    "Destination",
    "LocalDestination",
    "RemoteDestination",
    "open_destination",
]

T = TypeVar("T")


OWN_FILE = re.compile(r"^\.?(shard-\d{5}\.(tar|tar\.zst|idx)|manifest\.json)(\.partial)?$")
PARTIAL_FILE = re.compile(
    r"^\.(shard-\d{5}\.(tar|tar\.zst|idx)|manifest\.json|shardprep-build\.json)\.partial$"
)
VERSION_FILE = re.compile(r"^\.?manifest-\d{5}\.json(\.partial)?$")
"""A version's manifest in OUT/versions (shardprep.format.versions), or its temp file."""
UPLOAD_THREADS = 2
CONTACT_TIMEOUT_S = 30.0
"""The first request to a remote OUT (listing it) must be answered within this many seconds."""
RESUME_THREADS = 8
JOURNAL_LIMIT = 1 << 20
LOG = logging.getLogger("shardprep")


class Destination(Protocol):
    """Where a build writes, in the order :func:`shardprep.builder.build` calls it."""

    out: str  # OUT as the user gave it
    staging: str  # the local folder the writers write shard files into (set by prepare)
    stages_locally: bool  # True: shards are written into a local folder, then uploaded to OUT
    process_local: bool  # True: OUT lives in this process (memory://): no other process sees it
    out_lock: OutLock | None  # a local OUT's lock once checked (every writer holds it too)

    def check_apart(self, raw: str) -> None:
        """Refuse an OUT that overlaps the input RAW, before anything is scanned or written."""

    def check(self) -> None:
        """Refuse an unusable OUT before any work (a file; non-empty without a flag). A local
        OUT is made and locked first (:mod:`shardprep.out_lock`), until :meth:`close`."""

    def prepare(self, tasks_elsewhere: bool = False) -> ShardUpload | None:
        """Create a URL OUT's staging area; with --overwrite remove a previous build's files.

        ``tasks_elsewhere``: the write tasks may run on other machines (Ray), which cannot
        write into this machine's staging folder. Returns None when the tasks write into
        ``staging``, else how they put their shard into OUT themselves (then ``staging`` is
        unused and ``shard_written`` gets records of shards already in OUT).
        """

    def read_out(self, name: str, limit: int) -> bytes:
        """The first ``limit`` bytes of file ``name`` of OUT (``versions/...`` included).

        Raises:
            FileNotFoundError: OUT has no such file.
            OutputError: it cannot be read.
        """

    def start_journal(self, fingerprint: str, append: dict[str, Any] | None = None) -> None:
        """Write the journal (or, with --resume, check it against this build's). ``append``:
        the version an append builds on (``base_version``, ``base_manifest_sha256``), kept in
        the journal; a URL OUT checks, once its journal is written, that ``manifest.json`` is
        still that base (absent for a plain build): two appends never both build on it."""

    def finished_records(self, shards: range) -> dict[int, ShardRecord]:
        """--resume: the records of the shards an earlier build finished, by shard number."""

    def has_room(self, writing: int) -> bool:
        """Whether another shard may start while ``writing`` shards are being written."""

    def wait_for_room(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for a staged shard to leave (returns at once if none)."""

    def shard_written(self, record: ShardRecord) -> None:
        """A writer finished this shard in ``staging``."""

    def publish(self, manifest: Manifest, versions: Mapping[str, bytes] | None = None) -> None:
        """Once every shard is in OUT: write ``versions`` (name → bytes, the immutable version
        manifests of an append), then the manifest, then remove the journal."""

    def has_journal(self) -> bool:
        """Whether OUT holds a journal now (for the advice after a Ctrl-C)."""

    def discard_partial(self) -> None:
        """After a failure or Ctrl-C while writing: drop what is incomplete."""

    def close(self) -> None:
        """Release the staging area and threads; called once, whatever happened."""


def open_destination(out: str, config: BuildConfig) -> Destination:
    """The destination of ``out``: remote for an fsspec URL, else a local folder.

    Raises:
        OutputError: the URL's backend is not installed or its protocol is unknown.
    """
    if is_url(out):
        return RemoteDestination(out, config)
    return LocalDestination(local_path(out), config)


def _protocol_of(fs: Any) -> str:
    protocol = fs.protocol
    return str(protocol[0] if isinstance(protocol, tuple | list) else protocol)


def _output_error(path: str, err: OSError, advice: str) -> OutputError:
    what = "no space left on the device" if err.errno == errno.ENOSPC else err.strerror or str(err)
    return OutputError(f"{path}: {what}; {advice}", path)


def _not_empty(out: str, existing: list[str], what: str, interface: Interface) -> InputError:
    return InputError(
        f"{out}: the output {what} is not empty ({len(existing)} entries, e.g. "
        f"{existing[0]!r}); pass {interface.setting('overwrite')} to replace a previous build, "
        f"{interface.setting('resume')} to finish an interrupted one, or choose an empty {what}",
        out,
    )


def _nothing_to_resume(out: str, interface: Interface) -> InputError:
    return InputError(
        f"{out}: no interrupted build to resume here; {interface.without('resume')}", out
    )


def _nothing_to_append(out: str, interface: Interface) -> InputError:
    return InputError(
        f"{out}: holds no build to append to; build it first {interface.without('append')}",
        out,
    )


def _journal_unreadable(path: str, problem: object, interface: Interface) -> InputError:
    return InputError(
        f"{path}: the build journal is unreadable ({problem}); start over with "
        f"{interface.setting('overwrite')}",
        path,
    )


def _damaged(where: str, problem: str) -> None:
    """The one-line notice for a finished shard that --resume writes again."""
    LOG.warning("%s: damaged since the interrupted build (%s); writing it again", where, problem)


def _journal_record(
    config: BuildConfig, fingerprint: str, append: dict[str, Any] | None
) -> dict[str, Any]:
    record = {"input_fingerprint": fingerprint, "options": config.output_options()}
    if append is not None:
        record["append"] = append
    return record


def _check_journal(
    out: str, previous: object, record: dict[str, Any], interface: Interface
) -> None:
    was_append = isinstance(previous, dict) and "append" in previous
    if was_append != ("append" in record):
        raise InputError(
            f"{out}: the interrupted build was "
            + (
                f"an append: resume it with {interface.setting('append')} as well"
                if was_append
                else f"a plain build, not an append: resume it without {interface.setting('append')}"
            ),
            out,
        )
    if previous != record:
        raise InputError(
            f"{out}: the interrupted build used other input or options; rerun it with "
            f"the same RAW and options, or start over with {interface.setting('overwrite')}",
            out,
        )


class LocalDestination:
    """A local folder: shards are written in place (see the module doc)."""

    stages_locally = False
    process_local = False

    def __init__(self, out: str, config: BuildConfig) -> None:
        self.out = out
        self.staging = out
        self._config = config
        self.out_lock: OutLock | None = None

    def check_apart(self, raw: str) -> None:
        """Refuse OUT inside RAW (the next build would read the shards as samples), the same
        folder, or RAW inside OUT (``--overwrite`` would delete it).

        Raises:
            InputError: the two overlap.
        """
        if is_url(raw):  # an input read through fsspec is not in any local folder
            return
        out = self.out
        real_raw, real_out = os.path.realpath(raw), os.path.realpath(out)
        if real_out == real_raw or real_out.startswith(real_raw.rstrip(os.sep) + os.sep):
            where = "is the input" if real_out == real_raw else f"is inside the input {raw}"
            raise InputError(
                f"{out}: the output folder {where} (the next build would read "
                "its shards as samples); choose an output folder outside the input",
                out,
            )
        if real_raw.startswith(real_out.rstrip(os.sep) + os.sep):
            raise InputError(
                f"{raw}: the input is inside the output folder {out} "
                f"({self._config.interface.setting('overwrite')} would delete it); choose an "
                "output folder that does not hold the input",
                raw,
            )

    def check(self) -> None:
        """Lock OUT (made if absent: :func:`~shardprep.out_lock.hold_out`), then refuse it if
        unusable. The lock comes first and is kept until :meth:`close`, so what is checked
        here, and what the build reads in OUT later (a journal to resume, a finished build),
        stays true while it runs: a second build into the same OUT that got the lock only
        once this one finished sees its output and is refused (or, with --resume, finds it
        complete).

        Raises:
            InputError: OUT is a file, not empty without a flag, absent with --resume, or
                another build (a killed build's writers included) still holds it after
                ``LOCK_WAIT_S``.
            OutputError: OUT cannot be made or opened.
        """
        out, config = self.out, self._config
        if os.path.lexists(out) and not os.path.isdir(out):
            raise InputError(f"{out}: exists and is not a folder; choose another OUT", out)
        if not os.path.exists(out) and config.append:
            raise _nothing_to_append(out, config.interface)
        if not os.path.exists(out) and config.resume:
            raise _nothing_to_resume(out, config.interface)
        try:
            self.out_lock = hold_out(out)  # before anything in OUT is looked at or changed
            existing = sorted(os.listdir(out))
        except OSError as err:
            raise _output_error(
                out, err, "cannot create or clear the output folder: choose a writable OUT"
            ) from err
        if existing and not (config.overwrite or config.resume or config.append):
            raise _not_empty(out, existing, "folder", config.interface)
        if not existing and config.append:
            raise _nothing_to_append(out, config.interface)
        if not existing and config.resume:  # e.g. made by a build killed before it wrote
            raise _nothing_to_resume(out, config.interface)

    def prepare(self, tasks_elsewhere: bool = False) -> ShardUpload | None:
        """With --overwrite, remove a previous build's files (OUT is locked since
        :meth:`check`). Tasks elsewhere write into the same path: a folder every node shares.
        """
        out = self.out
        if not self._config.overwrite:
            return None
        try:
            for name in os.listdir(out):
                if OWN_FILE.match(name) or name == JOURNAL_NAME:
                    os.remove(os.path.join(out, name))
            versions = os.path.join(out, VERSIONS_DIR)  # after the manifest that names them
            if os.path.isdir(versions):
                for name in os.listdir(versions):
                    if VERSION_FILE.match(name):
                        os.remove(os.path.join(versions, name))
                with contextlib.suppress(OSError):  # not empty: a file that is not ours stays
                    os.rmdir(versions)
        except OSError as err:
            raise _output_error(
                out, err, "cannot clear the output folder: choose a writable OUT"
            ) from err
        return None

    def read_out(self, name: str, limit: int) -> bytes:
        path = os.path.join(self.out, name)
        try:
            with open(path, "rb") as f:
                return f.read(limit)
        except FileNotFoundError:
            raise
        except OSError as err:
            again = self._config.interface.again()
            raise _output_error(path, err, f"fix the cause, then {again}") from err

    def start_journal(self, fingerprint: str, append: dict[str, Any] | None = None) -> None:
        out = self.out
        path = os.path.join(out, JOURNAL_NAME)
        record = _journal_record(self._config, fingerprint, append)
        interface = self._config.interface
        if self._config.resume:
            if os.path.exists(os.path.join(out, MANIFEST_NAME)) and not os.path.exists(path):
                raise InputError(f"{out}: the build is already complete; nothing to resume", out)
            try:
                with open(path, encoding="utf-8") as f:
                    previous = json.load(f)
            except FileNotFoundError as err:
                raise _nothing_to_resume(out, interface) from err
            except (OSError, ValueError) as err:
                raise _journal_unreadable(path, err, interface) from err
            _check_journal(out, previous, record, interface)
            return
        tmp = os.path.join(out, f"{JOURNAL_NAME}.partial")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(record, f, sort_keys=True)
            os.replace(tmp, path)
        except BaseException as err:  # disk full, or Ctrl-C: no half-written journal is left
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            if isinstance(err, OSError):
                raise _output_error(
                    path,
                    err,
                    f"cannot start the build: fix the cause, then {interface.again()}",
                ) from err
            raise

    def finished_records(self, shards: range) -> dict[int, ShardRecord]:
        """Shards whose file exists and is what its index describes, read once to check and
        hash each; a damaged one is left out (it is written again) with a notice."""
        compression = self._config.compression
        done = [
            shard
            for shard in shards
            if os.path.exists(os.path.join(self.out, shard_name(shard, compression)))
        ]
        with ThreadPoolExecutor(RESUME_THREADS, thread_name_prefix="shardprep-resume") as pool:
            found = list(pool.map(self._reuse, done))
        return {shard: record for shard, record in zip(done, found, strict=True) if record}

    def _reuse(self, shard: int) -> ShardRecord | None:
        config = self._config
        path = os.path.join(self.out, shard_name(shard, config.compression))
        idx_path = os.path.join(self.out, index_name(shard))
        try:
            with open(idx_path, "rb") as f:
                index_bytes = f.read()
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                sha256, problem = finished_shard_problem(
                    shard, index_bytes, f.read, size, config.compression, config.zstd_level
                )
        except FileNotFoundError:
            sha256, problem = "", "its index is missing"
        except OSError as err:
            again = config.interface.again("resume")
            raise _output_error(
                path, err, f"cannot read a finished shard: fix the cause, then {again}"
            ) from err
        if problem:
            _damaged(path, problem)
            return None
        return record_from_index(shard, config.compression, index_bytes, idx_path, sha256, size)

    def has_room(self, writing: int) -> bool:
        return True

    def wait_for_room(self, timeout: float) -> None:
        return

    def shard_written(self, record: ShardRecord) -> None:
        return

    def publish(self, manifest: Manifest, versions: Mapping[str, bytes] | None = None) -> None:
        try:
            for name, data in (versions or {}).items():  # before the manifest that names them
                _write_atomically(os.path.join(self.out, name), data)
            write_manifest(manifest, self.out)
        except OSError as err:
            raise _output_error(
                os.path.join(self.out, MANIFEST_NAME),
                err,
                "every shard is written and kept: fix the cause, then "
                f"{self._config.interface.again('resume')} to write the manifest",
            ) from err
        os.remove(os.path.join(self.out, JOURNAL_NAME))  # the build is complete

    def has_journal(self) -> bool:
        return os.path.exists(os.path.join(self.out, JOURNAL_NAME))

    def discard_partial(self) -> None:
        """Remove the hidden temp files a failed or interrupted build leaves (they can be large)."""
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.out):
                if PARTIAL_FILE.match(name):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(self.out, name))
        versions = os.path.join(self.out, VERSIONS_DIR)
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for name in os.listdir(versions):
                if name.startswith(".") and VERSION_FILE.match(name):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(versions, name))

    def close(self) -> None:
        if self.out_lock is not None:
            self.out_lock.remove_if_made()  # a build that wrote nothing leaves no OUT it made
            self.out_lock.close()
            self.out_lock = None


def _write_atomically(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` as ``write_manifest`` writes the manifest (a hidden temp
    file, fsync, rename), its folder made if absent."""
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{name}.partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Uploads:
    """``threads`` daemon threads running ``upload(record)`` for each submitted record.

    Daemon threads, not a ``ThreadPoolExecutor``: after a Ctrl-C the process must not wait
    at exit for an upload in progress (it leaves no object; ``--resume`` uploads it again).
    ``staged`` counts the records submitted and not yet finished; the first error is kept
    and re-raised by :meth:`check`; after it, queued records are skipped.
    """

    def __init__(self, threads: int, upload: Callable[[ShardRecord], None]) -> None:
        self._upload = upload
        self._queue: queue.SimpleQueue[ShardRecord | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self.staged = 0
        self._error: BaseException | None = None
        self._stopped = False
        self._threads = [
            threading.Thread(target=self._run, name=f"shardprep-upload-{i}", daemon=True)
            for i in range(threads)
        ]
        try:
            for thread in self._threads:
                start_thread(thread)
        except BaseException:  # a Ctrl-C while they start: no thread is left waiting
            self.stop()
            raise

    def submit(self, record: ShardRecord) -> None:
        with self._done:
            self.staged += 1
        self._queue.put(record)

    def _run(self) -> None:
        while (record := self._queue.get()) is not None:
            try:
                if self._error is None and not self._stopped:
                    self._upload(record)
            except BaseException as err:
                with self._done:
                    self._error = self._error or err
            finally:
                with self._done:
                    self.staged -= 1
                    self._done.notify_all()

    def check(self) -> None:
        """Re-raise the first upload error, if any."""
        if self._error is not None:
            raise self._error

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for an upload to finish (at once if none is staged)."""
        with self._done:
            if self.staged:
                self._done.wait(timeout)
        self.check()

    def stop(self) -> None:
        """Skip what is queued and let the threads end (an upload in progress runs on)."""
        if not self._stopped:
            self._stopped = True
            for _ in self._threads:
                self._queue.put(None)


class RemoteDestination:
    """An fsspec URL: shards are staged locally and uploaded (see the module doc)."""

    stages_locally = True
    out_lock: OutLock | None = None  # writers write into a staging folder (OwnedFolder)

    def __init__(self, out: str, config: BuildConfig) -> None:
        self.out = out
        self.staging = ""
        self._config = config
        self._fs, path = open_url(out, config.out_options(), config.interface)
        self.process_local = _protocol_of(self._fs) == "memory"
        self._root = path.rstrip("/")
        self._url = out.rstrip("/")
        self._capacity = config.num_workers() + UPLOAD_THREADS
        self._uploads: _Uploads | None = None
        self._staging: OwnedFolder | None = None
        self._journal_written = False

    # --- remote calls, every failure an OutputError naming the URL --------------------

    def _object_url(self, name: str) -> str:
        return f"{self._url}/{name}"

    def _path(self, name: str) -> str:
        return f"{self._root}/{name}"

    def _call(self, action: Callable[[], T], url: str, advice: str) -> T:
        try:
            return action()
        except (InputError, OutputError):
            raise
        except Exception as err:
            problem = describe_error(url, err, self._config.interface)
            raise OutputError(f"{problem}; {advice}", url) from err

    def _entries(self, advice: str) -> dict[str, int]:
        """Name → size of what OUT holds directly (folders: size -1); {} if OUT is absent.

        Raises:
            InputError: OUT is an object, not a prefix.
            OutputError: the bucket does not exist, or the storage cannot be reached.
        """
        fs = self._fs

        def listing() -> list[dict[str, Any]]:
            fs.invalidate_cache(self._root)
            try:
                return list(fs.ls(self._root, detail=True))
            except FileNotFoundError:
                self._check_bucket()
                return []

        entries = self._call(listing, self._url, advice)
        names: dict[str, int] = {}
        for entry in entries:
            name = str(entry["name"]).rstrip("/")
            if name == self._root and entry.get("type") == "file":
                raise InputError(
                    f"{self.out}: exists and is an object, not a prefix; choose another OUT",
                    self.out,
                )
            names[name.rsplit("/", 1)[-1]] = (
                int(entry.get("size") or 0) if entry.get("type") == "file" else -1
            )
        return names

    def _first_contact(self) -> dict[str, int]:
        """``_entries()``, bounded by CONTACT_TIMEOUT_S in all (retries included).

        On timeout the request is left to finish in a daemon thread; nothing was written.
        """
        interface = self._config.interface
        advice = f"check the URL, then {interface.again()}"
        result: list[dict[str, int] | BaseException] = []

        def contact() -> None:
            try:
                result.append(self._entries(advice))
            except BaseException as err:
                result.append(err)

        thread = threading.Thread(target=contact, name="shardprep-contact", daemon=True)
        start_thread(thread)
        thread.join(CONTACT_TIMEOUT_S)
        if not result:
            raise OutputError(
                f"{self.out}: no answer from the storage within {CONTACT_TIMEOUT_S:g} s; check "
                f"the endpoint ({endpoint_hint(interface)}) and the network, then "
                f"{interface.again()}",
                self.out,
            )
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    def _check_bucket(self) -> None:
        """Raise OutputError if OUT's bucket (container) does not exist."""
        split = getattr(self._fs, "split_path", None)
        if split is None:
            return
        bucket = split(self._root)[0]
        try:
            self._fs.info(bucket)
        except FileNotFoundError as err:
            raise OutputError(
                f"{self.out}: the bucket {bucket!r} does not exist ({err}); create it or fix "
                "the URL",
                self.out,
            ) from err

    # --- the Destination seam ---------------------------------------------------------

    def check_apart(self, raw: str) -> None:
        return  # not compared: one store's objects can be named by several URLs

    def check(self) -> None:
        config = self._config
        existing = sorted(self._first_contact())
        if not existing:
            if config.append:
                raise _nothing_to_append(self.out, config.interface)
            if config.resume:
                raise _nothing_to_resume(self.out, config.interface)
            return
        if not (config.overwrite or config.resume or config.append):
            raise _not_empty(self.out, existing, "prefix", config.interface)

    def prepare(self, tasks_elsewhere: bool = False) -> ShardUpload | None:
        again = self._config.interface.again()
        advice = f"cannot clear the output prefix: fix the cause, then {again}"
        if self._config.overwrite:
            own = [
                name
                for name in self._entries(advice)
                if OWN_FILE.match(name) or name == JOURNAL_NAME
            ]
            # the manifest first: a reader never sees it name a shard that is being replaced
            own.sort(key=lambda name: name != MANIFEST_NAME)
            versions = self._call(partial(self._versions_held), self._url, advice)
            own[1:1] = versions  # then the versions it names
            for name in own:
                self._call(partial(self._fs.rm_file, self._path(name)), self._url, advice)
        if tasks_elsewhere:
            self.stages_locally = False
            return ShardUpload(self._url, self._config.out_options(), self._config.interface)
        self._staging = OwnedFolder("shardprep-staging-")  # swept by a later build if killed
        self.staging = self._staging.path
        self._uploads = _Uploads(UPLOAD_THREADS, self._upload)
        return None

    def _versions_held(self) -> list[str]:
        """``versions/...`` names of the version manifests OUT holds (none: [])."""
        folder = self._path(VERSIONS_DIR)
        self._fs.invalidate_cache(folder)
        try:
            names = [
                str(p).rstrip("/").rsplit("/", 1)[-1] for p in self._fs.ls(folder, detail=False)
            ]
        except FileNotFoundError:
            return []
        return [f"{VERSIONS_DIR}/{name}" for name in sorted(names) if VERSION_FILE.match(name)]

    def read_out(self, name: str, limit: int) -> bytes:
        url = self._object_url(name)
        try:
            return bytes(self._fs.cat_file(self._path(name), start=0, end=limit))
        except FileNotFoundError:
            raise
        except Exception as err:  # a backend's transport errors are not all OSErrors
            interface = self._config.interface
            problem = describe_error(url, err, interface)
            raise OutputError(f"{problem}; fix the cause, then {interface.again()}", url) from err

    def start_journal(self, fingerprint: str, append: dict[str, Any] | None = None) -> None:
        record = _journal_record(self._config, fingerprint, append)
        url = self._object_url(JOURNAL_NAME)
        interface = self._config.interface
        if self._config.resume:
            entries = self._entries(f"fix the cause, then {interface.again()}")
            if MANIFEST_NAME in entries and JOURNAL_NAME not in entries:
                raise InputError(
                    f"{self.out}: the build is already complete; nothing to resume", self.out
                )
            if JOURNAL_NAME not in entries:
                raise _nothing_to_resume(self.out, interface)
            if not 0 <= entries[JOURNAL_NAME] <= JOURNAL_LIMIT:
                raise _journal_unreadable(url, f"{entries[JOURNAL_NAME]} bytes", interface)
            data = self._call(
                lambda: self._fs.cat_file(self._path(JOURNAL_NAME)),
                url,
                f"fix the cause, then {interface.again()}",
            )
            try:
                previous = json.loads(data)
            except ValueError as err:
                raise _journal_unreadable(url, err, interface) from err
            _check_journal(self.out, previous, record, interface)
            self._journal_written = True
            return
        data = json.dumps(record, sort_keys=True).encode()
        self._call(
            lambda: self._create_journal(data),
            url,
            f"cannot start the build: fix the cause, then {interface.again()}",
        )
        self._journal_written = True
        if not self._config.overwrite:
            self._check_base_kept(None if append is None else append["base_manifest_sha256"])

    def _create_journal(self, data: bytes) -> None:
        """Put the journal only if OUT has none: the journal is OUT's lock, one build or append
        at a time (an S3 conditional put, ``If-None-Match: *``; a store that cannot put
        conditionally gets a plain put, with a warning)."""
        path = self._path(JOURNAL_NAME)
        try:
            self._fs.pipe_file(path, data, mode="create")
        except FileExistsError as err:
            interface = self._config.interface
            raise InputError(
                f"{self._object_url(JOURNAL_NAME)}: another build or append is writing into "
                f"{self.out} (its journal appeared after this one looked); let it finish, then "
                f"{interface.again()} (if that build was killed, {interface.again('resume')})",
                self.out,
            ) from err
        except (TypeError, NotImplementedError, ValueError) as err:  # no conditional put here
            LOG.warning(
                "%s: this store cannot write the journal only if absent (%s): another build "
                "writing into OUT at the same time would not be noticed",
                self.out,
                err,
            )
            self._fs.pipe_file(path, data)

    def _check_base_kept(self, base_sha256: str | None) -> None:
        """Once this build holds the journal: refuse it (and let go of the journal) if OUT's
        manifest is no longer the one it builds on (``None``: no manifest), e.g. another
        append published a version between this one's look and its journal."""
        interface = self._config.interface
        advice = f"fix the cause, then {interface.again()}"
        try:
            data = self._call(
                lambda: self._fs.cat_file(self._path(MANIFEST_NAME)), self._url, advice
            )
            now: str | None = hashlib.sha256(data).hexdigest()
        except OutputError as err:
            if not isinstance(err.__cause__, FileNotFoundError):
                raise
            now = None
        if now == base_sha256:
            return
        self._call(lambda: self._fs.rm_file(self._path(JOURNAL_NAME)), self._url, advice)
        self._journal_written = False
        raise InputError(
            f"{self.out}: another build or append published into OUT while this one was "
            f"being prepared (its manifest.json changed); nothing was written: "
            f"{interface.again()} to build on what OUT holds now",
            self.out,
        )

    def finished_records(self, shards: range) -> dict[int, ShardRecord]:
        """Shards whose object and index both exist, checked and hashed (downloaded once:
        the manifest needs their sha256); a shard whose index does not describe its object
        is written again."""
        entries = self._entries(f"fix the cause, then {self._config.interface.again('resume')}")
        compression = self._config.compression
        done = [
            shard
            for shard in shards
            if entries.get(shard_name(shard, compression), -1) >= 0
            and entries.get(index_name(shard), -1) >= 0
        ]
        with ThreadPoolExecutor(RESUME_THREADS, thread_name_prefix="shardprep-resume") as pool:
            found = list(pool.map(lambda s: self._reuse(s, entries), done))
        return {shard: record for shard, record in zip(done, found, strict=True) if record}

    def _reuse(self, shard: int, entries: dict[str, int]) -> ShardRecord | None:
        config, fs = self._config, self._fs
        name, idx = shard_name(shard, config.compression), index_name(shard)
        advice = f"fix the cause, then {config.interface.again('resume')}"
        index_bytes = self._call(
            lambda: fs.cat_file(self._path(idx)), self._object_url(idx), advice
        )
        if len(index_bytes) != entries[idx]:
            _damaged(self._object_url(idx), "it changed while being read")
            return None

        def check() -> tuple[str, str]:
            with fs.open(self._path(name), "rb", block_size=8 << 20) as f:
                return finished_shard_problem(
                    shard,
                    index_bytes,
                    f.read,
                    entries[name],
                    config.compression,
                    config.zstd_level,
                )

        sha256, problem = self._call(check, self._object_url(name), advice)
        if problem:
            _damaged(self._object_url(name), problem)
            return None
        return record_from_index(
            shard, config.compression, index_bytes, self._object_url(idx), sha256, entries[name]
        )

    # With tasks elsewhere there are no uploads here (``_uploads`` is None): nothing to wait for.

    def has_room(self, writing: int) -> bool:
        if self._uploads is None:
            return True
        self._uploads.check()
        return writing + self._uploads.staged < self._capacity

    def wait_for_room(self, timeout: float) -> None:
        if self._uploads is not None:
            self._uploads.wait(timeout)

    def shard_written(self, record: ShardRecord) -> None:
        if self._uploads is None:
            return  # the task uploaded it; publish checks it is there
        self._uploads.check()
        self._uploads.submit(record)

    def _upload(self, record: ShardRecord) -> None:
        """Upload a staged shard, its index first (a shard object implies its index), then
        delete the local copies."""
        self._call(
            partial(put_shard, self._fs, self._root, self.staging, record),
            self._object_url(record.file),
            "the shards uploaded so far are kept: fix the cause, then "
            + self._config.interface.again("resume"),
        )

    def publish(self, manifest: Manifest, versions: Mapping[str, bytes] | None = None) -> None:
        if self._uploads is not None:
            while self._uploads.staged:
                self._uploads.wait(0.25)
            self._uploads.check()
        again = self._config.interface.again("resume")
        advice = f"the manifest was not written: {again}"
        entries = self._entries(advice)
        for shard in manifest.shards:
            for name, size in (
                (shard.file, shard.num_bytes),
                (shard.index_file, shard.index_bytes),
            ):
                if entries.get(name) != size:
                    found = "missing" if name not in entries else f"{entries[name]} bytes"
                    raise OutputError(
                        f"{self._object_url(name)}: the uploaded object is {found}, not the "
                        f"{size} bytes written; {advice}",
                        self._object_url(name),
                    )
        for name, content in (versions or {}).items():  # before the manifest that names them
            self._call(
                partial(self._fs.pipe_file, self._path(name), content),
                self._object_url(name),
                f"every shard is uploaded and kept: fix the cause, then {again}",
            )
        data = manifest_bytes(manifest)
        self._call(
            lambda: self._fs.pipe_file(self._path(MANIFEST_NAME), data),
            self._object_url(MANIFEST_NAME),
            f"every shard is uploaded and kept: fix the cause, then {again} to write the manifest",
        )
        self._call(
            lambda: self._fs.rm_file(self._path(JOURNAL_NAME)),
            self._object_url(JOURNAL_NAME),
            f"the build is complete, but its journal is left: delete {JOURNAL_NAME} "
            f"from OUT, or {again}",
        )
        self._journal_written = False

    def has_journal(self) -> bool:
        try:
            return bool(self._fs.exists(self._path(JOURNAL_NAME)))
        except Exception:  # unreachable now: what this build knows
            return self._journal_written

    def discard_partial(self) -> None:
        if self._uploads is not None:
            self._uploads.stop()

    def close(self) -> None:
        if self._uploads is not None:
            self._uploads.stop()
        if self._staging is not None:
            self._staging.close()
