"""The builder never imports torch, the loader package or webdataset."""

from __future__ import annotations

import json
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


# docs/architecture.md, "Layers": the loader's parts, lowest first. A module may import its own
# part and the parts below it, never one above (tested statically and in a fresh interpreter).
LAYERS = (
    "loader.errors",
    "loader.plan",
    "loader.io",
    "loader.options",
    "loader.read",
    "loader.core",
    "loader.compose",
    "loader.torch",
    "loader",
)
MAX_MODULES = 12  # per folder: a newcomer scans one at a glance


def _loader_modules() -> dict[str, Path]:
    import loader

    root = Path(loader.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _layer(module: str) -> int:
    """The index in LAYERS of the part ``module`` belongs to."""
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS.index(best)


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every ``loader`` module ``path`` imports, at any depth of the file (lazy and
    type-checking imports included: a cycle through them still ties the modules)."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("loader"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("loader"))
    return {m for m in found if m in modules}


def test_each_part_imports_only_the_parts_below_it() -> None:
    modules = _loader_modules()
    assert {m.rsplit(".", 1)[0] for m in modules if m.count(".") == 2} == {
        "loader.plan", "loader.io", "loader.read", "loader.compose", "loader.torch"
    }  # fmt: skip
    upward = [
        f"{name} -> {dep}"
        for name, path in modules.items()
        for dep in sorted(_imports(path, modules))
        if _layer(dep) > _layer(name)
    ]
    assert upward == []


def test_no_import_cycles_and_small_folders() -> None:
    modules = _loader_modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, trail: tuple[str, ...]) -> None:
        assert name not in trail, " -> ".join((*trail[trail.index(name) :], name))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, (*trail, name))
        done.add(name)

    for name in graph:
        visit(name, ())
    per_folder: dict[str, int] = {}
    for path in modules.values():
        if path.name != "__init__.py":
            per_folder[path.parent.name] = per_folder.get(path.parent.name, 0) + 1
    assert max(per_folder.values()) <= MAX_MODULES, per_folder


def test_the_layering_check_sees_an_upward_import() -> None:
    """The checks themselves work: an import of a higher part is seen, and ordered."""
    assert _layer("loader.plan.order") < _layer("loader.io.source") < _layer("loader.torch.batch")
    modules = _loader_modules()
    assert "loader.plan.reads" in _imports(modules["loader.io.readahead"], modules)
    assert "loader.torch.batch" in _imports(modules["loader.torch.assemble"], modules)


def test_in_a_fresh_interpreter_no_part_loads_one_above_it() -> None:
    """Importing every module of a part (top-level imports) loads no module of a part above
    it; below ``loader.torch`` nothing loads torch."""
    modules = _loader_modules()
    package = set(_imported_after(("loader",), forbidden=("loader",)))  # loaded by any import
    assert "loader.torch.dataset" not in package  # (``loader`` loads its torch layer lazily)
    for i, part in enumerate(LAYERS[:-1]):
        mine = tuple(m for m in modules if _layer(m) == i)
        above = LAYERS[i + 1 : -1]
        probe = _imported_after(mine, forbidden=("loader", "torch"))
        higher = [m for m in probe if m in modules and _layer(m) > i and m not in package]
        assert higher == [], (part, above, higher)
        if part != "loader.torch":
            assert [m for m in probe if m.split(".")[0] == "torch"] == [], part


def test_only_loader_torch_imports_torch() -> None:
    """``import loader`` and every module outside ``loader.torch``, imported together in a
    fresh interpreter, load no torch (the union is clean, so each one is)."""
    modules = _loader_modules()
    others = tuple(m for m in modules if not m.startswith("loader.torch"))
    assert len(others) >= 30
    assert _imported_after(others, forbidden=("torch",)) == []
