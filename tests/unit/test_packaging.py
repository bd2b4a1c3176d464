"""The built wheel fits a user's environment: ranges, never exact pins; typed; licensed.

An exact ``torch==`` in the wheel's metadata would make ``pip install shardprep`` replace a
user's CUDA torch; the exact versions CI needs live in ``constraints.txt`` instead.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)],
        check=True,
        timeout=240,
        capture_output=True,
    )
    (path,) = out.glob("shardprep-*.whl")
    return zipfile.ZipFile(path)


def _metadata(wheel: zipfile.ZipFile) -> str:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return wheel.read(name).decode()


def test_no_requirement_is_pinned_exactly(wheel: zipfile.ZipFile) -> None:
    requires = re.findall(r"^Requires-Dist: (.+)$", _metadata(wheel), flags=re.M)
    assert any(r.startswith("torch") for r in requires)
    pinned = [r for r in requires if "==" in r.split(";")[0]]  # the marker has its own ==
    assert pinned == [], f"exact pins belong in constraints.txt, not the package: {pinned}"
    (torch,) = [r for r in requires if re.match(r"torch[<>=!~ ]", r)]
    assert ">=" in torch, torch


def test_constraints_pin_the_ci_torch() -> None:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    assert "torch==2.13.0" in lines


def test_wheel_is_typed_and_licensed(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert {"shardprep/py.typed", "loader/py.typed"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License: Apache-2.0" in _metadata(wheel)
