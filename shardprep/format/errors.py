"""Exception hierarchy shared by the builder and the loader.

Every error a user can cause (bad input, impossible request, corrupt shard,
incompatible resume state) is a subclass of :class:`ShardprepError`, so a
pipeline can catch one type. The message always names the file, shard or
sample key involved and says what to do about it.

::

    ShardprepError
    ├── InputError            scan: missing/unreadable/unsupported input (.path)
    │   └── DuplicateKeyError two inputs map to one sample key (.key, .paths)
    ├── PlanError             impossible request: N > samples, bad class weights
    ├── WriteError            writing a shard failed (.shard_index)
    ├── WorkersDiedError      the engine's worker processes kept dying on one task (.task)
    ├── OutputError           the output folder, journal or manifest cannot be written (.path)
    ├── ManifestError         missing/unknown/invalid manifest or index (.path)
    │   └── ChecksumMismatchError  a file's sha256 differs (.path, .expected, .actual)
    └── LoaderError           (loader/errors.py adds the loader's subclasses)

    KeyboardInterrupt
    └── BuildInterrupted      Ctrl-C stopped a build; the message says how to go on (.resumable)
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "BuildInterrupted",
    "ChecksumMismatchError",
    "DuplicateKeyError",
    "InputError",
    "LoaderError",
    "ManifestError",
    "OutputError",
    "PlanError",
    "ShardprepError",
    "WorkersDiedError",
    "WriteError",
    "is_interrupt",
]


class ShardprepError(Exception):
    """Base class of every error shardprep raises on purpose."""


class InputError(ShardprepError):
    """The raw input cannot be used as it is (missing, unreadable, malformed)."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple[object, ...]:
        return (InputError, (str(self), self.path))


class DuplicateKeyError(InputError):
    """Two different inputs would become the same sample key."""

    def __init__(self, key: str, paths: Sequence[str], advice: str | None = None) -> None:
        shown = ", ".join(repr(p) for p in paths)
        super().__init__(
            f"duplicate sample key {key!r} from {shown}; "
            + (
                advice
                or "rename one of them (keys are the file name without extension, with '/', "
                "'.' and other special characters replaced)"
            ),
            path=paths[0] if paths else None,
        )
        self.key = key
        self.paths = tuple(paths)
        self.advice = advice  # what to do, where the input's kind knows better than renaming

    def __reduce__(self) -> tuple[object, ...]:
        return (DuplicateKeyError, (self.key, self.paths, self.advice))


class KeyInBuildError(InputError):
    """A sample of an append has a key the build it appends to holds already (``held``: the
    shard, and its version); keys are unique across every version of a build."""

    def __init__(self, key: str, source: str, held: str, advice: str | None = None) -> None:
        super().__init__(
            f"{source}: its sample key {key!r} is already in {held}; keys are unique across "
            f"every version of a build: {advice or 'rename the sample'} or leave it out of the "
            "append. Nothing was written",
            path=source,
        )
        self.key, self.source, self.held, self.advice = key, source, held, advice

    def __reduce__(self) -> tuple[object, ...]:
        return (KeyInBuildError, (self.key, self.source, self.held, self.advice))


class PlanError(ShardprepError):
    """The requested output cannot be made from this input (e.g. more shards than samples)."""


class WriteError(ShardprepError):
    """Writing one shard failed; raised ``from`` the underlying OS or data error."""

    def __init__(self, message: str, shard_index: int) -> None:
        super().__init__(message)
        self.shard_index = shard_index

    def __reduce__(self) -> tuple[object, ...]:
        return (WriteError, (str(self), self.shard_index))


class StalledError(WriteError):
    """No shard made progress for ``stall_timeout`` seconds; the writers were stopped. The
    builder adds what to do (:func:`shardprep.builder.stall_advice`: the shards kept, counted,
    and the option to pass as the caller names it)."""

    def __reduce__(self) -> tuple[object, ...]:
        return (StalledError, (str(self), self.shard_index))


