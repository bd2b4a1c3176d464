"""Issue 37 item 4 on Ray: ``--append --engine ray`` writes the same bytes as a local append,
into a folder and into S3 (moto), where the Ray tasks upload their shards themselves.

One real local Ray instance (2 CPUs) for the module; the local reference append runs before it
starts (the local engine forks, which a process holding Ray's threads should not).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shardprep
from tests.integration.test_append import BASE, NEW, make_raw

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a real Ray instance: seconds
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import fsspec  # noqa: E402

from tests.s3 import S3Server  # noqa: E402


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


class Data:
    def __init__(self, root: Path) -> None:
        self.base = make_raw(root / "base", BASE, 0)
        self.new = make_raw(root / "new", NEW, 1000)
        self.root = root
        reference = root / "reference"
        shardprep.build(str(self.base), str(reference), shards=4, workers=1, progress=False)
        shardprep.build(
            str(self.new), str(reference), shards=3, append=True, workers=2, progress=False
        )
        self.reference = _files(reference)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Data]:
    made = Data(tmp_path_factory.mktemp("append-ray"))
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield made
    finally:
        ray.shutdown()


def test_append_on_ray_is_the_local_append(data: Data) -> None:
    out = data.root / "ray-folder"
    shardprep.build(str(data.base), str(out), shards=4, workers=1, progress=False)
    summary = shardprep.build(
        str(data.new), str(out), shards=3, append=True, engine="ray", progress=False
    )
    assert (summary.version, summary.first_shard, summary.num_shards) == (2, 4, 3)
    assert _files(out) == data.reference
    with S3Server() as s3:
        s3.create_bucket("ray")
        options: dict[str, Any] = {"storage_options": s3.storage_options(), "progress": False}
        shardprep.build(str(data.base), "s3://ray/out", shards=4, workers=1, **options)
        shardprep.build(
            str(data.new), "s3://ray/out", shards=3, append=True, engine="ray", **options
        )
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
        objects = {p[len("ray/out/") :]: fs.cat_file(p) for p in sorted(fs.find("ray/out"))}
    assert objects == data.reference
