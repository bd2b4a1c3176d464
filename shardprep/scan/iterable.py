"""Spill a Python iterable of sample dicts to uncompressed tar files, checking every sample.

A build from code (``shardprep.build(samples, OUT, shards=N)``) consumes its iterable once,
here: each sample's members go to disk as they come (memory holds one sample at a time),
as tar members ``<key>.<ext>`` plus a ``<key>.cls`` label, in a new tar file every
``file_bytes`` bytes or ``file_samples`` samples. The build then reads those files as tar
input (:mod:`shardprep.scan.tar_shards`), so planning and writing are the file build's.

A sample is a mapping, as WebDataset's writer takes it:

- ``"__key__"``: a str that is a valid key as it is (:func:`shardprep.keys.is_valid_key`);
- ``"cls"`` (optional, on every sample or on none): an int class index (>= 0), or a str
  class name; names are sorted and numbered as class folders are, unless every name is a
  decimal integer (then that integer is the index, as in a listing or a tar's ``.cls``).
  Ints and strs are not mixed;
- every other key is a member's extension (``jpg``, ``seg.png``: ``[A-Za-z0-9_-]`` words
  joined by dots) whose value is bytes (bytes, bytearray, memoryview), a str (written as
  UTF-8) or a dict (written as JSON: sorted keys, no spaces, non-ASCII kept);
- a field the loader sets itself (``__padded__``, ``__weight__``, ``__position__``,
  ``__source__``: :data:`~shardprep.format.shardformat.LOADER_FIELDS` but ``__key__``) is
  refused naming the sample's key and the field: the loader would never hand it back;
- other keys starting with ``__`` (WebDataset's reader adds ``__url__``, ``__local_path__``)
  are ignored, so a sample read back from WebDataset can be written again as it is.

Members are written in sorted extension order, so the bytes written depend only on the
samples and their order, never on a dict's insertion order. Pure checks plus appends to
files in ``folder``; the caller owns and removes the folder.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from shardprep.format.errors import InputError
from shardprep.format.interface import PYTHON, Interface
from shardprep.format.shardformat import (
    EOF_MARKER,
    LOADER_FIELDS,
    MAX_EXTENSIONS,
    padding,
    tar_header,
)
from shardprep.keys import is_valid_key
from shardprep.scan.labels import MAX_CLASS_INDEX, LabelTable, label_text

__all__ = ["FILE_BYTES", "FILE_SAMPLES", "MAX_CLASS_INDEX", "Spilled", "spill_samples"]

FILE_BYTES = 256 << 20  # a new spill tar after this many bytes: the scan reads them in parallel
FILE_SAMPLES = 16_384  # ... or after this many samples (a scan task per file: ~1 s each)
KEY_FIELD = "__key__"
LABEL_FIELD = "cls"
_EXT = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")


@dataclass(frozen=True)
class Spilled:
    """What was spilled: its folder, the tar files (in order) and totals for the summary."""

    folder: str
    files: tuple[str, ...]
    num_samples: int
    num_parts: int  # data members, labels not counted
    num_bytes: int  # data bytes, labels not counted


def spill_samples(
    samples: Iterable[Any],
    folder: str,
    tick: Callable[[int], None] = lambda _n: None,
    reserved: frozenset[str] = frozenset(),
    file_bytes: int | None = None,
    file_samples: int | None = None,
    interface: Interface = PYTHON,
) -> Spilled:
    """Write every sample of ``samples`` into ``folder/iterable-NNNNN.tar``; ``tick(1)`` each.

    ``reserved`` are extensions the build adds itself (``weight`` with ``weights_only=True``;
    ``interface``: how the refusal names that option, as the build's caller gives it).
    A new file starts every ``file_bytes`` / ``file_samples`` (default FILE_BYTES / FILE_SAMPLES).
    A key given twice within one file's samples is refused here, naming both positions
    (the tar scan would group adjacent members into one sample); duplicates further apart
    are left to the scan's check (bounded memory, any number of samples).

    Raises:
        InputError: a sample is not a mapping, has no valid ``__key__`` (or one an earlier
            sample of its file has), no data member, a bad extension, payload or ``cls``, or
            labels on some samples only; the message
            names the sample's key (or its position when it has no usable key). Nothing
            after that sample is read.
        OSError: the folder's disk is full or unwritable (the caller turns it into advice).
    """
    spill = _SpillFiles(folder, file_bytes or FILE_BYTES, file_samples or FILE_SAMPLES)
    labels = _LabelKind()
    exts: set[str] = set()
    try:
        for position, sample in enumerate(samples):
            key, members, (label, is_int) = _check_sample(position, sample, reserved, interface)
            labels.check(key, label, is_int)
            _check_extension_count(key, members, exts)
            spill.add(key, members, label, position)
            tick(1)
    finally:
        spill.close()
    return Spilled(folder, tuple(spill.files), spill.samples, spill.parts, spill.data_bytes)


def _check_sample(
    position: int, sample: Any, reserved: frozenset[str], interface: Interface = PYTHON
) -> tuple[str, list[tuple[str, bytes]], tuple[str | None, bool]]:
    """(key, members sorted by extension, (label text or None, was an int)), or InputError."""
    if not isinstance(sample, Mapping):
        raise InputError(
            f"sample #{position} (counting from 0) is a {type(sample).__name__}, not a dict: "
            f"give each sample as a dict {{'{KEY_FIELD}': key, 'cls': label, ext: bytes}}"
        )
    key = sample.get(KEY_FIELD)
    if key is None:
        raise InputError(
            f"sample #{position} (counting from 0) has no '{KEY_FIELD}': give every sample "
            "a unique key of letters, digits, '_' and '-'"
        )
    if not isinstance(key, str) or not is_valid_key(key):
        raise InputError(
            f"sample #{position} (counting from 0): {KEY_FIELD} {key!r} is not a valid sample "
            "key: use letters, digits, '_' and '-' only, not starting with '_' (WebDataset "
            "splits member names at the first dot and treats a leading '_' as metadata)"
        )
    members = []
    for field in sorted(str(f) for f in sample):
        if field in LOADER_FIELDS and field != KEY_FIELD:
            raise InputError(
                f"sample {key!r}: the field {field!r} is one the loader sets itself (it "
                "would never be handed back: the loader's own value takes its place); "
                "keep the value in a member of your own (e.g. in the sample's 'json') or "
                "drop the field"
            )
        if field.startswith("__") or field == LABEL_FIELD:
            continue  # __key__, and WebDataset's __url__ / __local_path__: not members
        if not _EXT.fullmatch(field):
            raise InputError(
                f"sample {key!r}: {field!r} is not a valid member extension (words of "
                "letters, digits, '_' and '-' joined by dots, such as 'jpg' or 'seg.png')"
            )
        if field in reserved:
            raise InputError(
                f"sample {key!r}: the member {field!r} would clash with the one the build "
                f"adds itself ({interface.setting('weights_only')} writes .{field}); rename it"
            )
        members.append((field, _payload(key, field, sample[field])))
    if not members:
        raise InputError(f"sample {key!r} has no data member, only its key and label")
    return key, members, _label_text(key, sample.get(LABEL_FIELD), LABEL_FIELD in sample)


def _payload(key: str, ext: str, value: Any) -> bytes:
    """A member's bytes: bytes as they are, a str as UTF-8, a dict as deterministic JSON."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise InputError(
                f"sample {key!r}: .{ext} is a str that is not valid text ({err})"
            ) from err
    if isinstance(value, dict):
        try:
            text = json.dumps(
                value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False
            )
            return text.encode("utf-8")
        except (TypeError, ValueError, UnicodeEncodeError) as err:
            hint = (
                " (a Hugging Face Image/Audio column gives {'bytes', 'path'}: pass its "
                "'bytes' as the member instead)"
                if "bytes" in value
                else ""
            )
            raise InputError(
                f"sample {key!r}: .{ext} is a dict that cannot be written as JSON ({err}){hint}"
            ) from err
    raise InputError(
        f"sample {key!r}: .{ext} is a {type(value).__name__}; a member must be bytes, a str "
        "(written as UTF-8) or a dict (written as JSON): encode it first"
    )


