"""Shared fixtures: small raw datasets with computable contents, and built outputs."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import shardprep
from shardprep.example import write_example

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

# A suite started in the background of a non-interactive shell (`pytest ... &`, nohup) inherits
# SIGINT ignored; so would every process a test starts, and Python then installs no
# KeyboardInterrupt handler: the Ctrl-C tests would see their command run to the end (exit 0).
# A handled signal is reset to the default in an exec'd child, an ignored one is not.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def payload(label: int, index: int) -> bytes:
    """Deterministic, unique content of sample ``index`` of class ``label`` (varying size)."""
    head = f"class={label} index={index};".encode()
    return head + bytes((index * 7 + k) % 251 for k in range(37 * (index % 23) + 5))


def write_class_folders(root: Path, counts: dict[str, int], repeat: int = 1) -> Path:
    """Write ``root/<class>/<index:05d>.bin`` holding ``payload(label, index) * repeat``.

    Classes are numbered in sorted order, indices run over all classes.
    """
    index = 0
    for label, (cls, count) in enumerate(sorted(counts.items())):
        folder = root / cls
        folder.mkdir(parents=True)
        for _ in range(count):
            (folder / f"{index:05d}.bin").write_bytes(payload(label, index) * repeat)
            index += 1
    return root


@pytest.fixture
def make_class_folders(tmp_path: Path) -> Callable[..., Path]:
    """``make_class_folders({"cat": 7, "dog": 3})`` → a RAW folder with those counts."""

    def make(counts: dict[str, int], name: str = "raw") -> Path:
        return write_class_folders(tmp_path / name, counts)

    return make


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A built output: 3 classes (60/30/13 = 103 samples), 8 shards, plain tar."""
    base = tmp_path_factory.mktemp("built")
    raw = write_class_folders(base / "raw", {"a": 60, "b": 30, "c": 13})
    shardprep.build(str(raw), str(base / "out"), shards=8, workers=1, progress=False)
    return base / "out"


@pytest.fixture(scope="session")
def built_zstd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Like ``built`` but 1001 samples in 10 zstd shards (several frames per shard)."""
    base = tmp_path_factory.mktemp("built_zstd")
    raw = write_class_folders(base / "raw", {"a": 600, "b": 300, "c": 101}, repeat=40)
    shardprep.build(
        str(raw), str(base / "out"), shards=10, workers=1, compression="zstd", progress=False
    )
    return base / "out"


@pytest.fixture(scope="session")
def example_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's example (``shardprep example``: 1000 PNG images, 5 classes), built into
    ``out`` (8 shards) beside its ``raw``. Read-only: tests build elsewhere."""
    base = tmp_path_factory.mktemp("example")
    write_example(str(base / "raw"))
    shardprep.build(str(base / "raw"), str(base / "out"), shards=8, workers=1, progress=False)
    return base / "out"
