"""Every test a page of the docs names exists: a "tested by" line cannot point at nothing.

README.md and docs/*.md back their promises with references such as
``tests/integration/test_build.py::test_name``; this test fails when the file is gone or when it
defines no function or class of that name (a renamed or deleted test).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REFERENCE = re.compile(r"\btests/[\w/]+\.py(?:::\w+)?")


@cache
def _names(path: Path) -> frozenset[str]:
    """The functions and classes ``path`` defines, at any depth (test classes hold methods)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return frozenset(node.name for node in ast.walk(tree) if isinstance(node, kinds))


def _references() -> list[tuple[str, int, str]]:
    found = []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), start=1):
            found += [(page.name, number, ref) for ref in REFERENCE.findall(line)]
    return found


def test_the_pages_name_tests() -> None:
    assert len(_references()) >= 30


def test_every_named_test_exists() -> None:
    missing = []
    for page, number, ref in _references():
        file, _, name = ref.partition("::")
        path = ROOT / file
        if not path.is_file():
            missing.append(f"{page}:{number}: {file} does not exist")
        elif name and name not in _names(path):
            missing.append(f"{page}:{number}: {file} defines no {name}")
    assert missing == []
