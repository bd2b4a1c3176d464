"""--map: a Pillow resize run in the write tasks, byte-identical over --workers and engines.

The local builds run in the module fixture, before the Ray tests start their instance (the
local engine forks, which a process holding Ray's threads should not); the Ray tests come last.
"""

from __future__ import annotations

import io
import json
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

import shardprep
from loader.core import ShardStream
from shardprep.example import IMAGE_SIZE, write_example
from shardprep.format.errors import PlanError
from shardprep.transform import MapError, SampleMap, load_map
from shardprep.verify import verify_output
from tests.integration import map_functions
from tests.integration.map_functions import half_size, resize_png
from tests.processes import run_bounded

SHARDS = 8
SAMPLES = 300
HALF = "tests.integration.map_functions:half_size"
REPO = Path(__file__).resolve().parents[2]


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def _samples(out: Path, decode: bool = False) -> dict[str, dict[str, Any]]:
    stream = ShardStream(str(out), decode=decode, shuffle=False)
    return {s["__key__"]: s for s in stream.iterate(0, rank=0, world_size=1)}


class Data:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.raw = base / "raw"
        write_example(str(self.raw), SAMPLES, 5, 0)
        self.plain = base / "plain"
        shardprep.build(str(self.raw), str(self.plain), shards=SHARDS, workers=1, progress=False)
        self.mapped: dict[int, Path] = {}
        for workers in (1, 2):
            out = base / f"mapped-{workers}"
            shardprep.build(
                str(self.raw), str(out), shards=SHARDS, workers=workers, map=HALF, progress=False
            )
            self.mapped[workers] = out
        # a closure, in forked workers: nothing is pickled, any callable works
        factor = 2
        self.closure = base / "closure-2"
        shardprep.build(
            str(self.raw),
            str(self.closure),
            shards=SHARDS,
            workers=2,
            map=lambda s: {**s, "png": resize_png(s["png"], factor)},
            progress=False,
        )


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    return Data(tmp_path_factory.mktemp("map"))


def test_workers_1_and_2_write_identical_trees(data: Data) -> None:
    one, two = _files(data.mapped[1]), _files(data.mapped[2])
    assert one == two
    assert sorted(one) == sorted(_files(data.plain))  # same files: shards, indexes, manifest
    plain = _files(data.plain)
    assert [n for n in one if one[n] == plain[n]] == []  # every shard and index is rewritten


def test_the_loader_reads_back_the_resized_images(data: Data) -> None:
    plain, mapped = _samples(data.plain, decode=True), _samples(data.mapped[2], decode=True)
    assert len(mapped) == SAMPLES and sorted(mapped) == sorted(plain)  # same keys
    half = IMAGE_SIZE // 2
    for key, sample in mapped.items():
        assert sample["png"].shape == (3, half, half), key
        assert sample["cls"] == plain[key]["cls"]  # the class is kept
        assert sorted(sample) == sorted(plain[key])  # same members
    raw = _samples(data.plain)
    key = sorted(raw)[7]  # the mapped payload is exactly the function's output
    assert _samples(data.mapped[1])[key]["png"] == resize_png(raw[key]["png"])


def test_index_and_manifest_record_the_written_sizes(data: Data) -> None:
    report = verify_output(str(data.mapped[1]))  # sizes, checksums, offsets against the bytes
    assert report.problems == [] and report.num_samples == SAMPLES
    manifest = json.loads((data.mapped[1] / "manifest.json").read_text())
    plain = json.loads((data.plain / "manifest.json").read_text())
    assert manifest["options"]["map"] == HALF
    assert "map" not in plain["options"]  # a build without --map records none
    assert manifest["totals"]["tar_bytes"] < plain["totals"]["tar_bytes"]
    total = sum(p.stat().st_size for p in data.mapped[1].glob("shard-*.tar"))
    assert total == manifest["totals"]["num_bytes"]


def test_a_closure_in_forked_workers_writes_the_same_shards(data: Data) -> None:
    closure, named = _files(data.closure), _files(data.mapped[2])
    shards = [name for name in named if name != "manifest.json"]
    assert {n: closure[n] for n in shards} == {n: named[n] for n in shards}
    manifest = json.loads(closure["manifest.json"])
    assert manifest["options"]["map"] == (
        "tests.integration.test_map:Data.__init__.<locals>.<lambda>"
    )


