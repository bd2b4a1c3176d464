"""The builder never imports torch, the loader package or webdataset."""

from __future__ import annotations

import json
import pkgutil
import sys
from pathlib import Path

import pytest

from tests.processes import run_bounded

FORBIDDEN = ("torch", "loader", "webdataset")

BUILDER_MODULES = (
    "shardprep",
    "shardprep.cli",
    "shardprep.builder",
    "shardprep.scan",
    "shardprep.write",
    "shardprep.verify",
    "shardprep.inspect",
    "shardprep.example",
    "shardprep.weighting",
    "shardprep.format.manifest",
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
    assert "numpy" in _imported_after(("shardprep.builder",), forbidden=("numpy", "torch"))
    assert _imported_after(("json",), forbidden=("numpy",)) == []


LOADER_EPOCH = """
import json, sys
{imports}
out = sys.argv[1]
{epoch}
loaded = sorted(sys.modules)
print(json.dumps(loaded))
"""


def _loaded_by_an_epoch(out: Path, imports: str, epoch: str) -> list[str]:
    code = LOADER_EPOCH.format(imports=imports, epoch=epoch)
    result = run_bounded([sys.executable, "-c", code, str(out)], timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _builder_modules(names: list[str]) -> list[str]:
    """Modules of ``shardprep`` outside the format contract (``shardprep.format``)."""
    return [m for m in names if m.startswith("shardprep.") and not m.startswith("shardprep.format")]


@pytest.fixture(scope="module")
def png_output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shardprep.builder import build
    from shardprep.example import write_example

    root = tmp_path_factory.mktemp("contract")
    write_example(str(root / "raw"), num_samples=12, num_classes=3)
    build(str(root / "raw"), str(root / "out"), shards=2, progress=False)
    return root / "out"


def test_the_core_loader_and_an_epoch_load_only_the_format_contract(png_output: Path) -> None:
    """``import loader.core`` plus a decoded epoch: no torch, tqdm, click or builder module;
    images come back as NumPy arrays."""
    epoch = (
        "from loader.core import ShardStream\n"
        "import numpy as np\n"
        "batches = list(ShardStream(out, batch_size=4, decode=True).iterate(0))\n"
        "assert sum(len(b['__key__']) for b in batches) == 12, batches\n"
        "assert all(type(b['png']) is np.ndarray and b['png'].dtype == np.uint8 "
        "and b['png'].shape[1:] == (3, 32, 32) for b in batches)\n"
    )
    loaded = _loaded_by_an_epoch(png_output, "import loader.core", epoch)
    top = {m.split(".")[0] for m in loaded}
    assert top & {"torch", "tqdm", "click"} == set()
    assert _builder_modules(loaded) == []
    assert "shardprep.format.manifest" in loaded  # the probe sees the contract it does load


def test_the_torch_dataset_and_an_epoch_load_no_builder_module(png_output: Path) -> None:
    epoch = (
        "from loader import ShardDataset\n"
        "import torch\n"
        "batches = list(ShardDataset(out, batch_size=4, decode=True))\n"
        "assert sum(len(b['__key__']) for b in batches) == 12\n"
        "assert all(isinstance(b['png'], torch.Tensor) for b in batches)\n"
    )
    loaded = _loaded_by_an_epoch(png_output, "", epoch)
    assert _builder_modules(loaded) == []
    assert "click" not in {m.split(".")[0] for m in loaded}  # (torch itself imports tqdm)
    assert "torch" in loaded


# docs/architecture.md: the torch layer of ``loader``; every other module must not load torch.
TORCH_LAYER = frozenset(
    {"torchlayer", "dataset", "mixdataset", "stream", "epochs", "guards", "batch", "assemble",
     "scatter", "arena", "torchoutput"}
)  # fmt: skip


def test_only_the_torch_layer_of_loader_imports_torch() -> None:
    """``import loader`` and every module outside the torch layer, imported together in a fresh
    interpreter, load no torch (the union is clean, so each one is)."""
    import loader

    names = sorted(m.name for m in pkgutil.iter_modules(loader.__path__))
    assert set(names) >= TORCH_LAYER  # a renamed module must be renamed here and in the page
    others = tuple(f"loader.{n}" for n in names if n not in TORCH_LAYER)
    assert len(others) >= 20
    assert _imported_after(("loader", *others), forbidden=("torch",)) == []
