"""Scanner for Parquet input: one row is one sample (Hugging Face datasets, Spark, Ray Data).

Columns become the sample's parts:

- a binary column is a member named after the column (``jpg`` → ``<key>.jpg``);
- a media column (a Hugging Face ``Image``/``Audio`` struct ``{bytes, path}``, or a binary
  column named ``image``/``audio``) is one member named by its bytes' format
  (:mod:`shardprep.scan.media`: ``png``, ``jpg``, ``flac``, ...), else by ``path``'s
  extension; one extension per column (refused otherwise, naming both rows), and bytes of
  no known format without a path extension are refused, never written undecodable;
- the label column (``--label-column``, default ``label`` if present) gives ``.cls``,
  its values interned as a listing's are (strings: class names sorted; integers: indices);
- the key column (``--key-column``, default the first of ``key``, ``__key__``, ``id``,
  ``uuid`` holding strings or integers: :mod:`shardprep.scan.parquet_keys`) gives the key,
  else (or with ``--key-column ''``) ``<file stem>-<row:09d>`` (the row's number in its
  file), the stem without the run ids writers put in file names (Spark's uuid), so a
  re-export of the same rows gets the same keys;
- every other column goes into the sample's ``.json`` (sorted keys);
- a Hive partition folder (``label=3/``, as Spark's ``partitionBy`` writes) is a column of
  every row below it (its value a string, ``%XX`` escapes decoded, Hive's
  ``__HIVE_DEFAULT_PARTITION__`` null): the label if it is the label column, else in the
  ``.json``; one column per level (``year=2024/label=3/``). A partition column that the file
  also holds must hold the folder's value on every row (refused naming file, column and row).

Beside the ``.parquet`` files, well-known sidecars are skipped at any depth
(:func:`is_sidecar`: ``_SUCCESS``, ``_committed_*`` and every ``_``/``.`` name, ``*.crc``,
``README*``, ``dataset_info.json``), and so are folders whose names start with ``_`` or
``.`` (Spark's ``_temporary``). When the layout was detected, any other file is refused
(:func:`list_parquet`, ``strict``); ``--format parquet`` reads the ``.parquet`` files alone.

The payloads live inside the Parquet files (in compressed, encoded pages), so the scan
copies them once into a spill file per Parquet file in the build's scratch folder, and
the inventory points at them as a tar scan's does at members (file, offset, size). The
writer then reads them with ``pread`` like tar members: no Parquet reader in the write
tasks, one sequential read of the input (ranged GETs for URLs), the same bytes whatever
process writes. Files are read a batch of rows at a time (``iter_batches``, no
pre-buffering of whole row groups), so memory stays bounded by the batch: pyarrow's pool
peaks at 3 to 5 times the batch, and as its allocator (mimalloc) keeps freed pages, the
scan hands them back every RELEASE_BYTES read. Beyond that, the scan holds only the
inventory (about 42 bytes a row plus the key), whatever the number of rows.

pyarrow is imported only here, when a Parquet input is scanned (``shardprep[parquet]``).
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import re
import tempfile
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from shardprep.format.errors import InputError, OutputError, ShardprepError
from shardprep.format.interface import CLI, Interface
from shardprep.format.shardformat import MAX_EXTENSIONS, reserved_member
from shardprep.inventory import UNLABELLED, InventoryBuilder, InventoryView, SinkFactory
from shardprep.out_spill import OutSpill, spill_write_error
from shardprep.scan.labels import MAX_CLASS_INDEX, LabelTable
from shardprep.scan.media import MEDIA_COLUMNS, SNIFF_BYTES, describe_head, sniff
from shardprep.scan.parquet_keys import default_key_column, stable_stems
from shardprep.scan.prefix import DOT_SEGMENTS, dot_segment_refusal
from shardprep.scan.splits import refuse_splits, split_of_file
from shardprep.scan.walk import OS_JUNK_NAMES, Tick
from shardprep.storage import describe_error, is_url, open_url

__all__ = [
    "MAX_CLASS_INDEX",
    "PARQUET_SUFFIXES",
    "ParquetInputError",
    "is_parquet_name",
    "list_parquet",
    "scan_parquet",
]

PARQUET_SUFFIXES = (".parquet", ".pq", ".parq")  # a Parquet file's names (any case)
LABEL_COLUMN = "label"
BATCH_BYTES = 8 << 20  # rows read at a time: about this many bytes of the row group's data
RELEASE_BYTES = 32 << 20  # pyarrow's freed memory is handed back to the OS after this much
MAX_BATCH_ROWS = 1 << 16
READ_BUFFER = 8 << 20  # pyarrow's buffered reads of a column chunk (no whole-group pre-buffer)
RESERVED_EXTS = ("cls", "weight")  # members the writer adds itself
_EXT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


class ParquetInputError(InputError):
    """A Parquet input cannot be read as samples; names the file and, where known, the row/key."""

    def __reduce__(self) -> tuple[object, ...]:
        return (ParquetInputError, (str(self), self.path))


def is_parquet_name(name: str) -> bool:
    """True for a Parquet file name (:data:`PARQUET_SUFFIXES`: ``.parquet``, ``.pq``,
    ``.parq``, any case) that is not hidden (``.x``) or Spark's (``_x``)."""
    base = name.rsplit("/", 1)[-1]
    return base.lower().endswith(PARQUET_SUFFIXES) and not base.startswith((".", "_"))