def test_the_cli_imports_the_map_from_the_current_folder(data: Data, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    command = [sys.executable, "-m", "shardprep", "build", str(data.raw), str(out)]
    result = run_bounded(
        [*command, "-n", str(SHARDS), "-j", "2", "--map", HALF, "-q"], timeout=240, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert _files(out) == _files(data.mapped[1])


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("tests.integration.no_such_module:fn", "cannot import it (ModuleNotFoundError"),
        ("tests.integration.map_functions:no_such", "cannot import it (AttributeError"),
        ("tests.integration.map_functions:FAIL_KEY_ENV", "str is not callable"),
        ("half_size", "give MODULE:FUNCTION"),
    ],
)
def test_the_cli_refuses_a_map_that_does_not_import(
    data: Data, tmp_path: Path, spec: str, problem: str
) -> None:
    out = tmp_path / "refused"
    command = [sys.executable, "-m", "shardprep", "build", str(data.raw), str(out), "-n", "2"]
    result = run_bounded([*command, "--map", spec, "-q"], timeout=120, cwd=REPO)
    assert result.returncode == 2, result.stderr  # a usage error, before anything is written
    assert f"--map {spec}" in result.stderr or f"--map {spec!r}" in result.stderr
    assert problem in result.stderr
    assert not out.exists()


def test_a_map_is_refused_at_build_start_in_python(data: Data, tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="need a callable or 'MODULE:FUNCTION'"):
        shardprep.build(str(data.raw), str(tmp_path / "x"), shards=2, map=42)
    assert not (tmp_path / "x").exists()


def test_a_map_pickles_by_name_or_by_value() -> None:
    named = load_map(HALF)
    assert named is not None
    blob = pickle.dumps(named)
    assert b"tests.integration.map_functions:half_size" in blob and len(blob) < 200
    assert b"_by_name" in blob and b"_by_value" not in blob  # no cloudpickle needed to load
    assert pickle.loads(blob).fn is half_size
    same = load_map(half_size)  # a callable gets its __module__:__qualname__ as name
    assert same == named
    factor = 4  # a closure: by value through cloudpickle, for spawned workers and Ray
    closure = load_map(lambda s: {**s, "png": resize_png(s["png"], factor)})
    assert closure is not None
    copy = pickle.loads(pickle.dumps(closure))
    assert isinstance(copy, SampleMap) and copy.name == closure.name
    png = Image.new("RGB", (32, 32), (200, 10, 10))
    buffer = io.BytesIO()
    png.save(buffer, format="PNG")
    result = copy({"__key__": "k", "png": buffer.getvalue()})
    assert Image.open(io.BytesIO(result["png"])).size == (8, 8)


# --- Ray (last: the instance lives until the module ends) -----------------------------


@pytest.fixture(scope="module")
def cluster(data: Data) -> Iterator[None]:
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_ray_tasks_write_the_same_tree(data: Data, cluster: None) -> None:
    out = data.base / "mapped-ray"
    shardprep.build(str(data.raw), str(out), shards=SHARDS, engine="ray", map=HALF, progress=False)
    assert _files(out) == _files(data.mapped[1])


def test_a_lambda_travels_to_ray_tasks_by_value(data: Data, cluster: None) -> None:
    out = data.base / "lambda-ray"
    shardprep.build(
        str(data.raw),
        str(out),
        shards=SHARDS,
        engine="ray",
        map=lambda s: {**s, "png": resize_png(s["png"])},
        progress=False,
    )
    written, named = _files(out), _files(data.mapped[1])
    assert {n: b for n, b in written.items() if n != "manifest.json"} == {
        n: b for n, b in named.items() if n != "manifest.json"
    }


def test_a_refusal_in_a_ray_task_names_the_sample(data: Data, cluster: None) -> None:
    out = data.base / "new-key-ray"
    with pytest.raises(MapError, match=r"^shard \d: map .*:new_key on sample '[^']+' ") as err:
        shardprep.build(
            str(data.raw),
            str(out),
            shards=SHARDS,
            engine="ray",
            map=map_functions.new_key,
            progress=False,
        )
    assert not (out / "manifest.json").exists()
    assert not list(out.glob(".*.partial"))
    assert str(err.value).startswith(f"shard {err.value.shard_index}: ")
    assert "changed the key" in str(err.value)
