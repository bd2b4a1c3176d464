"""shardprep: turn a raw dataset into N balanced, stratified WebDataset tar shards.

The builder never imports torch. Its stages are the modules ``scan`` →
``plan`` → ``write`` → ``manifest``, orchestrated by ``builder``. The format
both sides share is ``shardprep.format``; the streaming side lives in the
separate ``loader`` package, which imports only that.

The public names below are loaded on first use, so that ``import
shardprep.format`` (what the loader does) loads none of the build.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "BuildConfig": "shardprep.config",
    "BuildSummary": "shardprep.builder",
    "build": "shardprep.builder",
    "ChecksumMismatchError": "shardprep.format.errors",
    "DuplicateKeyError": "shardprep.format.errors",
    "InputError": "shardprep.format.errors",
    "LoaderError": "shardprep.format.errors",
    "ManifestError": "shardprep.format.errors",
    "PlanError": "shardprep.format.errors",
    "ShardprepError": "shardprep.format.errors",
    "WriteError": "shardprep.format.errors",
    "Manifest": "shardprep.format.manifest",
    "ShardEntry": "shardprep.format.manifest",
    "read_manifest": "shardprep.format.manifest",
}

__all__ = [
    "BuildConfig",
    "BuildSummary",
    "ChecksumMismatchError",
    "DuplicateKeyError",
    "InputError",
    "LoaderError",
    "Manifest",
    "ManifestError",
    "PlanError",
    "ShardEntry",
    "ShardprepError",
    "WriteError",
    "build",
    "read_manifest",
]

if TYPE_CHECKING:
    from shardprep.builder import BuildSummary, build
    from shardprep.config import BuildConfig
    from shardprep.format.errors import (
        ChecksumMismatchError,
        DuplicateKeyError,
        InputError,
        LoaderError,
        ManifestError,
        PlanError,
        ShardprepError,
        WriteError,
    )
    from shardprep.format.manifest import Manifest, ShardEntry, read_manifest


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'shardprep' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
