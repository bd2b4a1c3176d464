"""The scan's result: metadata of every sample, stored column-wise.

A million samples must fit in well under 100 MB, so nothing here is a Python
object per sample: names live in one bytes blob with an offsets array, numbers
in numpy arrays (about 40 bytes per sample plus the relative path). Pure data;
no I/O.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shardprep.keys import key_from_stem

__all__ = ["Inventory", "InventoryBuilder", "PartRef", "SampleRef"]

UNLABELLED = -1


@dataclass(frozen=True, slots=True)
class PartRef:
    """One file (or tar member) of a sample: its extension and where its bytes are."""

    ext: str
    path: str  # absolute path of the file, or of the tar that contains it
    offset: int  # -1 for a whole file, else the data offset inside the tar at ``path``
    size: int


@dataclass(frozen=True, slots=True)
class SampleRef:
    """Everything the writer needs to copy one sample into a shard."""

    key: str
    label: int  # class index, or -1 when the dataset is unlabelled
    source: str  # relative path recorded in the index, for provenance
    parts: tuple[PartRef, ...]
    meta: bytes | None  # extra ``.json`` member content (listing columns), if any
    copy: int = 0  # 0 for an original sample, k for its k-th resampled copy
    multiplicity: int = 1  # copies of this sample's source in the output
    weight: bytes | None = None  # ``.weight`` member content (--weights-only), if any


@dataclass(frozen=True)
class Inventory:
    """All samples of the input, in scan order (sorted), plus class names.

    ``containers`` are the files a sample's parts live in (one per tar shard
    for tar input); for plain files the container is ``""`` and a part's path
    is ``root / stem + "." + ext``.
    """

    root: str
    class_names: tuple[str, ...] | None
    exts: tuple[str, ...]
    containers: tuple[str, ...]
    stem_blob: bytes
    stem_end: npt.NDArray[np.uint64]
    label: npt.NDArray[np.int32]
    container: npt.NDArray[np.uint32]
    part_start: npt.NDArray[np.uint64]
    part_ext: npt.NDArray[np.uint16]
    part_size: npt.NDArray[np.uint64]
    part_offset: npt.NDArray[np.int64]
    meta_blob: bytes
    meta_end: npt.NDArray[np.uint64] | None

    def __len__(self) -> int:
        return len(self.label)

    def stem(self, i: int) -> str:
        """Relative path of sample ``i`` without extension (or its key inside a tar)."""
        start = int(self.stem_end[i - 1]) if i else 0
        return self.stem_blob[start : int(self.stem_end[i])].decode("utf-8", "surrogateescape")

    def key(self, i: int) -> str:
        """The WebDataset key sample ``i`` gets in the shards."""
        return key_from_stem(self.stem(i))

    def sample_bytes(self) -> npt.NDArray[np.int64]:
        """Bytes each sample will occupy in a tar shard (headers, data, padding, label)."""
        padded = (self.part_size.astype(np.int64) + 511) // 512 * 512 + 512
        per_sample = (
            np.add.reduceat(padded, self.part_start[:-1].astype(np.int64))
            if len(padded)
            else np.zeros(0, np.int64)
        )
        if self.class_names is not None:
            per_sample = per_sample + 1024  # the .cls member
        if self.meta_end is not None:
            per_sample = per_sample + 1024
        return per_sample

    def sample(self, i: int) -> SampleRef:
        """The full reference of sample ``i`` (allocates; used one shard at a time)."""
        stem = self.stem(i)
        container = self.containers[int(self.container[i])]
        parts = []
        for j in range(int(self.part_start[i]), int(self.part_start[i + 1])):
            ext = self.exts[int(self.part_ext[j])]
            offset = int(self.part_offset[j])
            if offset < 0:
                path = f"{self.root}/{stem}.{ext}" if ext else f"{self.root}/{stem}"
            else:
                path = container
            parts.append(PartRef(ext, path, offset, int(self.part_size[j])))
        if container:
            source = f"{container[len(self.root) + 1 :]}:{stem}"
        elif len(parts) == 1:
            source = parts[0].path[len(self.root) + 1 :]
        else:
            source = stem
        meta = None
        if self.meta_end is not None:
            start = int(self.meta_end[i - 1]) if i else 0
            meta = self.meta_blob[start : int(self.meta_end[i])]
        return SampleRef(key_from_stem(stem), int(self.label[i]), source, tuple(parts), meta)

    def class_counts(self) -> list[int]:
        """Number of samples per class index (empty list when unlabelled)."""
        if self.class_names is None:
            return []
        return np.bincount(self.label, minlength=len(self.class_names)).tolist()


class InventoryBuilder:
    """Accumulates samples during a scan into compact arrays, then freezes an Inventory."""

    def __init__(self, root: str, with_meta: bool = False) -> None:
        self.root = root
        self._stems = bytearray()
        self._stem_end = array("Q")
        self._label = array("i")
        self._container = array("I")
        self._part_start = array("Q", [0])
        self._part_ext = array("H")
        self._part_size = array("Q")
        self._part_offset = array("q")
        self._exts: dict[str, int] = {}
        self._containers: dict[str, int] = {"": 0}
        self._meta: bytearray | None = bytearray() if with_meta else None
        self._meta_end = array("Q")

    def __len__(self) -> int:
        return len(self._label)

    def add(
        self,
        stem: str,
        label: int,
        parts: list[tuple[str, int, int]],
        container: str = "",
        meta: bytes | None = None,
    ) -> None:
        """Record one sample: ``parts`` are (extension, size, tar data offset or -1)."""
        self._stems += stem.encode("utf-8", "surrogateescape")
        self._stem_end.append(len(self._stems))
        self._label.append(label)
        self._container.append(self._containers.setdefault(container, len(self._containers)))
        for ext, size, offset in parts:
            self._part_ext.append(self._exts.setdefault(ext, len(self._exts)))
            self._part_size.append(size)
            self._part_offset.append(offset)
        self._part_start.append(len(self._part_size))
        if self._meta is not None:
            self._meta += meta or b""
            self._meta_end.append(len(self._meta))

    def relabel(self, mapping: npt.NDArray[np.int32]) -> None:
        """Replace every label ``l >= 0`` by ``mapping[l]`` (used once names are sorted)."""
        labels = np.frombuffer(self._label, dtype=np.int32).copy()
        labelled = labels >= 0
        labels[labelled] = mapping[labels[labelled]]
        self._label = array("i", labels.tobytes())

    def freeze(self, class_names: tuple[str, ...] | None) -> Inventory:
        """The finished Inventory; the builder must not be used afterwards."""
        return Inventory(
            root=self.root,
            class_names=class_names,
            exts=tuple(self._exts),
            containers=tuple(self._containers),
            stem_blob=bytes(self._stems),
            stem_end=np.frombuffer(self._stem_end, dtype=np.uint64),
            label=np.frombuffer(self._label, dtype=np.int32),
            container=np.frombuffer(self._container, dtype=np.uint32),
            part_start=np.frombuffer(self._part_start, dtype=np.uint64),
            part_ext=np.frombuffer(self._part_ext, dtype=np.uint16),
            part_size=np.frombuffer(self._part_size, dtype=np.uint64),
            part_offset=np.frombuffer(self._part_offset, dtype=np.int64),
            meta_blob=bytes(self._meta) if self._meta is not None else b"",
            meta_end=np.frombuffer(self._meta_end, dtype=np.uint64)
            if self._meta is not None
            else None,
        )

    def iter_stems(self) -> Iterator[str]:
        """Stems recorded so far, in order."""
        start = 0
        for end in self._stem_end:
            yield self._stems[start:end].decode("utf-8", "surrogateescape")
            start = end
