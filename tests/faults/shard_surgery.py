"""Crafting damaged outputs for the fault-injection tests: copy a build, then edit its files.

Edits that must look legitimate (a lying index, a replaced zstd frame) also update
the manifest's sha256 and sizes, so only the new integrity checks can catch them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from shardprep.format.manifest import read_manifest, write_manifest
from shardprep.format.shardformat import ShardIndex, decode_index, encode_index


def copy_output(built: Path, target: Path) -> Path:
    shutil.copytree(built, target)
    return target


def index_of(out: Path, shard: int) -> ShardIndex:
    return decode_index((out / f"shard-{shard:05d}.idx").read_bytes())


def shard_path(out: Path, shard: int) -> Path:
    return out / read_manifest(str(out)).shards[shard].file


def edit_manifest_json(out: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit manifest.json as JSON (no consistency kept: that is the point)."""
    path = out / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=1))


def rewrite_index(out: Path, shard: int, edit: Callable[[dict[str, Any]], None]) -> None:
    """Re-encode shard ``shard``'s index after ``edit(arrays)``; the manifest is updated to match."""
    index = index_of(out, shard)
    arrays = {
        f.name: np.array(getattr(index, f.name))
        for f in dataclasses.fields(ShardIndex)
        if f.name not in ("exts", "version")
    }
    edit(arrays)
    data = encode_index(list(index.exts), arrays, version=index.version)
    (out / f"shard-{shard:05d}.idx").write_bytes(data)
    _update_entry(out, shard, index_sha256=hashlib.sha256(data).hexdigest(), index_bytes=len(data))


def rewrite_shard(out: Path, shard: int, data: bytes) -> None:
    """Replace shard ``shard``'s file; its sha256 and size in the manifest are updated to match."""
    shard_path(out, shard).write_bytes(data)
    _update_entry(out, shard, sha256=hashlib.sha256(data).hexdigest(), num_bytes=len(data))


def _update_entry(out: Path, shard: int, **fields: Any) -> None:
    manifest = read_manifest(str(out))
    shards = list(manifest.shards)
    shards[shard] = dataclasses.replace(shards[shard], **fields)
    write_manifest(dataclasses.replace(manifest, shards=tuple(shards)), str(out))
