"""The public surface: exported names, and docs that list every CLI option."""

from __future__ import annotations

import re
from pathlib import Path

import loader
import shardprep
from shardprep.cli import cli

ROOT = Path(__file__).resolve().parents[2]


def test_exports_are_sorted_and_complete() -> None:
    for module in (shardprep, loader):
        public = sorted(name for name in vars(module) if not name.startswith("_") and name[0].isupper() or name in ("build", "read_manifest"))
        assert module.__all__ == sorted(module.__all__)
        assert set(module.__all__) >= {n for n in public if n in dir(module) and not n.startswith("_")} & set(module.__all__)
        for name in module.__all__:
            assert hasattr(module, name)


def test_every_build_option_is_documented() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    build = cli.commands["build"]
    for param in build.params:
        for opt in getattr(param, "opts", []):
            if opt.startswith("--") and opt != "--help":
                assert re.search(re.escape(opt) + r"\b", text), f"{opt} is not in docs/cli.md"
