"""The scan's result: metadata of every sample, stored column-wise.

A million samples must fit in well under 100 MB, so nothing here is a Python
object per sample: names live in one bytes blob with an offsets array, numbers
in numpy arrays (about 40 bytes per sample plus the relative path). Pure data;
no I/O.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from shardprep.format.errors import InputError
from shardprep.format.shardformat import MAX_EXTENSIONS, reserved_member
from shardprep.keys import key_from_stem

__all__ = [
    "Inventory",
    "InventoryBuilder",
    "InventorySink",
    "InventoryView",
    "SinkFactory",
    "PartRef",
    "SampleRef",
]

UNLABELLED = -1


class PartRef(NamedTuple):
    """One file (or tar member) of a sample: its extension and where its bytes are."""

    ext: str
    path: str  # absolute path of the file, or of the tar that contains it
    offset: int  # -1 for a whole file, else the data offset inside the tar at ``path``
    size: int


class SampleRef(NamedTuple):
    """Everything the writer needs to copy one sample into a shard.

    A NamedTuple rather than a frozen dataclass: one is made per written
    sample, and tuple construction is several times cheaper.
    """

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
        """The full reference of sample ``i``."""
        return self.samples(np.array([i]))[0]

    def samples(self, indices: npt.NDArray[np.integer]) -> list[SampleRef]:
        """Full references of the samples at ``indices`` (allocates: used one shard at a time).

        Columns are gathered with numpy first, so the per-sample Python work is
        string building only.
        """
        idx = np.asarray(indices, dtype=np.int64)
        stem_ends = self.stem_end[idx].tolist()
        stem_starts = np.where(idx > 0, self.stem_end[idx - 1], 0).tolist()
        first, last = self.part_start[idx], self.part_start[idx + 1]
        lengths = (last - first).astype(np.int64)
        parts_at = np.repeat(first.astype(np.int64) - np.cumsum(lengths) + lengths, lengths)
        parts_at += np.arange(int(lengths.sum()))
        part_ext = self.part_ext[parts_at].tolist()
        part_size = self.part_size[parts_at].tolist()
        part_offset = self.part_offset[parts_at].tolist()
        labels = self.label[idx].tolist()
        containers = self.container[idx].tolist()
        meta_ends = self.meta_end[idx].tolist() if self.meta_end is not None else None
        meta_starts = (
            np.where(idx > 0, self.meta_end[idx - 1], 0).tolist()
            if self.meta_end is not None
            else None
        )
        blob, exts = self.stem_blob, self.exts
        prefix = self.root if self.root.endswith("/") else self.root + "/"  # "s3://" for URLs
        refs, j = [], 0
        for k, count in enumerate(lengths.tolist()):
            stem = blob[stem_starts[k] : stem_ends[k]].decode("utf-8", "surrogateescape")
            container = self.containers[containers[k]]
            parts = []
            for _ in range(count):
                ext, offset = exts[part_ext[j]], part_offset[j]
                if offset >= 0:
                    path = container
                else:
                    path = f"{prefix}{stem}.{ext}" if ext else prefix + stem
                parts.append(PartRef(ext, path, offset, part_size[j]))
                j += 1
            if container:
                source = f"{container[len(prefix) :]}:{stem}"
            elif count == 1:
                source = parts[0].path[len(prefix) :]
            else:
                source = stem
            meta = blob_slice(self.meta_blob, meta_starts, meta_ends, k)
            refs.append(SampleRef(key_from_stem(stem), labels[k], source, tuple(parts), meta))
        return refs

    def subset(self, indices: npt.NDArray[np.integer]) -> Inventory:
        """The samples at ``indices`` (in that order, repeats allowed) as an Inventory of their own.

        Numpy gathers only, no Python object per sample: this is how one
        shard's metadata travels to the process or node that writes it.
        ``samples(arange(len(indices)))`` of the result equals
        ``samples(indices)`` of this one.
        """
        idx = np.asarray(indices, dtype=np.int64)
        stem_end, stem_blob = _gather_blob(self.stem_blob, self.stem_end, idx)
        first, last = (
            self.part_start[idx].astype(np.int64),
            self.part_start[idx + 1].astype(np.int64),
        )
        lengths = last - first
        parts_at = _ranges(first, lengths)
        meta_end, meta_blob = (
            _gather_blob(self.meta_blob, self.meta_end, idx)
            if self.meta_end is not None
            else (None, b"")
        )
        used, container = np.unique(self.container[idx], return_inverse=True)
        return Inventory(
            root=self.root,
            class_names=self.class_names,
            exts=self.exts,
            containers=tuple(self.containers[c] for c in used.tolist()),
            stem_blob=stem_blob,
            stem_end=stem_end,
            label=self.label[idx],
            container=container.astype(np.uint32).reshape(-1),
            part_start=np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint64),
            part_ext=self.part_ext[parts_at],
            part_size=self.part_size[parts_at],
            part_offset=self.part_offset[parts_at],
            meta_blob=meta_blob,
            meta_end=meta_end,
        )

    @classmethod
    def concat(cls, pieces: list[Inventory]) -> Inventory:
        """The samples of every piece, in order (tables of the first piece, containers merged)."""
        first = pieces[0]
        containers: dict[str, int] = {}
        container_ids = [
            np.array([containers.setdefault(c, len(containers)) for c in p.containers], np.uint32)
            for p in pieces
        ]
        with_meta = first.meta_end is not None

        def ends(values: list[npt.NDArray[np.uint64]], sizes: list[int]) -> npt.NDArray[np.uint64]:
            shifts = np.cumsum([0, *sizes[:-1]]).astype(np.uint64)
            parts = [v + s for v, s in zip(values, shifts, strict=True)]
            return np.concatenate(parts).astype(np.uint64) if parts else np.zeros(0, np.uint64)

        part_counts = [len(p.part_size) for p in pieces]
        return Inventory(
            root=first.root,
            class_names=first.class_names,
            exts=first.exts,
            containers=tuple(containers),
            stem_blob=b"".join(p.stem_blob for p in pieces),
            stem_end=ends([p.stem_end for p in pieces], [len(p.stem_blob) for p in pieces]),
            label=np.concatenate([p.label for p in pieces]).astype(np.int32),
            container=np.concatenate(
                [ids[p.container] for ids, p in zip(container_ids, pieces, strict=True)]
            ).astype(np.uint32),
            part_start=np.concatenate(
                [[0], ends([p.part_start[1:] for p in pieces], part_counts)]
            ).astype(np.uint64),
            part_ext=np.concatenate([p.part_ext for p in pieces]).astype(np.uint16),
            part_size=np.concatenate([p.part_size for p in pieces]).astype(np.uint64),
            part_offset=np.concatenate([p.part_offset for p in pieces]).astype(np.int64),
            meta_blob=b"".join(p.meta_blob for p in pieces),
            meta_end=ends(
                [p.meta_end for p in pieces if p.meta_end is not None],
                [len(p.meta_blob) for p in pieces],
            )
            if with_meta
            else None,
        )

    def class_counts(self) -> list[int]:
        """Number of samples per class index (empty list when unlabelled)."""
        if self.class_names is None:
            return []
        counts: list[int] = np.bincount(self.label, minlength=len(self.class_names)).tolist()
        return counts

    # The read side shared with the on-disk store (shardprep.spill.InventoryStore).

    @property
    def num_parts(self) -> int:
        """Files (or tar members) in the inventory: a sample has one or more."""
        return len(self.part_size)

    def rows(self, lo: int, hi: int) -> Inventory:
        """Samples ``lo`` to ``hi - 1``."""
        return self.subset(np.arange(lo, hi))

    def chunks(self, size: int) -> Iterator[tuple[int, Inventory]]:
        """``(first index, rows)`` for consecutive chunks of at most ``size`` samples."""
        for lo in range(0, len(self), size):
            yield lo, self.rows(lo, min(len(self), lo + size))

    def gather(self, indices: npt.NDArray[np.integer]) -> Inventory:
        """The samples at ``indices`` (any order, repeats allowed)."""
        return self.subset(indices)

    def column(self, name: str, lo: int = 0, hi: int | None = None) -> npt.NDArray[Any]:
        """Entries ``lo`` to ``hi`` of one column (``label``, ``part_size``, ...)."""
        values: npt.NDArray[Any] = getattr(self, name)[lo:hi]
        return values

    def source_bytes(self) -> int:
        """Total size of every part (the input's data bytes)."""
        return int(self.part_size.sum())

    def digest_into(self, digest: hashlib._Hash) -> None:
        """Feed the columns that identify the input to ``digest`` (the build's fingerprint)."""
        for values in (self.stem_end, self.label, self.part_size, self.part_ext):
            digest.update(np.ascontiguousarray(values).tobytes())
        digest.update(self.stem_blob)
        digest.update(json.dumps(self.exts).encode())
        digest.update(self.meta_blob)


class InventoryView(Protocol):
    """What the stages after the scan read: an :class:`Inventory` or an on-disk store."""

    @property
    def root(self) -> str: ...
    @property
    def class_names(self) -> tuple[str, ...] | None: ...
    @property
    def exts(self) -> tuple[str, ...]: ...
    @property
    def num_parts(self) -> int: ...
    def __len__(self) -> int: ...
    def rows(self, lo: int, hi: int) -> Inventory: ...
    def chunks(self, size: int) -> Iterator[tuple[int, Inventory]]: ...
    def gather(self, indices: npt.NDArray[np.integer]) -> Inventory: ...
    def column(self, name: str, lo: int = 0, hi: int | None = None) -> npt.NDArray[Any]: ...
    def sample(self, i: int) -> SampleRef: ...
    def key(self, i: int) -> str: ...
    def class_counts(self) -> list[int]: ...
    def source_bytes(self) -> int: ...
    def digest_into(self, digest: hashlib._Hash) -> None: ...


SinkFactory = Callable[[str, bool], "InventorySink"]  # (root, with_meta) -> an empty sink


class InventorySink(Protocol):
    """Where a scan puts samples: an in-memory builder, or an on-disk store."""

    def __len__(self) -> int: ...
    def add(
        self,
        stem: str,
        label: int,
        parts: list[tuple[str, int, int]],
        container: str = "",
        meta: bytes | None = None,
    ) -> None: ...
    def extend(self, other: Any) -> None: ...
    def finish_part(self) -> InventorySink: ...
    def relabel(self, mapping: npt.NDArray[np.int32]) -> None: ...
    def set_part_sizes(self, sizes: list[int]) -> None: ...
    def freeze(self, class_names: tuple[str, ...] | None) -> InventoryView: ...


def check_extension(ext: str, count: int, where: str) -> None:
    """Refuse member extension ``ext`` of the member at ``where`` (a file, or ``tar:member``)
    if it is reserved (:func:`~shardprep.format.shardformat.reserved_member`), or if it
    brings the build's distinct extensions to ``count`` > MAX_EXTENSIONS.

    Every scanner's samples pass here (the sink's ``add``), whatever the input path.

    Raises:
        InputError: naming ``where``, the rule and what to do.
    """
    if reserved_member(ext):
        raise InputError(
            f"{where}: the member extension {ext!r} is a name the loader gives its own field "
            "(__key__, __padded__, ...: every __name__ is reserved); it would stand in for "
            "that field in every sample: rename the file, column or member",
            where,
        )
    if count > MAX_EXTENSIONS:
        raise InputError(
            f"{where}: the member extension {ext!r} brings the number of distinct member "
            f"extensions to {count:,}; a build holds at most {MAX_EXTENSIONS:,} (the index "
            "numbers them in 16 bits): keep per-item data inside a member (an .npz, a .json, "
            "a .tar) instead of one member name per item",
            where,
        )


def merged_extensions(
    exts: dict[str, int], more: Iterable[str], where: str
) -> npt.NDArray[np.uint16]:
    """Number ``more`` (another part's extensions, in its order) in ``exts``, adding the
    new ones: the part's extension number → the merged one.

    Raises:
        InputError: the merge passes MAX_EXTENSIONS (naming ``where``).
    """
    numbers = [exts.setdefault(e, len(exts)) for e in more]
    if len(exts) > MAX_EXTENSIONS:
        last = next(e for e, n in exts.items() if n == MAX_EXTENSIONS)
        check_extension(last, len(exts), where)
    return np.array(numbers, np.uint16)


def _ranges(starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Concatenation of ``arange(start, start + length)`` for each pair."""
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.cumsum(lengths) + lengths, lengths)
    return offsets + np.arange(total, dtype=np.int64)


def _gather_blob(
    blob: bytes, ends: npt.NDArray[np.uint64], idx: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.uint64], bytes]:
    """Entries ``idx`` of a blob column (``ends`` are cumulative end offsets): new ends, new blob."""
    all_ends = ends.astype(np.int64)
    starts = np.where(idx > 0, all_ends[idx - 1], 0) if len(idx) else np.zeros(0, np.int64)
    lengths = all_ends[idx] - starts
    data = np.frombuffer(blob, dtype=np.uint8)[_ranges(starts, lengths)].tobytes()
    return np.cumsum(lengths).astype(np.uint64), data


def blob_slice(
    blob: bytes, starts: list[int] | None, ends: list[int] | None, k: int
) -> bytes | None:
    """Entry ``k`` of a blob column, or None when the column is absent."""
    if starts is None or ends is None:
        return None
    return bytes(blob[starts[k] : ends[k]])


def _shifted(values: array[int], by: int, dtype: type[np.unsignedinteger]) -> bytes:
    shifted: bytes = (np.frombuffer(values, dtype=dtype) + dtype(by)).tobytes()
    return shifted


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
        """Record one sample: ``parts`` are (extension, size, tar data offset or -1).

        Raises:
            InputError: a part's extension is reserved or one too many (``check_extension``);
                nothing of the sample is recorded.
        """
        for ext, _, _ in parts:
            if ext not in self._exts:
                self._new_ext(ext, stem, container)
        self._stems += stem.encode("utf-8", "surrogateescape")
        self._stem_end.append(len(self._stems))
        self._label.append(label)
        self._container.append(self._containers.setdefault(container, len(self._containers)))
        for ext, size, offset in parts:
            self._part_ext.append(self._exts[ext])
            self._part_size.append(size)
            self._part_offset.append(offset)
        self._part_start.append(len(self._part_size))
        if self._meta is not None:
            self._meta += meta or b""
            self._meta_end.append(len(self._meta))

    def _new_ext(self, ext: str, stem: str, container: str) -> int:
        """Number a member extension seen for the first time, or refuse it
        (:func:`check_extension`)."""
        where = f"{container}:{stem}.{ext}" if container else f"{self.root}/{stem}.{ext}"
        check_extension(ext, len(self._exts) + 1, where)
        return self._exts.setdefault(ext, len(self._exts))

    def set_part_sizes(self, sizes: list[int]) -> None:
        """Replace the size of every part, in order (a URL listing learns them after its rows)."""
        if len(sizes) != len(self._part_size):
            raise ValueError(f"{len(sizes)} sizes for {len(self._part_size)} parts")
        self._part_size = array("Q", sizes)

    def extend(self, other: InventoryBuilder) -> None:
        """Append every sample of ``other`` (scanned separately, e.g. in another process)."""
        self._stem_end.frombytes(_shifted(other._stem_end, len(self._stems), np.uint64))
        self._stems += other._stems
        self._label.extend(other._label)
        containers = np.array(
            [self._containers.setdefault(c, len(self._containers)) for c in other._containers],
            dtype=np.uint32,
        )
        self._container.frombytes(containers[np.frombuffer(other._container, np.uint32)].tobytes())
        exts = merged_extensions(self._exts, other._exts, self.root)
        self._part_ext.frombytes(exts[np.frombuffer(other._part_ext, np.uint16)].tobytes())
        self._part_start.frombytes(_shifted(other._part_start[1:], len(self._part_size), np.uint64))
        self._part_size.extend(other._part_size)
        self._part_offset.extend(other._part_offset)
        if self._meta is not None and other._meta is not None:
            self._meta_end.frombytes(_shifted(other._meta_end, len(self._meta), np.uint64))
            self._meta += other._meta

    def finish_part(self) -> InventoryBuilder:
        """A scan task's partition, ready to be merged (a builder travels as it is)."""
        return self

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