def parquet_stem(rel: str) -> str:
    """``rel`` without its Parquet suffix (``data/train-0.parquet`` → ``data/train-0``)."""
    lower = rel.lower()
    suffix = next((x for x in PARQUET_SUFFIXES if lower.endswith(x)), "")
    return rel[: len(rel) - len(suffix)]


SIDECAR_NAMES = ("dataset_info.json",)  # Hugging Face's, beside its Parquet exports


def is_sidecar(name: str) -> bool:
    """True for a file that lies beside Parquet data without being data: hidden or Spark's
    (``.x``, ``_SUCCESS``, ``_committed_<id>``, ``_started_<id>``, ``_common_metadata``), a
    checksum (``*.crc``, as Hadoop writes ``.part-0.parquet.crc``), a ``README`` (``.md``,
    ``.txt``, any), Hugging Face's ``dataset_info.json`` or an OS's own file
    (:data:`~shardprep.scan.walk.OS_JUNK_NAMES`: ``Thumbs.db``, ``desktop.ini``)."""
    base = name.rsplit("/", 1)[-1]
    lower = base.lower()
    return (
        base.startswith((".", "_"))
        or lower in OS_JUNK_NAMES
        or lower.endswith(".crc")
        or lower == "readme"
        or lower.startswith("readme.")
        or lower in SIDECAR_NAMES
    )


def _import_pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise InputError(
            'Parquet input needs pyarrow: pip install "shardprep[parquet]" '
            f"(it could not be imported: {err})"
        ) from err
    return pq


def list_parquet(
    raw: str,
    storage_options: Mapping[str, Any] | None = None,
    strict: bool = False,
    interface: Interface = CLI,
) -> list[str]:
    """The Parquet files of ``raw`` (a file, a folder or a URL prefix), sorted by path.

    A folder's files are found at any depth; sidecars (:func:`is_sidecar`) and folders whose
    names start with ``.`` or ``_`` (Spark's ``_temporary``) are skipped. ``strict`` (the
    layout was detected, not given) refuses any other file: a folder of Parquet files and
    images is not read as Parquet on a guess; and files of more than one split
    (:func:`~shardprep.scan.splits.refuse_splits`: ``train-0.parquet`` beside
    ``test-0.parquet``, or ``train/`` beside ``test/``). An object whose key has a ``.`` or
    ``..`` segment is refused (never skipped as hidden).

    Raises:
        InputError: nothing found, another file found with ``strict``, two splits with
            ``strict``, an object named with a ``.``/``..`` segment, or a URL that cannot
            be listed (naming it).
    """
    if is_url(raw):
        fs, path = open_url(raw, storage_options, interface)
        path = path.rstrip("/")
        protocol = raw[: raw.index("://") + 3]
        try:
            if fs.isfile(path):
                return [raw]
            found = sorted(p for p in fs.find(path) if p.startswith(path + "/") and p[-1] != "/")
        except Exception as err:  # a backend's own transport errors are not all OSErrors
            raise InputError(describe_error(raw, err, interface), raw) from err
        odd = next((p for p in found if set(p[len(path) :].split("/")) & {*DOT_SEGMENTS}), None)
        if odd is not None:
            raise InputError(dot_segment_refusal(protocol + odd), protocol + odd)
        names = [protocol + p for p in found if not _skipped_folder(p[len(path) :])]
    elif os.path.isfile(raw):
        return [os.path.abspath(raw)]
    else:
        top = os.path.abspath(raw)
        names = []
        for folder, dirs, found_here in os.walk(top):
            dirs[:] = [d for d in dirs if not d.startswith((".", "_"))]
            names += [os.path.join(folder, n) for n in found_here]
        names.sort()
    files = [n for n in names if is_parquet_name(n)]
    others = [n for n in names if not is_parquet_name(n) and not is_sidecar(n)]
    if strict and others:
        more = f" (and {len(others) - 1:,} more)" if len(others) > 1 else ""
        raise InputError(
            f"{others[0]}{more}: not a Parquet file, in {raw}, whose data files are Parquet "
            "(README*, dataset_info.json, _SUCCESS and other _* names, *.crc are skipped "
            f"beside them); pass {interface.setting('input_format', 'parquet')} to read the "
            ".parquet files alone (the others are skipped), or move the other files out of the "
            "input",
            others[0],
        )
    if not files:
        raise InputError(f"{raw}: no Parquet files (.parquet, .pq, .parq) found", raw)
    if strict:
        top = raw.rstrip("/") if is_url(raw) else os.path.abspath(raw)
        named = ((split_of_file(f[len(top) :]), f) for f in files)
        refuse_splits(raw, named, "parquet", interface)
    return files


def _skipped_folder(rel: str) -> bool:
    """True below a folder whose name starts with ``.`` or ``_`` (``rel``: from the input;
    its ``.``/``..`` segments are refused before, never skipped)."""
    return any(part.startswith((".", "_")) for part in rel.strip("/").split("/")[:-1])


HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"  # Spark's and Hive's folder for a null value


def partition_columns(rel: str) -> tuple[tuple[str, str | None], ...]:
    """The Hive partition columns of the file at ``rel`` (relative to the input): one
    ``(name, value)`` per ``name=value`` folder on its path, outermost first; names and values
    with their ``%XX`` escapes decoded (as Spark writes them), :data:`HIVE_NULL` as None."""
    columns = []
    for folder in rel.strip("/").split("/")[:-1]:
        name, eq, value = folder.partition("=")
        if eq and name:
            text = urllib.parse.unquote(value)
            columns.append((urllib.parse.unquote(name), None if text == HIVE_NULL else text))
    return tuple(columns)


@dataclass(frozen=True)
class _Columns:
    """How one file's columns become a sample: members, key, label, metadata."""

    binary: tuple[str, ...]  # binary columns: one member each, named after the column
    structs: tuple[str, ...]  # {bytes, path} columns: one member each, extension from path
    key: str  # "" for row numbers
    label: str  # "" for unlabelled
    meta: tuple[str, ...]  # everything else, into .json
    partitions: tuple[str, ...] = ()  # Hive partition columns (folders), outermost first
    in_file: tuple[str, ...] = ()  # ... of those, the ones the file holds too (checked)

    def from_path(self, column: str) -> bool:
        """True if ``column``'s values come from the partition folders, not the file."""
        return column in self.partitions and column not in self.in_file


def _columns(
    schema: Any,
    where: str,
    key_column: str | None,
    label_column: str | None,
    partitions: tuple[str, ...] = (),
    interface: Interface = CLI,
) -> _Columns:
    """Classify the columns of an Arrow schema and the file's Hive ``partitions`` (names).

    Raises:
        ParquetInputError: a named column is missing, a member column cannot name a member,
            or no column holds bytes.
    """
    import pyarrow as pa

    in_file = tuple(p for p in partitions if p in schema.names)
    names = list(schema.names) + [p for p in partitions if p not in in_file]
    for given, what in ((key_column, "key"), (label_column, "label")):
        numbered = given == "" and what == "key"  # --key-column '': keys from file and row
        if given is not None and given not in names and not numbered:
            raise ParquetInputError(
                f"{where}: no {what} column {given!r} (columns: {', '.join(names)}); "
                f"name an existing column with {interface.option(f'{what}_column')}",
                where,
            )
    key = key_column if key_column is not None else default_key_column(schema)  # "": numbered
    label = (
        label_column
        if label_column is not None
        else (LABEL_COLUMN if LABEL_COLUMN in names else "")
    )
    if key and key not in schema.names:
        raise ParquetInputError(
            f"{where}: the key column {key!r} is a partition folder ({key}=...), which one "
            "value names for every row below it: give the rows a key column of their own, or "
            f"leave out {interface.option('key_column')} to number them",
            where,
        )
    binary, structs = [], []
    meta = [p for p in partitions if p not in in_file and p != label]
    for field in schema:
        if field.name in (key, label):
            continue
        kind = field.type
        if _is_bytes(kind):
            _check_ext(field.name, where)
            binary.append(field.name)
        elif pa.types.is_struct(kind) and _is_bytes_struct(kind):
            structs.append(field.name)
        elif _holds_bytes(kind):
            raise ParquetInputError(
                f"{where}: column {field.name!r} ({kind}) holds bytes inside a list, struct or "
                "map; only a top-level binary column (one member per row) or a Hugging Face "
                "{bytes, path} column can become a member, and bytes cannot go into the "
                "sample's .json: split it into binary columns, or drop it",
                where,
            )
        else:
            meta.append(field.name)
    if len(binary) + len(structs) > MAX_EXTENSIONS:
        raise ParquetInputError(
            f"{where}: {len(binary) + len(structs):,} member columns (binary or "
            f"{{bytes, path}}); a build holds at most {MAX_EXTENSIONS:,} distinct member "
            "extensions (the index numbers them in 16 bits): pack per-item columns into one "
            "member (an .npz, a .json, a .tar) per row, or drop the columns you do not need",
            where,
        )
    if not binary and not structs:
        raise ParquetInputError(
            f"{where}: no column holds bytes (columns: {', '.join(names)}); a sample needs at "
            "least one binary column or a Hugging Face Image/Audio column ({bytes, path})",
            where,
        )
    return _Columns(tuple(binary), tuple(structs), key, label, tuple(meta), partitions, in_file)