def _check_extension_count(key: str, members: list[tuple[str, bytes]], seen: set[str]) -> None:
    """At most MAX_EXTENSIONS distinct member extensions in the whole input."""
    seen.update(ext for ext, _ in members)
    if len(seen) > MAX_EXTENSIONS:
        raise InputError(
            f"sample {key!r} brings the number of distinct member extensions to {len(seen):,}; "
            f"a build holds at most {MAX_EXTENSIONS:,}: keep per-item data inside a member "
            "(an .npz, a .json, a .tar) instead of one member name per item"
        )


def _label_text(key: str, value: Any, present: bool) -> tuple[str | None, bool]:
    """The ``.cls`` text of a sample's label (``str(index)`` for an int; None if unlabelled)
    and whether it was an int: the label rule of every input path (``label_text``)."""
    if not present:
        return None, False
    return label_text(value, f"sample {key!r}", what=f"{LABEL_FIELD} {{}}")


class _LabelKind:
    """Checks that labels are on every sample or none, and that no int index meets a name
    (the label table of every input path: :class:`~shardprep.scan.labels.LabelTable`)."""

    def __init__(self) -> None:
        self._first: tuple[str, bool] | None = None  # (key, labelled) of the first sample
        self._table = LabelTable()

    def check(self, key: str, label: str | None, is_int: bool) -> None:
        labelled = label is not None
        if self._first is None:
            self._first = (key, labelled)
        elif labelled != self._first[1]:
            has, lacks = (key, self._first[0]) if labelled else (self._first[0], key)
            raise InputError(
                f"sample {lacks!r} has no cls while sample {has!r} has one: label every "
                "sample or none"
            )
        if label is not None:
            self._table.intern(int(label) if is_int else label, f"sample {key!r}", what="cls {}")


