"""--map refusals: a map that changes the key or class, returns no dict or no bytes, or raises.

Each stops the build with a MapError that names the shard, the sample and the map, leaves no
partial file, and keeps the finished shards: --resume with the same map name (the function
fixed in place) finishes the build byte-identical to a clean one; another map, or none, is
refused. The message ends with what to do, saying how many finished shards are kept.
"""

from __future__ import annotations

import pickle
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shardprep
from shardprep.format.errors import InputError, PlanError
from shardprep.format.interface import CLI, PYTHON, Interface
from shardprep.format.manifest import JOURNAL_NAME
from shardprep.format.shardformat import decode_index
from shardprep.transform import MapError, load_map
from tests.faults.helpers import example_raw, map_reference, tree_bytes
from tests.integration import map_functions

SHARDS = 8
HALF = "tests.integration.map_functions:half_size"
FAILING_SHARD = 5


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return example_raw(tmp_path_factory, "map-refusals", 120)


@pytest.fixture(scope="module")
def reference(raw: Path) -> Path:
    return map_reference(raw, SHARDS, HALF)


@pytest.fixture
def fail_key(reference: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """half_size raises on the first sample of shard FAILING_SHARD while this is in use."""
    index = decode_index((reference / f"shard-{FAILING_SHARD:05d}.idx").read_bytes())
    monkeypatch.setenv(map_functions.FAIL_KEY_ENV, index.key(0))
    yield index.key(0)


def _assert_stopped_cleanly(out: Path) -> None:
    assert not (out / "manifest.json").exists()
    assert not [p.name for p in out.iterdir() if p.name.endswith(".partial")]


@pytest.mark.parametrize(
    ("function", "problem"),
    [
        (
            "new_key",
            r"changed the key '(?P<key>[^']+)' to '(?P=key)-x' \(a map must keep __key__\)",
        ),
        ("new_class", r"changed the class member 'cls' from b'\d' to b'\d' \(a map must return"),
        ("drops_class", r"changed the class member 'cls' from b'\d' to None"),
        ("text_payload", r"returned str for member 'txt', not bytes \(encode it, e\.g\."),
        ("returns_none", r"returned NoneType, not a sample dict"),
    ],
)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_sample_the_map_returns_badly_is_refused_naming_it(
    raw: Path, tmp_path: Path, function: str, problem: str, workers: int
) -> None:
    out = tmp_path / "out"
    spec = f"tests.integration.map_functions:{function}"
    with pytest.raises(MapError) as caught:
        shardprep.build(
            str(raw), str(out), shards=SHARDS, workers=workers, map=spec, progress=False
        )
    message = str(caught.value)
    prefix = rf"shard {caught.value.shard_index}: map {spec} on sample '[^']+' \(from '[^']+'\): "
    assert caught.value.shard_index in range(SHARDS)
    assert re.match(prefix + problem, message), message
    assert message.endswith(  # every sample is refused: no shard finished, none is claimed
        f". No shard was finished: fix the function, keeping its name {spec}, and call "
        "shardprep.build again with the same arguments and resume=True"
    )
    assert not list(out.glob("shard-*"))
    _assert_stopped_cleanly(out)


def test_an_exception_stops_the_build_and_resume_with_the_fixed_map_finishes(
    raw: Path, reference: Path, tmp_path: Path, fail_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    with pytest.raises(MapError) as caught:  # one worker: shards 0-4 finish, in order
        shardprep.build(str(raw), str(out), shards=SHARDS, workers=1, map=HALF, progress=False)
    message = str(caught.value)
    assert caught.value.shard_index == FAILING_SHARD
    assert message.startswith(f"shard {FAILING_SHARD}: map {HALF} on sample {fail_key!r} (from ")
    assert "raised ValueError: cannot decode this one (at " in message
    assert "map_functions.py:" in message
    assert message.endswith(
        f". The {FAILING_SHARD} finished shard(s) are kept: fix the function, keeping its name "
        f"{HALF}, and call shardprep.build again with the same arguments and resume=True"
    )
    _assert_stopped_cleanly(out)
    assert (out / JOURNAL_NAME).exists()
    finished = sorted(p.name for p in out.glob("shard-*.tar"))
    assert finished == [f"shard-{s:05d}.tar" for s in range(FAILING_SHARD)]

    # another map, or none, is refused: the finished shards were written by this one
    for other in (None, "tests.integration.map_functions:new_key"):
        with pytest.raises(InputError, match="the interrupted build used other input or options"):
            shardprep.build(
                str(raw), str(out), shards=SHARDS, map=other, resume=True, progress=False
            )

    monkeypatch.delenv(map_functions.FAIL_KEY_ENV)  # "fixed in place": same name
    summary = shardprep.build(
        str(raw), str(out), shards=SHARDS, workers=2, map=HALF, resume=True, progress=False
    )
    assert summary.reused_shards == FAILING_SHARD
    assert tree_bytes(out) == tree_bytes(reference)


def test_a_failure_in_parallel_workers_names_the_sample(
    raw: Path, tmp_path: Path, fail_key: str
) -> None:
    out = tmp_path / "out"
    with pytest.raises(MapError, match=rf"^shard {FAILING_SHARD}: .* on sample {fail_key!r} "):
        shardprep.build(str(raw), str(out), shards=SHARDS, workers=2, map=HALF, progress=False)
    _assert_stopped_cleanly(out)
    assert (out / JOURNAL_NAME).exists()  # the build stays resumable


def test_an_oserror_from_the_map_is_a_map_error_not_an_input_problem(
    raw: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"  # Pillow's UnidentifiedImageError is an OSError
    spec = "tests.integration.map_functions:decodes_garbage"
    with pytest.raises(MapError, match=rf"map {spec} on sample .* raised UnidentifiedImageError"):
        shardprep.build(str(raw), str(out), shards=SHARDS, workers=1, map=spec, progress=False)
    _assert_stopped_cleanly(out)


@pytest.mark.parametrize(("interface", "one_worker"), [(PYTHON, "workers=1"), (CLI, "--workers 1")])
def test_a_map_that_cannot_be_sent_to_workers_names_one_worker_as_the_caller_gives_it(
    interface: Interface, one_worker: str
) -> None:
    """Was: "or use --workers 1" for shardprep.build(..., map=fn) too. Spawned workers and Ray
    tasks get the map pickled; a closure over a lock cannot be (cloudpickle refuses it)."""
    lock = threading.Lock()

    def holds_a_lock(sample: dict[str, Any]) -> dict[str, Any]:
        with lock:
            return sample

    sample_map = load_map(holds_a_lock, interface)
    assert sample_map is not None
    with pytest.raises(PlanError) as info:
        pickle.dumps(sample_map)
    name = f"{__name__}:{holds_a_lock.__qualname__}"
    assert str(info.value).startswith(f"map {name}: cannot be sent to worker processes ("), info
    assert str(info.value).endswith(
        f"); define it at the top level of an importable module, or use {one_worker}"
    ), str(info.value)
    named = pickle.loads(pickle.dumps(load_map(HALF, interface)))  # the wording travels along
    assert named.interface == interface