def _is_bytes(kind: Any) -> bool:
    """A column of one byte string per row: binary in any Arrow layout (large, view, fixed
    size), or dictionary-encoded binary (what a Parquet dictionary page can read back as)."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return bool(
        pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_fixed_size_binary(kind)
        or _is_binary_view(kind)
    )


def _holds_bytes(kind: Any) -> bool:
    """True for a nested type (list, struct, map) with a binary type anywhere inside."""
    if _is_bytes(kind):
        return True
    return any(_holds_bytes(kind.field(i).type) for i in range(getattr(kind, "num_fields", 0)))


def _is_binary_view(kind: Any) -> bool:
    import pyarrow as pa

    check = getattr(pa.types, "is_binary_view", None)
    return bool(check and check(kind))


def _is_bytes_struct(kind: Any) -> bool:
    """A Hugging Face Image/Audio storage type: a struct with a binary ``bytes`` field."""

    index = kind.get_field_index("bytes")
    if index < 0:
        return False
    return _is_bytes(kind.field(index).type)


def _check_ext(ext: str, where: str, column: str = "", row: int = -1) -> None:
    """Refuse a member extension that cannot be written: a binary column's name, or (with
    ``row``) the extension the path of struct ``column`` gives in that row."""
    what = (
        f"binary column {ext!r}"
        if row < 0
        else (f"row {row}: the path in column {column!r} gives the member extension {ext!r}, which")
    )
    if reserved_member(ext):
        raise ParquetInputError(
            f"{where}: {what} is a name the loader gives its own field (__key__, __padded__, "
            "...: every __name__ is reserved), so it cannot name a member: "
            + ("rename the column" if row < 0 else "fix that path, or drop the path field"),
            where,
        )
    if not _EXT.fullmatch(ext) or ext.lower() in RESERVED_EXTS:
        raise ParquetInputError(
            f"{where}: {what} cannot name a member (a member's extension is "
            "made of letters, digits, '_', '-' and '.', and cls/weight are the writer's own); "
            "rename the column",
            where,
        )


class _Spill:
    """One Parquet file's payloads, appended to its spill file; every write checked.

    ``target``: the spill is in OUT's storage (a build on a Ray cluster,
    :mod:`shardprep.out_spill`), ``path`` a URL or a folder below it; else ``path`` is in
    the build's scratch folder."""

    def __init__(self, path: str, target: OutSpill | None = None) -> None:
        self.path = path
        self._target = target
        if target is not None:
            self._file: BinaryIO = target.open(path)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._file = open(path, "xb")  # noqa: SIM115 (closed by close)
        self.size = 0

    def write(self, data: memoryview) -> int:
        """Append ``data``; returns its offset in the spill file."""
        at = self.size
        try:
            written = self._file.write(data)
        except Exception as err:  # an object store's errors are not all OSErrors
            if self._target is None and not isinstance(err, OSError):
                raise
            raise self._error(err) from err
        if written != len(data):
            raise OutputError(
                f"{self.path}: short write ({written} of {len(data)} bytes)", self.path
            )
        self.size += written
        return at

    def close(self) -> None:
        try:
            self._file.close()
        except Exception as err:  # (an object is uploaded as it is closed)
            if self._target is None and not isinstance(err, OSError):
                raise
            raise self._error(err) from err

    def _error(self, err: Exception) -> OutputError:
        if self._target is not None:
            return spill_write_error(self.path, err, self._target.interface)
        assert isinstance(err, OSError)
        return _spill_error(self.path, err)


def _spill_error(path: str, err: OSError) -> OutputError:
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return OutputError(
            f"{path}: no room for the Parquet payloads in the build's scratch folder "
            f"({err.strerror}); a Parquet build copies every payload there once (as much room "
            "as the input's binary columns): set TMPDIR to a folder on a disk with room and run "
            "the same command again",
            path,
        )
    return OutputError(f"{path}: cannot write the build's scratch file ({err})", path)


def scan_parquet(
    raw: str,
    tick: Tick,
    scratch: str | None,
    label_column: str | None = None,
    key_column: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    sink: SinkFactory = InventoryBuilder,
    strict: bool = False,
    interface: Interface = CLI,
    spill_to: OutSpill | None = None,
) -> InventoryView:
    """Inventory of every row of the Parquet files at ``raw``, their payloads spilled
    (``interface``: how refusals name the options, ``--key-column`` or ``key_column=``).

    ``spill_to`` (a build on a Ray cluster): the payloads go to ``OUT/.shardprep-spill/<id>``
    instead of ``scratch`` (:mod:`shardprep.out_spill`; the caller removes it), so the
    inventory's parts are URLs (or paths in OUT) every node reads.

    ``strict`` (a detected layout) refuses files other than Parquet and sidecars
    (:func:`list_parquet`). Hive partition folders are columns of their rows (module doc).

    ``scratch`` is the folder the payloads are copied into (a fresh sub-folder of it is
    made; the caller removes ``scratch`` with everything in it); None makes a temporary
    folder that the caller must remove (``inventory.root``). The inventory's root is that
    sub-folder, each spill file is named after its Parquet file's path relative to ``raw``
    (so a sample's recorded source is ``train-00000.parquet:<key>``).

    Raises:
        ParquetInputError: not Parquet, a named column missing, a null key or label, a
            row without any payload, columns that differ between files; naming the file and
            the row (and key). Duplicate keys are refused by the caller (``check_unique_keys``).
        OutputError: the scratch folder is full.
    """
    pq = _import_pyarrow()
    files = list_parquet(raw, storage_options, strict, interface)
    base = _base(raw, files)
    rels = [_rel(location, base) for location in files]
    stems = stable_stems([parquet_stem(rel) for rel in rels])  # keys without a key column
    if spill_to is not None:
        root = spill_to.root
    else:
        root = tempfile.mkdtemp(prefix="parquet-", dir=scratch)
    labels = LabelTable(ParquetInputError)
    formats: dict[str, tuple[str, str, int]] = {}  # media column -> (ext, file, row) first seen
    builder: Any = None
    first: tuple[str, _Columns] | None = None
    for location, rel, stem in zip(files, rels, stems, strict=True):
        with _open(pq, location, storage_options, interface) as parquet:
            where = location
            folders = dict(partition_columns(rel))
            columns = _columns(
                parquet.schema_arrow, where, key_column, label_column, (*folders,), interface
            )
            if first is None:
                first = (where, columns)
                builder = sink(root, bool(columns.meta))
            elif columns != first[1]:
                raise ParquetInputError(
                    f"{where}: its columns differ from those of {first[0]} "
                    f"({_difference(columns, first[1])}); every Parquet file of one input must "
                    "have the same columns and the same partition folders (name=value)",
                    where,
                )
            spill = _Spill(_spill_path(root, rel, location), spill_to)
            try:
                rows_of = _read(
                    parquet, columns, where, rel, labels, spill, formats, folders, interface, stem
                )
                for rows in rows_of:
                    for stem, label, parts, meta in rows:
                        builder.add(stem, label, parts, spill.path, meta)
                    tick(len(rows))
            finally:
                spill.close()
    return labels.freeze(builder)