class _SpillFiles:
    """The spill's tar files, appended to one sample at a time (every write checked)."""

    def __init__(self, folder: str, file_bytes: int, file_samples: int) -> None:
        self.folder = folder
        self.files: list[str] = []
        self.samples = self.parts = self.data_bytes = 0
        self._file_bytes, self._file_samples = file_bytes, file_samples
        self._out: BinaryIO | None = None
        self._in_file = self._bytes_in_file = 0
        self._keys: dict[str, int] = {}  # the current file's keys: their samples' positions

    def add(
        self, key: str, members: list[tuple[str, bytes]], label: str | None, position: int
    ) -> None:
        """Append one sample (``position``: its place in the iterable, for messages).

        Raises:
            InputError: an earlier sample of the current file has the same key.
        """
        if self._out is None or (
            self._bytes_in_file >= self._file_bytes or self._in_file >= self._file_samples
        ):
            self._next_file()
        assert self._out is not None
        earlier = self._keys.setdefault(key, position)
        if earlier != position:
            raise InputError(
                f"sample key {key!r} is given to more than one sample (#{earlier} and "
                f"#{position}, counting from 0): give every sample its own __key__ (nothing "
                "was written to OUT)"
            )
        named = list(members)
        if label is not None:
            named.append((LABEL_FIELD, label.encode("utf-8")))
        for ext, data in named:
            name = f"{key}.{ext}".encode()
            for chunk in (tar_header(name, len(data)), data, padding(len(data))):
                self._write(chunk)
        self.samples += 1
        self.parts += len(members)
        self.data_bytes += sum(len(data) for _, data in members)
        self._in_file += 1

    def _write(self, chunk: bytes) -> None:
        assert self._out is not None
        written = self._out.write(chunk)
        if written != len(chunk):
            raise OSError(f"{self.files[-1]}: short write ({written} of {len(chunk)} bytes)")
        self._bytes_in_file += written

    def _next_file(self) -> None:
        self._end_file()
        path = os.path.join(self.folder, f"iterable-{len(self.files):05d}.tar")
        self._out = open(path, "xb")  # noqa: SIM115 (closed by _end_file / close)
        self.files.append(path)
        self._in_file = self._bytes_in_file = 0
        self._keys = {}

    def _end_file(self) -> None:
        if self._out is not None:
            out, self._out = self._out, None
            try:
                written = out.write(EOF_MARKER)
                if written != len(EOF_MARKER):
                    raise OSError(f"{self.files[-1]}: short write of the tar's end marker")
            finally:
                out.close()

    def close(self) -> None:
        self._end_file()