def stalled(shards: list[int], seconds: float) -> StalledError:
    """The error for writes of ``shards`` that made no progress for ``seconds``: what
    happened only (the engine raises it; the builder adds what is kept and what to do)."""
    more = f" (and {len(shards) - 1} more shard(s) being written)" if len(shards) > 1 else ""
    return StalledError(
        f"shard {shards[0]}{more}: no progress for {seconds:g} s (the stall timeout), so its "
        "writers were stopped: a source or OUT may hang (a network filesystem or an object "
        "store that stopped answering)",
        shards[0],
    )


class WorkersDiedError(ShardprepError):
    """The worker process running one task died on every attempt (killed: out of memory, a
    crash), so the engine gave up; ``task`` names it (``"shard 3"``, ``"scan task 2"``)."""

    def __init__(self, message: str, task: str) -> None:
        super().__init__(message)
        self.task = task

    def __reduce__(self) -> tuple[object, ...]:
        return (WorkersDiedError, (str(self), self.task))


class OutputError(ShardprepError):
    """The output folder, the build journal or the manifest cannot be written (disk full, read-only)."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple[object, ...]:
        return (OutputError, (str(self), self.path))


class ManifestError(ShardprepError):
    """A manifest or shard index is missing, of an unknown version, or inconsistent."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple[object, ...]:
        return (ManifestError, (str(self), self.path))


class ChecksumMismatchError(ManifestError):
    """A file's bytes do not match the sha256 recorded in the manifest. Build with :meth:`for_file`."""

    def __init__(
        self, message: str, path: str | None = None, expected: str = "", actual: str = ""
    ) -> None:
        super().__init__(message, path)
        self.expected = expected
        self.actual = actual

    @classmethod
    def for_file(cls, path: str, expected: str, actual: str) -> ChecksumMismatchError:
        """The error for ``path`` whose sha256 is ``actual`` instead of ``expected``."""
        return cls(
            f"{path}: sha256 {actual} does not match the manifest's {expected}; "
            "the file is corrupt or was modified: rebuild it (shardprep build --resume "
            "after deleting the file) or restore it from a copy",
            path,
            expected,
            actual,
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (ChecksumMismatchError, (str(self), self.path, self.expected, self.actual))


class LoaderError(ShardprepError):
    """Base class of errors raised while streaming shards (see ``loader.errors``)."""


class BuildInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a build. A KeyboardInterrupt, so it is never caught as a ShardprepError.

    The message says how to go on: ``resumable`` is True once the build has
    written its journal (run the same command with ``--resume``), False before
    (nothing was written: run the same command again).
    """

    def __init__(self, message: str, resumable: bool) -> None:
        super().__init__(message)
        self.resumable = resumable

    def __reduce__(self) -> tuple[object, ...]:
        return (BuildInterrupted, (str(self), self.resumable))


def is_interrupt(err: BaseException) -> bool:
    """Whether ``err`` is a Ctrl-C: a KeyboardInterrupt, or one that CPython reported as another error.

    The signal handler raises KeyboardInterrupt in whatever Python code runs next, which may
    be a callback inside a C function (an ``isinstance`` check inside ``os.fspath`` under
    ``numpy.fromfile``, say). CPython then reports ``SystemError: ... returned a result with
    an exception set``, with the KeyboardInterrupt as its ``__cause__``. Or it lands in
    ``Thread.start``'s wait just after its ``Condition`` let go of its lock (a thread pool's
    first task, say), and the ``with`` around it reports ``RuntimeError: release unlocked
    lock`` with the KeyboardInterrupt as its ``__context__``. That is still Ctrl-C: the build
    must give its advice and exit 130, not print a traceback
    (tests/faults/test_disguised_interrupt.py).
    """
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, KeyboardInterrupt):
            return True
        if not isinstance(current, SystemError) and not _is_lock_release(current):
            return False
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _is_lock_release(err: BaseException) -> bool:
    """CPython's error for a ``with`` that released a lock the interrupt had already released."""
    return type(err) is RuntimeError and str(err) == "release unlocked lock"