_COLUMN_ROLES = (
    ("partitions", "partition folders (name=value)"),
    ("in_file", "partition columns the file holds too"),
    ("binary", "binary columns"),
    ("structs", "image/audio columns"),
    ("key", "key column"),
    ("label", "label column"),
    ("meta", "other columns (into .json)"),
)


def _difference(here: _Columns, first: _Columns) -> str:
    """What differs between two files' columns, in words: ``partition folders
    (name=value): 'year', 'label' here, 'label' in the first file``."""

    def shown(value: tuple[str, ...] | str) -> str:
        names = (value,) if isinstance(value, str) else value
        return ", ".join(repr(n) for n in names if n) or "none"

    return "; ".join(
        f"{what}: {shown(getattr(here, field))} here, {shown(getattr(first, field))} in the "
        "first file"
        for field, what in _COLUMN_ROLES
        if getattr(here, field) != getattr(first, field)
    )


def _spill_path(root: str, rel: str, location: str) -> str:
    """Where the payloads of the Parquet file at ``rel`` (relative to the input) are copied.

    An object store's key may hold ``..`` segments: a name that would lead out of ``root``
    is refused, so the spill never writes outside the build's scratch folder (or outside
    ``OUT/.shardprep-spill``, a URL on a cluster).
    """
    if is_url(root):
        name = posixpath.normpath(rel)
        path = f"{root}/{name}"
        outside = name in (".", "..") or name.startswith(("../", "/"))
    else:
        path = os.path.normpath(os.path.join(root, rel))
        outside = not path.startswith(root.rstrip(os.sep) + os.sep)
    if outside:
        raise ParquetInputError(
            f"{location}: its name leads out of the input folder ({rel!r}); rename the "
            "object (no '..' or '.' path segments) or leave it out of the input",
            location,
        )
    return path


def _rel(location: str, base: str) -> str:
    """The path of the Parquet file at ``location`` relative to the input's ``base``."""
    return location[len(base) :].lstrip("/") if location != base else _basename(location)


def _base(raw: str, files: list[str]) -> str:
    """The prefix that relative names are taken after: the folder (or the file itself)."""
    if len(files) == 1 and files[0].rstrip("/") in (raw.rstrip("/"), os.path.abspath(raw)):
        return files[0]
    return raw.rstrip("/") if is_url(raw) else os.path.abspath(raw)


def _basename(location: str) -> str:
    return location.rstrip("/").rsplit("/", 1)[-1]


class _open:  # noqa: N801 (a context manager used like a function)
    """A ``pyarrow.parquet.ParquetFile`` of a path or URL, closed (with its fsspec file) on exit."""

    def __init__(
        self,
        pq: Any,
        location: str,
        storage_options: Mapping[str, Any] | None,
        interface: Interface = CLI,
    ) -> None:
        self._pq, self._location, self._options = pq, location, storage_options
        self._interface = interface
        self._handle: Any = None
        self._parquet: Any = None

    def __enter__(self) -> Any:
        import pyarrow as pa

        location = self._location
        try:
            if is_url(location):
                fs, path = open_url(location, self._options, self._interface)
                self._handle = fs.open(path, "rb", block_size=READ_BUFFER)
                source: Any = self._handle
            else:
                source = location
            self._parquet = self._pq.ParquetFile(
                source,
                buffer_size=READ_BUFFER,
                pre_buffer=False,
                page_checksum_verification=True,  # pages written with CRCs are checked
            )
        except (pa.ArrowInvalid, pa.ArrowException) as err:
            self._close()
            raise ParquetInputError(
                f"{location}: not a Parquet file, or one cut short (its footer is missing: "
                f"{err}); remove it from the input or pass the Parquet files alone, or copy "
                "the whole file again",
                location,
            ) from err
        except OutputError:
            self._close()
            raise
        except Exception as err:
            self._close()
            raise ParquetInputError(
                describe_error(location, err, self._interface), location
            ) from err
        return self._parquet

    def __exit__(self, *_exc: object) -> None:
        self._close()

    def _close(self) -> None:
        if self._parquet is not None:
            self._parquet.close()
        if self._handle is not None:
            self._handle.close()


