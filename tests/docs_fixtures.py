"""What the Python blocks of README.md and docs/*.md need to run as written (see ../conftest.py).

A page's blocks read and write paths like ``"OUT"``, ``"RAW"``, ``"export/"`` and call a
reader's own functions (``samples()``, ``resize_and_encode``, ``my_pipeline()``). Each page
runs in a fresh folder of its own (its current directory, and first on ``sys.path`` so a block
saved as ``prep.py`` imports), holding those paths, with those names in its namespace:
:data:`PAGES` says which, per page. The data are small real builds, made once per session
(per xdist worker) and linked into the page folders; nothing is a stand-in for shardprep.
"""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

import shardprep
from shardprep.example import write_example

NUM_SAMPLES = 256  # 4 batches of 64 (the pages' batch size); 4 samples per shard at 64 shards
NUM_CLASSES = 4


def resize_and_encode(sample: dict[str, Any]) -> dict[str, Any]:
    """A reader's map (README.md): the PNG at half size, re-encoded as JPEG (same key and class)."""
    with Image.open(io.BytesIO(sample.pop("png"))) as image:
        small = image.convert("RGB").resize((image.width // 2, image.height // 2))
    out = io.BytesIO()
    small.save(out, format="JPEG", quality=90)
    sample["jpg"] = out.getvalue()
    return sample


class DocData:
    """The session's small builds, each made on first use in ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @functools.cached_property
    def png_raw(self) -> Path:
        """Class folders of 32x32 PNGs (``shardprep example``): 256 samples, 4 classes."""
        raw = self.root / "png-raw"
        write_example(str(raw), num_samples=NUM_SAMPLES, num_classes=NUM_CLASSES)
        return raw

    @functools.cached_property
    def png_out(self) -> Path:
        """``png_raw`` built into 8 shards: members ``png`` and ``cls``."""
        out = self.root / "png-out"
        shardprep.build(str(self.png_raw), str(out), shards=8, workers=1, progress=False)
        return out

    @functools.cached_property
    def jpg_raw(self) -> Path:
        """``png_raw`` with every image re-encoded as a real JPEG (``<class>/<n>.jpg``)."""
        raw = self.root / "jpg-raw"
        for png in sorted(self.png_raw.glob("*/*.png")):
            target = raw / png.parent.name / png.with_suffix(".jpg").name
            target.parent.mkdir(parents=True, exist_ok=True)
            with Image.open(png) as image:
                image.convert("RGB").save(target, format="JPEG", quality=90)
        return raw

    @functools.cached_property
    def jpg_out(self) -> Path:
        """``jpg_raw`` built into 8 shards: members ``jpg`` and ``cls``."""
        out = self.root / "jpg-out"
        shardprep.build(str(self.jpg_raw), str(out), shards=8, workers=1, progress=False)
        return out

    def jpg_samples(self) -> list[tuple[str, str, bytes]]:
        """``(key, class, jpeg bytes)`` of every ``jpg_raw`` sample, in path order."""
        return [
            (f"{n:06d}", path.parent.name, path.read_bytes())
            for n, path in enumerate(sorted(self.jpg_raw.glob("*/*.jpg")))
        ]

    def parquet_folder(self, name: str, label_column: str) -> Path:
        """The JPEG samples as two Parquet files: ``__key__``, ``<label_column>``, ``jpg``."""
        folder = self.root / name
        if not folder.exists():
            rows = self.jpg_samples()
            folder.mkdir()
            for part, chunk in enumerate((rows[::2], rows[1::2])):
                table = pa.table(
                    {
                        "__key__": [key for key, _, _ in chunk],
                        label_column: [cls for _, cls, _ in chunk],
                        "jpg": pa.array([jpeg for _, _, jpeg in chunk], type=pa.binary()),
                    }
                )
                pq.write_table(table, folder / f"part-{part}.parquet")
        return folder


def link(folder: Path, name: str, target: Path) -> None:
    """``folder/name`` → ``target`` (a symlink: the builds are only read)."""
    os.symlink(target, folder / name.rstrip("/"), target_is_directory=True)


def training_parts() -> dict[str, Any]:
    """A reader's model, optimizer and loss (the pages leave them to the reader)."""
    model = torch.nn.Linear(8, 2)

    def compute_loss(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        inputs = torch.ones(len(batch["__key__"]), 8)
        loss: torch.Tensor = model(inputs).square().mean()
        return loss

    return {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "compute_loss": compute_loss,
    }


def readme(folder: Path, data: DocData) -> dict[str, Any]:
    link(folder, "RAW", data.png_raw)
    link(folder, "export", data.parquet_folder("export", label_column="cls"))
    rows = data.jpg_samples()

    def samples() -> Iterator[dict[str, Any]]:
        for key, cls, jpeg in rows:
            yield {"__key__": key, "cls": cls, "jpg": jpeg}

    return {"samples": samples, "resize_and_encode": resize_and_encode}


def class_weights(folder: Path, data: DocData) -> dict[str, Any]:
    link(folder, "out", data.png_out)
    return {}


def integrations(folder: Path, data: DocData) -> dict[str, Any]:
    from loader import ShardDataset

    link(folder, "OUT", data.png_out)
    # the StatefulDataLoader block continues the torchrun block, whose `ds` lives in main()
    return {"ds": ShardDataset("OUT", batch_size=64), **training_parts()}


def loader_page(folder: Path, data: DocData) -> dict[str, Any]:
    link(folder, "OUT", data.jpg_out)

    def my_features(sample: dict[str, Any]) -> np.ndarray:
        return np.zeros(16, dtype=np.float32)

    return {
        "epochs": 2,
        "EPOCHS": 2,
        "path": "checkpoint.pt",
        "process_index": 0,  # jax.process_index() in a JAX job
        "process_count": 1,
        "task_index": 0,
        "num_tasks": 1,
        "my_features": my_features,
        "model": training_parts()["model"],
    }


def mixing(folder: Path, data: DocData) -> dict[str, Any]:
    for name in ("web", "books", "code", "A", "B"):
        link(folder, name, data.png_out)
    return {}


def pipelines(folder: Path, data: DocData) -> dict[str, Any]:
    link(folder, "data", data.parquet_folder("data", label_column="label"))
    link(folder, "raw", data.png_raw)
    rows = data.jpg_samples()

    def my_pipeline() -> Iterator[tuple[bytes, str, str]]:
        for key, cls, jpeg in rows:
            yield jpeg, f"a {cls} ({key})", cls

    return {
        "my_pipeline": my_pipeline,
        "keys": [key for key, _, _ in rows],
        "labels": [cls for _, cls, _ in rows],
        "jpeg_bytes": [jpeg for _, _, jpeg in rows],
        "metas": [{"caption": f"a {cls}"} for _, cls, _ in rows],
    }


#: page (relative to the repository root) → its setup: fills the page's folder, returns the
#: names its blocks use without defining them. A page not listed runs in an empty folder.
# A page's fork server preloads these (tests.processes.preloaded_forkserver), as its blocks'
# process would: docs/integrations.md's torchrun main() calls set_forkserver_preload first, and
# its forkserver workers then start without importing torch again.
FORKSERVER_PRELOAD: dict[str, list[str]] = {"docs/integrations.md": ["loader.torch.dataset"]}

PAGES: dict[str, Callable[[Path, DocData], dict[str, Any]]] = {
    "README.md": readme,
    "docs/class-weights.md": class_weights,
    "docs/integrations.md": integrations,
    "docs/loader.md": loader_page,
    "docs/mixing.md": mixing,
    "docs/pipelines.md": pipelines,
}
