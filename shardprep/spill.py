"""The inventory on disk: the scan's columns in files, read back a chunk at a time.

A build's whole-dataset metadata must not grow its memory: a billion samples
are ~100 GB of names and sizes. :class:`InventoryStore` is the scan's sink
(it takes a scanner's partitions with ``extend`` / ``add``, like an
:class:`~shardprep.inventory.InventoryBuilder`) and, once frozen, the
inventory every later stage reads: ``rows(lo, hi)`` and ``chunks()`` return
ordinary in-memory :class:`~shardprep.inventory.Inventory` objects of at most
``CHUNK`` samples, read with ``pread`` (no mapping, so nothing of the files
stays resident in this process). What stays in memory is per-file or
per-class, never per-sample: the extension and container tables, counts, and
the open file handles.

Columns (one file each, native byte order, in a private scratch folder):
``stem_end`` / ``meta_end`` are absolute end offsets into ``stems`` / ``meta``,
``part_start`` has one more entry than there are samples (0 first), the
``container`` and ``part_ext`` ids index the store's global tables.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from shardprep.inventory import Inventory, InventoryBuilder, SampleRef, merged_extensions

__all__ = ["CHUNK", "InventoryStore", "StoreFolder"]

CHUNK = 1 << 16  # samples per chunk read back: ~10 MB of columns and names at most

_COLUMNS: dict[str, type[np.generic]] = {
    "stem_end": np.uint64,
    "label": np.int32,
    "container": np.uint32,
    "part_start": np.uint64,
    "part_ext": np.uint16,
    "part_size": np.uint64,
    "part_offset": np.int64,
    "meta_end": np.uint64,
}
_BLOBS = ("stems", "meta")


class InventoryStore:
    """An inventory in column files under ``folder``: appended during the scan, then read in chunks.

    Use it like an ``InventoryBuilder`` (``add``, ``extend``, ``relabel``,
    ``set_part_sizes``, ``freeze``); ``freeze`` returns the store itself,
    read-only from then on.
    """

    def __init__(self, folder: str, root: str, with_meta: bool = False, chunk: int = CHUNK) -> None:
        self.folder = folder
        self.chunk = chunk
        self.root = root
        self.with_meta = with_meta
        self.class_names: tuple[str, ...] | None = None
        self._exts: dict[str, int] = {}
        self._containers: dict[str, int] = {"": 0}
        self._length = 0
        self._parts = 0
        self._blob_size = dict.fromkeys(_BLOBS, 0)
        self._buffer = InventoryBuilder(root, with_meta)  # samples given one at a time (add)
        self._writers: dict[str, BinaryIO] | None = {
            name: open(self._path(name), "wb")  # noqa: SIM115 (closed by freeze / close)
            for name in (*_COLUMNS, *_BLOBS)
        }
        self._writers["part_start"].write(np.zeros(1, np.uint64).tobytes())
        self._frozen = False

    # --- the sink side (during the scan) --------------------------------------

    def __len__(self) -> int:
        return self._length + len(self._buffer)

    def add(
        self,
        stem: str,
        label: int,
        parts: list[tuple[str, int, int]],
        container: str = "",
        meta: bytes | None = None,
    ) -> None:
        """Record one sample (see ``InventoryBuilder.add``); flushed to disk every CHUNK samples."""
        self._buffer.add(stem, label, parts, container, meta)
        if len(self._buffer) >= self.chunk:
            self._flush()

    def extend(self, other: InventoryBuilder | InventoryStore) -> None:
        """Append every sample of ``other`` (one scan task's partition), after those added so far.

        A partition that is itself a store (written by a task on this machine)
        is copied a chunk at a time, then its folder is removed.
        """
        self._flush()
        if isinstance(other, InventoryBuilder):
            self._append(other.freeze(None))
            return
        for _, rows in other.chunks():
            self._append(rows)
        shutil.rmtree(other.folder)

    def finish_part(self) -> InventoryStore:
        """Close a scan task's partition for the trip to the process that merges it."""
        return self.freeze(None)

    def relabel(self, mapping: npt.NDArray[np.int32]) -> None:
        """Replace every label ``l >= 0`` by ``mapping[l]``, a chunk at a time."""
        self._flush()
        self._sync()
        path = self._path("label")
        with open(path, "r+b") as f:
            for lo in range(0, self._length, self.chunk):
                hi = min(self._length, lo + self.chunk)
                labels = np.fromfile(path, np.int32, hi - lo, offset=lo * 4)
                labelled = labels >= 0
                labels[labelled] = mapping[labels[labelled]]
                f.seek(lo * 4)
                f.write(labels.tobytes())

    def set_part_sizes(self, sizes: list[int]) -> None:
        """Replace the size of every part, in order (a URL listing learns them after its rows)."""
        self._flush()
        if len(sizes) != self._parts:
            raise ValueError(f"{len(sizes)} sizes for {self._parts} parts")
        self._sync()
        with open(self._path("part_size"), "wb") as f:
            f.write(np.array(sizes, dtype=np.uint64).tobytes())

    def freeze(self, class_names: tuple[str, ...] | None) -> InventoryStore:
        """Finish the scan: the store becomes the read-only inventory (returned)."""
        self._flush()
        self._sync()
        if self._writers is not None:
            for f in self._writers.values():
                f.close()
            self._writers = None
        self.class_names = class_names
        self._frozen = True
        return self

    def close(self) -> None:
        """Close the files still open for writing (the folder is the caller's to remove).

        Only a failed scan has any: their buffered rows are discarded, so a full disk that
        fails their last flush must not hide the scan's own error (nor leave the rest open).
        """
        if self._writers is not None:
            for f in self._writers.values():
                with contextlib.suppress(OSError):
                    f.close()
            self._writers = None

    def _flush(self) -> None:
        if len(self._buffer):
            buffered, self._buffer = self._buffer, InventoryBuilder(self.root, self.with_meta)
            self._append(buffered.freeze(None))

    def _sync(self) -> None:
        if self._writers is not None:
            for f in self._writers.values():
                f.flush()

    def _append(self, part: Inventory) -> None:
        if self._frozen or self._writers is None:
            raise RuntimeError("InventoryStore: appended to after freeze()")
        write = self._writers
        exts = merged_extensions(self._exts, part.exts, self.root)
        containers = np.array(
            [self._containers.setdefault(c, len(self._containers)) for c in part.containers],
            np.uint32,
        )
        write["stem_end"].write((part.stem_end + np.uint64(self._blob_size["stems"])).tobytes())
        write["stems"].write(part.stem_blob)
        write["label"].write(np.ascontiguousarray(part.label, np.int32).tobytes())
        write["container"].write(containers[part.container].tobytes())
        write["part_start"].write((part.part_start[1:] + np.uint64(self._parts)).tobytes())
        write["part_ext"].write(exts[part.part_ext].tobytes())
        write["part_size"].write(np.ascontiguousarray(part.part_size, np.uint64).tobytes())
        write["part_offset"].write(np.ascontiguousarray(part.part_offset, np.int64).tobytes())
        if self.with_meta and part.meta_end is not None:
            write["meta_end"].write((part.meta_end + np.uint64(self._blob_size["meta"])).tobytes())
            write["meta"].write(part.meta_blob)
            self._blob_size["meta"] += len(part.meta_blob)
        self._blob_size["stems"] += len(part.stem_blob)
        self._length += len(part)
        self._parts += len(part.part_size)

    # --- the inventory side (after freeze) ------------------------------------

    @property
    def exts(self) -> tuple[str, ...]:
        """Every part extension, by id."""
        return tuple(self._exts)

    @property
    def containers(self) -> tuple[str, ...]:
        """Every container (input tar; ``""`` for plain files), by id."""
        return tuple(self._containers)

    @property
    def num_parts(self) -> int:
        """Files (or tar members) in the inventory: a sample has one or more."""
        return self._parts

    def rows(self, lo: int, hi: int) -> Inventory:
        """Samples ``lo`` to ``hi - 1`` as an in-memory Inventory (tables kept global)."""
        if not 0 <= lo <= hi <= self._length:
            raise IndexError(f"rows {lo}:{hi} of {self._length}")
        stem_end = self._read("stem_end", max(lo - 1, 0), hi)
        stem_lo = int(stem_end[0]) if lo else 0
        stem_end = stem_end[1:] if lo else stem_end
        part_start = self._read("part_start", lo, hi + 1)
        part_lo, part_hi = int(part_start[0]), int(part_start[-1])
        meta_end: npt.NDArray[np.uint64] | None = None
        meta_blob = b""
        if self.with_meta:
            ends = self._read("meta_end", max(lo - 1, 0), hi)
            meta_lo = int(ends[0]) if lo else 0
            ends = ends[1:] if lo else ends
            meta_hi = int(ends[-1]) if hi > lo else meta_lo
            meta_end = ends - np.uint64(meta_lo)
            meta_blob = self._read_blob("meta", meta_lo, meta_hi)
        stem_hi = int(stem_end[-1]) if hi > lo else stem_lo
        return Inventory(
            root=self.root,
            class_names=self.class_names,
            exts=self.exts,
            containers=self.containers,
            stem_blob=self._read_blob("stems", stem_lo, stem_hi),
            stem_end=stem_end - np.uint64(stem_lo),
            label=self._read("label", lo, hi),
            container=self._read("container", lo, hi),
            part_start=part_start - np.uint64(part_lo),
            part_ext=self._read("part_ext", part_lo, part_hi),
            part_size=self._read("part_size", part_lo, part_hi),
            part_offset=self._read("part_offset", part_lo, part_hi),
            meta_blob=meta_blob,
            meta_end=meta_end,
        )

    def chunks(self, size: int | None = None) -> Iterator[tuple[int, Inventory]]:
        """``(first index, rows)`` for consecutive chunks of at most ``size`` samples."""
        step = size or self.chunk
        for lo in range(0, self._length, step):
            yield lo, self.rows(lo, min(self._length, lo + step))

    def gather(self, indices: npt.NDArray[np.integer]) -> Inventory:
        """The samples at ``indices`` (any order, repeats allowed) as one in-memory Inventory.

        Reads the span from the smallest to the largest index: cheap for the
        nearly sorted indices of one chunk of a selection.
        """
        idx = np.asarray(indices, dtype=np.int64)
        if not len(idx):
            return self.rows(0, 0)
        lo, hi = int(idx.min()), int(idx.max()) + 1
        return self.rows(lo, hi).subset(idx - lo)

    def sample(self, i: int) -> SampleRef:
        """The full reference of sample ``i``."""
        return self.rows(i, i + 1).sample(0)

    def key(self, i: int) -> str:
        """The WebDataset key sample ``i`` gets in the shards."""
        return self.rows(i, i + 1).key(0)

    def column(self, name: str, lo: int = 0, hi: int | None = None) -> npt.NDArray[Any]:
        """Entries ``lo`` to ``hi`` of one column (``label``, ``part_size``, ...)."""
        return self._read(name, lo, self._column_length(name) if hi is None else hi)

    def class_counts(self) -> list[int]:
        """Number of samples per class index (empty list when unlabelled)."""
        if self.class_names is None:
            return []
        counts = np.zeros(len(self.class_names), dtype=np.int64)
        for lo in range(0, self._length, self.chunk):
            labels = self._read("label", lo, min(self._length, lo + self.chunk))
            counts += np.bincount(labels, minlength=len(counts))
        return [int(c) for c in counts]

    def source_bytes(self) -> int:
        """Total size of every part (the input's data bytes)."""
        return sum(
            int(self._read("part_size", lo, min(self._parts, lo + self.chunk)).sum())
            for lo in range(0, self._parts, self.chunk)
        )

    def digest_into(self, digest: hashlib._Hash) -> None:
        """Feed the fingerprint's columns to ``digest`` in the order the in-memory one does."""
        for name in ("stem_end", "label", "part_size", "part_ext"):
            total = self._column_length(name)
            for lo in range(0, total, self.chunk * 8):
                digest.update(self._read(name, lo, min(total, lo + self.chunk * 8)).tobytes())
        for name in ("stems", "meta"):
            if name == "meta":
                digest.update(json.dumps(self.exts).encode())
            total = self._blob_size[name]
            for lo in range(0, total, self.chunk * 64):
                digest.update(self._read_blob(name, lo, min(total, lo + self.chunk * 64)))

    def _column_length(self, name: str) -> int:
        if name in ("part_ext", "part_size", "part_offset"):
            return self._parts
        if name == "part_start":
            return self._length + 1
        return self._length

    def _path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def _read(self, name: str, lo: int, hi: int) -> npt.NDArray[Any]:
        dtype = np.dtype(_COLUMNS[name])
        if hi <= lo:
            return np.zeros(0, dtype)
        values = np.fromfile(self._path(name), dtype, hi - lo, offset=lo * dtype.itemsize)
        if len(values) != hi - lo:
            raise OSError(f"{self._path(name)}: short read ({len(values)} of {hi - lo} entries)")
        return values

    def _read_blob(self, name: str, lo: int, hi: int) -> bytes:
        if hi <= lo:
            return b""
        with open(self._path(name), "rb") as f:
            data = os.pread(f.fileno(), hi - lo, lo)
        if len(data) != hi - lo:
            raise OSError(f"{self._path(name)}: short read ({len(data)} of {hi - lo} bytes)")
        return data


@dataclass(frozen=True)
class StoreFolder:
    """Makes :class:`InventoryStore` sinks in fresh sub-folders of ``folder``.

    Picklable, so scan tasks in worker processes of this machine can write
    their partitions to disk too (the merge then copies them a chunk at a time).
    """

    folder: str
    chunk: int = CHUNK

    def __call__(self, root: str, with_meta: bool) -> InventoryStore:
        return InventoryStore(tempfile.mkdtemp(dir=self.folder), root, with_meta, self.chunk)
