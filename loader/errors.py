"""Errors raised while streaming shards; all subclass ``shardprep.format.errors.LoaderError``.

::

    LoaderError
    ├── CorruptShardError       a shard's bytes disagree with its index (.shard, .key, .offset)
    ├── IncompatibleStateError  a resume state from another dataset/seed/world (.field, .saved, .current)
    ├── UnreachableError        a remote read kept failing: server down, silent or cutting off (.url)
    └── WorldMismatchError      rank/world size cannot be determined consistently

    RequestRefusedError (an OSError, not a LoaderError: what one fetch attempt raises, before
    the retry loop of ``loader.io.source`` turns failures into ``UnreachableError``)
"""

from __future__ import annotations

import ast
import re
from typing import Any

from shardprep.format.errors import LoaderError

__all__ = [
    "CorruptShardError",
    "IncompatibleStateError",
    "LoaderError",
    "RequestRefusedError",
    "UnreachableError",
    "WorldMismatchError",
]


class CorruptShardError(LoaderError, OSError):
    """A shard is missing, truncated or corrupt where a sample should be.

    Build one with :meth:`at`; the plain ``CorruptShardError(message)`` form
    exists so the error survives DataLoader's re-raise from a worker.
    """

    def __init__(
        self, message: str, *, shard: str = "", key: str = "", offset: int = -1, reason: str = ""
    ) -> None:
        super().__init__(message)
        if not shard:  # DataLoader's re-raise from a worker passes only its message
            shard, key, offset, reason = _fields_in(message) or (shard, key, offset, reason)
        self.shard, self.key, self.offset, self.reason = shard, key, offset, reason

    @classmethod
    def at(cls, shard: str, key: str, offset: int, reason: str) -> CorruptShardError:
        """The error for sample ``key`` at byte ``offset`` of ``shard``."""
        return cls(
            f"{shard}: sample {key!r} at offset {offset}: {reason}{_ADVICE}",
            shard=shard,
            key=key,
            offset=offset,
            reason=reason,
        )

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (CorruptShardError, str(self), self.__dict__))


class IncompatibleStateError(LoaderError, ValueError):
    """A resume state does not belong to this dataset, seed or world shape. Build with :meth:`field_differs`."""

    def __init__(
        self, message: str, *, field: str = "", saved: Any = None, current: Any = None
    ) -> None:
        super().__init__(message)
        self.field, self.saved, self.current = field, saved, current

    @classmethod
    def field_differs(
        cls, field: str, saved: Any, current: Any, hint: str = ""
    ) -> IncompatibleStateError:
        """The error for a saved ``field`` that differs from the current run's."""
        return cls(
            f"cannot resume: the saved state has {field}={saved!r} but this run has "
            f"{field}={current!r}{'; ' + hint if hint else ''}",
            field=field,
            saved=saved,
            current=current,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (IncompatibleStateError, str(self), self.__dict__))


class UnreachableError(LoaderError, ConnectionError):
    """A remote file could not be read: every attempt failed with a transport error.

    Build one with :meth:`after`; ``.url`` is the file's URL.
    """

    def __init__(self, message: str, *, url: str = "") -> None:
        super().__init__(message)
        self.url = url

    @classmethod
    def after(
        cls, url: str, attempts: int, seconds: float, last: BaseException, timeouts: str
    ) -> UnreachableError:
        """The error for ``url`` after ``attempts`` failed attempts over ``seconds``."""
        return cls(
            f"{url}: could not reach the server: {attempts} attempts failed in {seconds:.1f} s "
            f"(last: {type(last).__name__}: {last or 'no details'}); check the URL, the network "
            f"and that the server is up ({timeouts}; see RemoteOptions in docs/loader.md)",
            url=url,
        )

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (UnreachableError, str(self), self.__dict__))


class WorldMismatchError(LoaderError, ValueError):
    """Rank and world size are inconsistent (e.g. rank >= world_size)."""


_ADVICE = "; run `shardprep verify` on the output folder and rebuild or restore the shard"
# what ``CorruptShardError.at`` writes, as the last line of the traceback that DataLoader's
# re-raise from a worker puts in its message (``torch._utils.ExceptionWrapper``)
_AT = re.compile(
    r"CorruptShardError: (?P<shard>[^\n]+?): sample (?P<key>'(?:[^'\\\n]|\\.)*'|"
    r'"(?:[^"\\\n]|\\.)*") at offset (?P<offset>-?\d+): (?P<reason>[^\n]*)'
    + re.escape(_ADVICE)
    + r"\s*$"
)


def _fields_in(message: str) -> tuple[str, str, int, str] | None:
    """(shard, key, offset, reason) of a ``CorruptShardError.at`` message that a DataLoader
    worker's traceback ends with; None for any other message."""
    match = _AT.search(message)
    if match is None or not message.startswith("Caught CorruptShardError"):
        return None
    try:
        key = ast.literal_eval(match["key"])
    except (ValueError, SyntaxError):
        return None
    if not isinstance(key, str):
        return None
    return match["shard"], key, int(match["offset"]), match["reason"]


def _rebuild(cls: type[Exception], message: str, attributes: dict[str, Any]) -> Exception:
    error = cls(message)
    error.__dict__.update(attributes)
    return error


class RequestRefusedError(OSError):
    """The server refused a request for a reason another attempt will not change (an HTTP 4xx
    other than 401/403/404, which are ``PermissionError`` and ``FileNotFoundError``)."""
