"""shardprep: turn a raw dataset into N balanced, stratified WebDataset tar shards.

The builder never imports torch. Its stages are the modules ``scan`` →
``plan`` → ``write`` → ``manifest``, orchestrated by ``build``. The streaming
side lives in the separate ``loader`` package.
"""

from __future__ import annotations

from shardprep.build import BuildSummary, build
from shardprep.config import BuildConfig
from shardprep.errors import (
    ChecksumMismatchError,
    DuplicateKeyError,
    InputError,
    LoaderError,
    ManifestError,
    PlanError,
    ShardprepError,
    WriteError,
)
from shardprep.manifest import Manifest, ShardEntry, read_manifest

__version__ = "0.1.0"

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
