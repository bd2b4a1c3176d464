"""The builder never imports torch, the loader package or webdataset."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.processes import run_bounded

FORBIDDEN = ("torch", "loader", "webdataset")

BUILDER_MODULES = (
    "shardprep",
    "shardprep.cli",
    "shardprep.build",
    "shardprep.scan",
    "shardprep.write",
    "shardprep.verify",
    "shardprep.inspect",
    "shardprep.example",
    "shardprep.weighting",
    "shardprep.manifest",
)

PROBE = """
import json, sys
{imports}
names = sorted(m for m in sys.modules if m.split(".")[0] in {forbidden!r})
print(json.dumps(names))
"""


def _imported_after(modules: tuple[str, ...], forbidden: tuple[str, ...] = FORBIDDEN) -> list[str]:
    """Top-level-forbidden modules loaded by importing ``modules`` in a fresh interpreter."""
    imports = "\n".join(f"import {m}" for m in modules)
    result = run_bounded(
        [sys.executable, "-c", PROBE.format(imports=imports, forbidden=forbidden)], timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_builder_does_not_import_torch_loader_or_webdataset() -> None:
    # Importing them all at once checks the union: if it is clean, each one is.
    assert _imported_after(BUILDER_MODULES) == []


BUILD = """
import json, os, sys
import shardprep
from shardprep.verify import verify_output
root = sys.argv[1]
for c in ("a", "b"):
    os.makedirs(os.path.join(root, "raw", c))
    for i in range(3):
        with open(os.path.join(root, "raw", c, "%d.bin" % i), "wb") as f:
            f.write(b"x" * i)
out = os.path.join(root, "out")
shardprep.build(os.path.join(root, "raw"), out, shards=2, workers=2, compression="zstd",
                progress=False)
assert not verify_output(out).problems
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {forbidden!r})))
"""


def test_a_build_does_not_import_them_either(tmp_path: Path) -> None:
    result = run_bounded(
        [sys.executable, "-c", BUILD.format(forbidden=FORBIDDEN), str(tmp_path)], timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
    assert len(list((tmp_path / "out").glob("shard-*.tar.zst"))) == 2


def test_the_probe_detects_an_import() -> None:
    """The check itself works: it sees what the builder does import."""
    assert "numpy" in _imported_after(("shardprep",), forbidden=("numpy", "torch"))
    assert _imported_after(("json",), forbidden=("numpy",)) == []
