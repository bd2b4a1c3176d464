"""Where a Parquet row's key comes from, so the same rows keep their keys when re-exported.

Without ``--key-column``, the key is the first column of :data:`KEY_COLUMNS` that the files
hold with string or integer values; without one, ``<file path without run ids>-<row>``,
where a run id is what a writer puts in a file name to make it unique to one run (Spark's
``part-00000-<uuid>-c000``, Ray Data's ``<hex uuid>_<hex uuid>_000003``, Databricks'
``tid-<number>``): a re-export of the same data then names its files alike. Pure functions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from shardprep.format.interface import Interface

__all__ = [
    "KEY_COLUMNS",
    "default_key_column",
    "duplicate_advice",
    "stable_stems",
    "without_run_ids",
]

KEY_COLUMNS = ("key", "__key__", "id", "uuid")  # the default key columns, in order of preference

_RUN_ID = re.compile(
    r"(?<![0-9A-Za-z])(?:[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
    r"[0-9a-fA-F]{12}|[0-9a-fA-F]{32}|tid-[0-9]+)(?![0-9A-Za-z])"
)
_SEPARATORS = "-_."


def default_key_column(schema: Any) -> str:
    """The first of :data:`KEY_COLUMNS` that ``schema`` (Arrow) holds as strings or integers
    (dictionary-encoded too), or ``""``: a column of another type (a float ``id``) is not
    taken as the key (it stays in the sample's ``.json``)."""
    import pyarrow as pa

    for name in KEY_COLUMNS:
        if name not in schema.names:
            continue
        kind = schema.field(name).type
        if pa.types.is_dictionary(kind):
            kind = kind.value_type
        text = pa.types.is_string(kind) or pa.types.is_large_string(kind)
        view = getattr(pa.types, "is_string_view", None)
        if text or pa.types.is_integer(kind) or (view is not None and view(kind)):
            return name
    return ""


def without_run_ids(name: str) -> str:
    """``name`` without the run ids in it, each with one separator beside it
    (``part-00000-3f2a9c1e-0b7d-4d4e-9a51-6c0f1e2d3b4a-c000.snappy`` → ``part-00000-c000.snappy``);
    ``name`` itself if nothing else would be left (a file named by a uuid alone)."""
    pieces = _RUN_ID.split(name)
    kept = pieces[0]
    for piece in pieces[1:]:
        if kept and kept[-1] in _SEPARATORS and piece[:1] in _SEPARATORS:
            kept = kept[:-1] + piece
        elif not kept and piece[:1] in _SEPARATORS:
            kept = piece[1:]
        else:
            kept += piece
    if kept[-1:] in _SEPARATORS and len(pieces) > 1 and not pieces[-1]:
        kept = kept[:-1]
    return kept if kept.strip(_SEPARATORS) else name


def stable_stems(stems: Sequence[str]) -> list[str]:
    """Per file (``stems``: paths relative to the input, without the Parquet suffix), the
    name its rows' keys begin with: its file name :func:`without_run_ids`, folders kept as
    they are (Hive ``label=3/``). Files that would then share a name (two Spark writes
    appended into one folder: ``part-00000-<uuid1>`` and ``part-00000-<uuid2>``) keep
    their whole names, so keys stay unique (they then change with the run ids)."""
    stripped = []
    for stem in stems:
        folder, slash, base = stem.rpartition("/")
        stripped.append(folder + slash + without_run_ids(base))
    counts: dict[str, int] = {}
    for stem in stripped:
        counts[stem] = counts.get(stem, 0) + 1
    return [s if counts[s] == 1 else whole for s, whole in zip(stripped, stems, strict=True)]


def duplicate_advice(interface: Interface) -> str:
    """What to do when two Parquet rows get one key (``DuplicateKeyError``'s advice)."""
    numbered = interface.setting("key_column", "''" if interface.cli else "")
    return (
        f"Parquet keys come from {interface.option('key_column')}, else from the first of "
        f"{', '.join(KEY_COLUMNS)} the files hold as strings or integers, else from the "
        f"file's name and the row's number: name a column of unique values with "
        f"{interface.option('key_column')}, or pass {numbered} to key every row by its file "
        "and row number"
    )