_Row = tuple[str, int, list[tuple[str, int, int]], bytes | None]  # stem, label, parts, meta


def _read(
    parquet: Any,
    columns: _Columns,
    where: str,
    rel: str,
    labels: LabelTable,
    spill: _Spill,
    formats: dict[str, tuple[str, str, int]],
    folders: Mapping[str, str | None] | None = None,
    interface: Interface = CLI,
    stem: str | None = None,
) -> Iterator[list[_Row]]:
    """The file's rows, a batch at a time, as (stem, label, parts, meta); payloads spilled.

    ``folders``: the file's Hive partition values (:func:`partition_columns`); ``stem``: what
    its rows' keys begin with without a key column (:func:`stable_stems`; default ``rel``
    without its suffix)."""
    folders = folders or {}
    from_path = {c: v for c, v in folders.items() if columns.from_path(c) and c != columns.label}
    batch_rows = _batch_rows(parquet.metadata)
    stem_prefix = parquet_stem(rel) if stem is None else stem
    row = 0
    unreleased = 0
    try:
        for batch in parquet.iter_batches(batch_size=batch_rows, use_threads=True):
            n = batch.num_rows
            unreleased += batch.nbytes
            members = _spill_members(batch, columns, spill, where, formats, row)
            keys = batch.column(columns.key).to_pylist() if columns.key else None
            if columns.label and columns.from_path(columns.label):
                label_values: list[Any] | None = [folders[columns.label]] * n
            else:
                label_values = batch.column(columns.label).to_pylist() if columns.label else None
            file_meta = [c for c in columns.meta if c not in from_path]
            metas = None
            if columns.meta:
                metas = batch.select(file_meta).to_pylist() if file_meta else [{}] * n
            if metas is not None and from_path:
                metas = [{**m, **from_path} for m in metas]
            for column in columns.in_file:
                _check_partition(batch.column(column), folders[column], column, where, row, rel)
            rows: list[_Row] = []
            for i in range(n):
                number = row + i
                if keys is not None:
                    stem = _key_stem(keys[i], where, number, columns.key, interface)
                else:
                    stem = f"{stem_prefix}-{number:09d}"
                label = UNLABELLED
                if label_values is not None:
                    value = _label_value(
                        label_values[i], where, number, stem, columns.label, interface
                    )
                    label = labels.intern(
                        value,
                        f"{where}: row {number} (key {stem!r})",
                        where,
                        f"label {{}} in column {columns.label!r}",
                    )
                parts = [p for p in (column[i] for column in members) if p is not None]
                if not parts:
                    raise ParquetInputError(
                        f"{where}: row {number} (key {stem!r}) has no payload: every member "
                        "column is null there; drop the row or fill a column",
                        where,
                    )
                exts = [p[0] for p in parts]
                if len(set(exts)) != len(exts):
                    raise ParquetInputError(
                        f"{where}: row {number} (key {stem!r}) would hold two "
                        f".{max(exts, key=exts.count)} members; rename one of the columns",
                        where,
                    )
                data = _meta_json(metas[i], where, number, stem) if metas else None
                rows.append((stem, label, parts, data))
            row += n
            del batch, members, keys, label_values, metas
            if unreleased >= RELEASE_BYTES:  # else RSS swings 100-300 MiB above the live bytes
                _release_unused()
                unreleased = 0
            yield rows
    except ShardprepError:
        raise
    except Exception as err:  # pyarrow's and the storage backend's errors alike
        raise ParquetInputError(_damage(parquet, columns, where, row, err), where) from err


def _check_partition(
    values: Any, folder: str | None, column: str, where: str, first_row: int, rel: str
) -> None:
    """Refuse a row whose ``column`` differs from its partition folder's value (as text)."""
    for i, value in enumerate(values.to_pylist()):
        if (None if value is None else str(value)) != folder:
            path = "/".join(f for f in rel.split("/")[:-1] if f.startswith(f"{column}="))
            raise ParquetInputError(
                f"{where}: row {first_row + i}: column {column!r} holds {value!r} while its "
                f"partition folder {path!r} says {folder!r}; a partition column must hold "
                "its folder's value: rewrite the file, or drop the column from it",
                where,
            )


def _meta_json(meta: dict[str, Any], where: str, number: int, stem: str) -> bytes:
    """The row's other columns as its ``.json`` (sorted keys); NaN and infinities, which are
    not JSON (``json.loads`` elsewhere refuses them), are refused naming the column."""
    try:
        return json.dumps(meta, sort_keys=True, default=str, allow_nan=False).encode()
    except ValueError as err:
        column = next(
            (c for c, v in sorted(meta.items()) if not _finite(v)), "?"
        )  # the first column holding one (a list or struct cell counts as a whole)
        raise ParquetInputError(
            f"{where}: row {number} (key {stem!r}): column {column!r} holds NaN or an infinity, "
            "which JSON cannot hold (the row's other columns become its .json); fill or drop "
            "those values, or drop the column",
            where,
        ) from err


