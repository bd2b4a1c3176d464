"""Deterministic synthetic raw datasets laid out as ``RAW/<class>/<file>``.

Three flavours stress different costs:

* ``small``  - ~1 KiB random payloads: per-sample overhead dominates.
* ``images`` - 30-100 KiB JPEG-looking random payloads: bandwidth dominates
  (random bytes are incompressible, like real JPEG).
* ``text``   - 2-6 KiB JSON records drawn from a small vocabulary: very
  compressible, so zstd shows its benefit.

Classes are imbalanced on purpose (geometric weights, the largest class ~20x
the smallest) because shardprep's selling point is balanced shards. Every
payload is unique (random bytes or an embedded id), so samples can be
identified by payload hash in the DDP exactness check.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

NUM_CLASSES = 10
IMBALANCE = 20.0  # largest class / smallest class

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "no",
    "will",
    "more",
    "out",
    "up",
    "into",
    "do",
    "any",
    "your",
    "what",
    "time",
    "some",
    "can",
    "only",
    "other",
    "new",
    "its",
    "about",
    "than",
    "them",
    "may",
    "these",
    "data",
    "shard",
    "loader",
    "sample",
    "batch",
    "epoch",
    "rank",
    "worker",
    "train",
    "model",
    "tensor",
    "stream",
    "index",
    "balance",
    "class",
    "image",
    "label",
    "vision",
    "text",
    "token",
    "audio",
    "random",
    "seed",
    "node",
    "cluster",
    "memory",
    "disk",
    "network",
    "cache",
]


@dataclass(frozen=True)
class Spec:
    """What to generate; also the cache key of a generated tree."""

    kind: str  # small | images | text | tiny
    n: int
    seed: int = 0


EXT = {"small": "bin", "images": "jpg", "text": "json", "tiny": "bin"}


def class_counts(n: int, num_classes: int = NUM_CLASSES, ratio: float = IMBALANCE) -> list[int]:
    """Split ``n`` over classes with geometric weights so max/min ~= ``ratio``."""
    w = ratio ** (np.arange(num_classes) / (num_classes - 1))
    counts = np.floor(n * w / w.sum()).astype(int)
    counts[-1] += n - counts.sum()
    return [int(c) for c in counts]


def _payload(kind: str, i: int, cls: int, rng: np.random.Generator) -> bytes:
    if kind == "small":
        return rng.bytes(int(rng.integers(768, 1281)))
    if kind == "tiny":  # DDP exactness set: id prefix guarantees uniqueness
        return i.to_bytes(8, "little") + rng.bytes(248)
    if kind == "images":
        size = int(rng.integers(30 * 1024, 100 * 1024 + 1))
        return b"\xff\xd8\xff\xe0" + rng.bytes(size - 6) + b"\xff\xd9"
    if kind == "text":
        nwords = int(rng.integers(350, 1000))
        idx = rng.integers(0, len(_WORDS), size=nwords + 8)
        body = " ".join(_WORDS[j] for j in idx[8:])
        rec = {
            "id": i,
            "label": cls,
            "title": " ".join(_WORDS[j] for j in idx[:8]),
            "body": body,
            "scores": [round(float(x), 3) for x in rng.random(8)],
        }
        return json.dumps(rec).encode()
    raise ValueError(f"unknown dataset kind {kind!r}")


def generate(spec: Spec, root: Path) -> Path:
    """Create ``root/raw/<class>/<id>.<ext>`` (reused if already complete).

    Returns the raw directory. ``root/meta.json`` records the spec, per-class
    counts and total payload bytes, and marks the tree complete.
    """
    raw = root / "raw"
    meta_path = root / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("spec") == asdict(spec):
            return raw
    if root.exists():
        shutil.rmtree(root)
    raw.mkdir(parents=True)
    rng = np.random.default_rng(spec.seed)
    counts = class_counts(spec.n)
    labels = rng.permutation(np.repeat(np.arange(NUM_CLASSES), counts))
    names = [f"c{c:02d}" for c in range(NUM_CLASSES)]
    for name in names:
        (raw / name).mkdir()
    ext = EXT[spec.kind]
    total = 0
    for i, cls in enumerate(labels.tolist()):
        data = _payload(spec.kind, i, cls, rng)
        total += len(data)
        with open(raw / names[cls] / f"{i:07d}.{ext}", "wb") as f:
            f.write(data)
    meta = {
        "spec": asdict(spec),
        "classes": names,
        "counts": counts,
        "total_bytes": total,
        "ext": ext,
    }
    meta_path.write_text(json.dumps(meta, indent=1))
    return raw


def load_meta(root: Path) -> dict[str, Any]:
    """Read ``meta.json`` written by :func:`generate`."""
    meta: dict[str, Any] = json.loads((root / "meta.json").read_text())
    return meta


def list_raw(raw: str | Path) -> list[tuple[str, int, str]]:
    """List ``(path, class_index, key)`` of a raw tree in a stable order.

    Classes are the sorted sub-folders; the key is the file stem (globally
    unique in generated trees). Used by the peer builders, which - unlike
    shardprep - take an explicit list of inputs.
    """
    raw = Path(raw)
    classes = sorted(e.name for e in os.scandir(raw) if e.is_dir())
    items: list[tuple[str, int, str]] = []
    for ci, name in enumerate(classes):
        files = sorted(e.name for e in os.scandir(raw / name) if e.is_file())
        for fn in files:
            items.append((str(raw / name / fn), ci, fn.rsplit(".", 1)[0]))
    return items
