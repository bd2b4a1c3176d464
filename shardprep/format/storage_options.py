"""Storage options: how fsspec ``storage_options`` combine with defaults. Pure.

Both sides open URLs with defaults of their own (the builder's
``shardprep.storage.S3_DEFAULTS``, the loader's ``loader.io.source``) and the
user's ``storage_options`` on top, by the same rule: one key deep, so
``config_kwargs={"read_timeout": 300}`` keeps the other defaults of
``config_kwargs``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["merge_options"]


def merge_options(defaults: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` over ``defaults``, one level deep where both values are mappings."""
    merged = dict(defaults)
    for key, value in options.items():
        base = merged.get(key)
        if isinstance(base, Mapping) and isinstance(value, Mapping):
            merged[key] = {**base, **value}
        else:
            merged[key] = value
    return merged