def _finite(value: Any) -> bool:
    """False if ``value`` is, or holds, a float NaN or infinity."""
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return True


def _damage(parquet: Any, columns: _Columns, where: str, row: int, err: Exception) -> str:
    """One line that names the row group (and its rows) that cannot be read from row ``row``
    on: each group from the one holding ``row`` is read again on its own until one fails
    (a batch may span groups); pyarrow's text is cut to its first line."""
    meta = parquet.metadata
    wanted = [c for c in (*columns.binary, *columns.structs, columns.key, columns.label) if c]
    wanted = [c for c in (*wanted, *columns.meta) if not columns.from_path(c)]
    first = 0
    for group in range(meta.num_row_groups):
        last = first + meta.row_group(group).num_rows
        if last > row:
            try:
                parquet.read_row_group(group, columns=wanted, use_threads=False)
            except Exception as again:  # the damaged group (or the storage failing again)
                text = str(again).strip().splitlines()[0] if str(again).strip() else repr(again)
                return (
                    f"{where}: row group {group} (rows {first}-{last - 1}) cannot be read "
                    f"({text}); the file is damaged or unreachable: rows {first}-{last - 1} "
                    "would be lost: rewrite the file from its source, or remove it"
                )
        first = last
    text = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
    return (
        f"{where}: cannot read rows {row}-{meta.num_rows - 1} ({text}); the file is damaged or "
        "unreachable: rewrite it from its source, or remove it"
    )


