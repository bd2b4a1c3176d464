"""Errors raised while streaming shards; all subclass ``shardprep.errors.LoaderError``.

::

    LoaderError
    ├── CorruptShardError       a shard's bytes disagree with its index (.shard, .key, .offset)
    ├── IncompatibleStateError  a resume state from another dataset/seed/world (.field, .saved, .current)
    └── WorldMismatchError      rank/world size cannot be determined consistently
"""

from __future__ import annotations

from typing import Any

from shardprep.errors import LoaderError

__all__ = ["CorruptShardError", "IncompatibleStateError", "LoaderError", "WorldMismatchError"]


class CorruptShardError(LoaderError, OSError):
    """A shard is missing, truncated or corrupt where a sample should be.

    Build one with :meth:`at`; the plain ``CorruptShardError(message)`` form
    exists so the error survives DataLoader's re-raise from a worker.
    """

    def __init__(
        self, message: str, *, shard: str = "", key: str = "", offset: int = -1, reason: str = ""
    ) -> None:
        super().__init__(message)
        self.shard, self.key, self.offset, self.reason = shard, key, offset, reason

    @classmethod
    def at(cls, shard: str, key: str, offset: int, reason: str) -> CorruptShardError:
        """The error for sample ``key`` at byte ``offset`` of ``shard``."""
        return cls(
            f"{shard}: sample {key!r} at offset {offset}: {reason}; run `shardprep verify` on "
            "the output folder and rebuild or restore the shard",
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


class WorldMismatchError(LoaderError, ValueError):
    """Rank and world size are inconsistent (e.g. rank >= world_size)."""


def _rebuild(cls: type[Exception], message: str, attributes: dict[str, Any]) -> Exception:
    error = cls(message)
    error.__dict__.update(attributes)
    return error
