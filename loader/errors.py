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
    """A shard is missing, truncated or corrupt where a sample should be."""

    def __init__(self, shard: str, key: str, offset: int, reason: str) -> None:
        super().__init__(
            f"{shard}: sample {key!r} at offset {offset}: {reason}; run `shardprep verify` on "
            "the output folder and rebuild or restore the shard"
        )
        self.shard, self.key, self.offset, self.reason = shard, key, offset, reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (CorruptShardError, (self.shard, self.key, self.offset, self.reason))


class IncompatibleStateError(LoaderError, ValueError):
    """A resume state does not belong to this dataset, seed or world shape."""

    def __init__(self, field: str, saved: Any, current: Any, hint: str = "") -> None:
        super().__init__(
            f"cannot resume: the saved state has {field}={saved!r} but this run has "
            f"{field}={current!r}{'; ' + hint if hint else ''}"
        )
        self.field, self.saved, self.current, self.hint = field, saved, current, hint

    def __reduce__(self) -> tuple[Any, ...]:
        return (IncompatibleStateError, (self.field, self.saved, self.current, self.hint))


class WorldMismatchError(LoaderError, ValueError):
    """Rank and world size are inconsistent (e.g. rank >= world_size)."""