def _release_unused() -> None:
    """Hand the pages pyarrow's allocator keeps after freeing them back to the OS."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


def _batch_rows(meta: Any) -> int:
    """Rows per batch: about BATCH_BYTES of the file's largest rows (by row group averages)."""
    per_row = 1
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        per_row = max(per_row, group.total_byte_size // max(1, group.num_rows))
    return int(min(MAX_BATCH_ROWS, max(1, BATCH_BYTES // per_row)))


_Part = tuple[str, int, int]


def _spill_members(
    batch: Any,
    columns: _Columns,
    spill: _Spill,
    where: str,
    formats: dict[str, tuple[str, str, int]],
    first_row: int,
) -> list[list[_Part | None]]:
    """Per member column, per row: (extension, size, spill offset), or None where null.

    A media column (a ``{bytes, path}`` struct, a binary column named ``image``/``audio``)
    gets its extension from its payloads (:func:`_media_exts`); ``formats`` holds each such
    column's extension and where it was first seen, for every file of the build;
    ``first_row`` is the batch's first row in its file (named in refusals).

    A column's values are written as one block (its Arrow data buffer), so the per-row
    work is arithmetic on the offsets array only (and, for media columns, a look at each
    payload's first bytes).
    """
    out: list[list[tuple[str, int, int] | None]] = []
    for name in columns.binary:
        values = _plain_binary(batch.column(name))
        if name in MEDIA_COLUMNS:
            exts = _media_exts(values, None, name, where, formats, first_row)
        else:
            exts = [name] * batch.num_rows
        out.append(_spill_binary(values, exts, spill))
    for name in columns.structs:
        column = batch.column(name)
        kind = column.type
        flat = column.flatten()  # (the struct's own nulls are its fields' nulls here)
        payload = _plain_binary(flat[kind.get_field_index("bytes")])
        path_index = kind.get_field_index("path")
        paths = flat[path_index].to_pylist() if path_index >= 0 else [None] * len(column)
        exts = _media_exts(payload, paths, name, where, formats, first_row)
        out.append(_spill_binary(payload, exts, spill))
    return out


def _plain_binary(values: Any) -> Any:
    """``values`` as a binary or large_binary array (dictionary-decoded, views and fixed
    size cast), whose buffers :func:`_spill_binary` and :func:`_media_exts` read."""
    import pyarrow as pa

    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if not (pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type)):
        values = values.cast(pa.large_binary())
    return values


def _offsets(values: Any) -> Any:
    """The ``len(values) + 1`` offsets of a binary array into its data buffer, as int64."""
    import pyarrow as pa

    width = np.int64 if pa.types.is_large_binary(values.type) else np.int32
    n = len(values)
    offsets = np.frombuffer(values.buffers()[1], dtype=width)[values.offset : values.offset + n + 1]
    return offsets.astype(np.int64)


def _media_exts(
    values: Any,
    paths: list[Any] | None,
    column: str,
    where: str,
    formats: dict[str, tuple[str, str, int]],
    first_row: int,
) -> list[str]:
    """Each row's member extension in media ``column`` (``paths``: a struct's path field).

    The payload's own signature names it (:func:`~shardprep.scan.media.sniff`: ``png``,
    ``jpg``, ``flac``, ...); a payload of no format known there takes its path's extension;
    one with neither is refused, and so is a row whose bytes are null but whose path is
    not (the picture is outside the file). Every row of a column, in every file, must give
    the same extension (``formats``: the column's first), so a column is one field of every
    sample (the loader's batches stay regular).

    Raises:
        ParquetInputError: naming file, column and row, as said above.
    """
    data = values.buffers()[2]
    view = memoryview(data) if data is not None else memoryview(b"")
    offsets = _offsets(values).tolist()
    valid = values.is_valid().to_pylist() if values.null_count else None
    exts: list[str] = []
    for i in range(len(values)):
        row = first_row + i
        if valid is not None and not valid[i]:
            if paths is not None and paths[i] is not None:
                raise ParquetInputError(_outside_refusal(where, column, row, paths[i]), where)
            exts.append(column)  # (no member: the cell is null)
            continue
        start = offsets[i]
        head = bytes(view[start : min(offsets[i + 1], start + SNIFF_BYTES)])
        ext = sniff(head)
        if ext is None and paths is not None:
            ext = _path_ext(paths[i])
            if ext is not None:
                _check_ext(ext, where, column, row)
        if ext is None:
            raise ParquetInputError(
                _unknown_refusal(where, column, row, head, paths is not None), where
            )
        first = formats.setdefault(column, (ext, where, row))
        if first[0] != ext:
            raise ParquetInputError(_mixed_refusal(where, column, row, ext, first), where)
        exts.append(ext)
    return exts


def _path_ext(path: Any) -> str | None:
    """The extension a struct's ``path`` ends with, lower-cased (``photos/1.PNG``: ``png``);
    None for no path or no extension. (A reserved one is returned: the caller refuses it.)"""
    if not isinstance(path, str):
        return None
    base = path.rsplit("/", 1)[-1]
    dot = base.rfind(".")
    ext = base[dot + 1 :].lower() if dot > 0 else ""
    if ext and (reserved_member(ext) or (_EXT.fullmatch(ext) and ext not in RESERVED_EXTS)):
        return ext
    return None


def _outside_refusal(where: str, column: str, row: int, path: str) -> str:
    return (
        f"{where}: row {row}: column {column!r} holds no bytes, only the path {path!r}: the "
        "payload is outside the file, so the sample would lose it; write the export with the "
        "bytes embedded (datasets: Dataset.to_parquet keeps only the path of an Image()/"
        "Audio() loaded from local files; embed them first, e.g. ds.map(embed_table_storage, "
        "batched=True) on ds.with_format('arrow'), or push_to_hub, which embeds)"
    )


def _unknown_refusal(where: str, column: str, row: int, head: bytes, has_path: bool) -> str:
    known = "PNG, JPEG, GIF, WebP, BMP, TIFF, PPM/PGM, FLAC, WAV, MP3, Ogg or .npy"
    path = " and no path with an extension" if has_path else ""
    rename = (
        "give the rows paths ending in their format's extension (photo.avif)"
        if has_path
        else "rename the column after the format (a binary column 'avif' becomes .avif members)"
    )
    return (
        f"{where}: row {row}: column {column!r} holds bytes of no format shardprep recognises "
        f"({known}; they begin {describe_head(head)}){path}, so its member would be named "
        f".{column}, which no decoder knows: {rename}, or re-encode the column to one of "
        "those formats"
    )


def _mixed_refusal(where: str, column: str, row: int, ext: str, first: tuple[str, str, int]) -> str:
    first_ext, first_where, first_row = first
    there = "" if first_where == where else f" of {first_where}"
    return (
        f"{where}: row {row}: column {column!r} holds a .{ext} payload, while row {first_row}"
        f"{there} holds a .{first_ext}; a column becomes one member field of every sample "
        "(the loader batches a field per extension), so it must hold one format: re-encode "
        f"the column to one format before exporting, or split the .{ext} rows into a column "
        "of their own"
    )


def _spill_binary(values: Any, exts: list[str], spill: _Spill) -> list[_Part | None]:
    """Copy binary ``values`` (:func:`_plain_binary`) into ``spill`` as one block."""
    data_buffer = values.buffers()[2]
    n = len(values)
    offsets = _offsets(values)
    lo, hi = int(offsets[0]), int(offsets[-1])
    at = (
        spill.write(memoryview(data_buffer)[lo:hi])
        if data_buffer is not None and hi > lo
        else spill.size
    )
    starts = (offsets[:-1] - lo + at).tolist()
    sizes = np.diff(offsets).tolist()
    valid = values.is_valid().to_pylist() if values.null_count else None
    return [(exts[i], sizes[i], starts[i]) if valid is None or valid[i] else None for i in range(n)]


def _key_stem(value: Any, where: str, number: int, column: str, interface: Interface = CLI) -> str:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ParquetInputError(
            f"{where}: row {number}: the key column {column!r} is null or empty; give every "
            f"row a key, or leave out {interface.option('key_column')} and drop the column to "
            "number the rows",
            where,
        )
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ParquetInputError(
            f"{where}: row {number}: key {value!r} in column {column!r} is not a string or an "
            "integer",
            where,
        )
    return str(value)


def _label_value(
    value: Any, where: str, number: int, stem: str, column: str, interface: Interface = CLI
) -> Any:
    """The row's label value, refused where null or empty (the label rule checks the rest)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ParquetInputError(
            f"{where}: row {number} (key {stem!r}): the label column {column!r} is null or "
            f"empty; label every row, or name another column with "
            f"{interface.option('label_column')}",
            where,
        )
    return value
