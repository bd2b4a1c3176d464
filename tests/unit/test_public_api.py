"""The public surface: exported names, and docs that list every CLI option."""

from __future__ import annotations

import re
from pathlib import Path

import loader
import shardprep
from shardprep.cli import cli

ROOT = Path(__file__).resolve().parents[2]


def test_public_api_is_exactly_this() -> None:
    """Adding or removing a public name is a deliberate change: update this list with it."""
    assert shardprep.__all__ == [
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
    assert loader.__all__ == [
        "CorruptShardError",
        "GroupedDataset",
        "IncompatibleStateError",
        "LoaderError",
        "MixedDataset",
        "ReadOptions",
        "RemoteOptions",
        "ShardDataset",
        "UnreachableError",
        "World",
        "WorldMismatchError",
    ]
    for module in (shardprep, loader):
        for name in module.__all__:
            assert getattr(module, name) is not None


def test_every_build_option_is_documented() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    build = cli.commands["build"]
    for param in build.params:
        for opt in getattr(param, "opts", []):
            if opt.startswith("--") and opt != "--help":
                assert re.search(re.escape(opt) + r"\b", text), f"{opt} is not in docs/cli.md"
