"""Scanner for existing WebDataset tar shards, so they can be re-sharded into N balanced ones.

Reads tar headers (and ``.cls`` members, for labels), never other member data:
each part is recorded as (tar file, data offset, size) and copied by the writer.
Members are grouped into samples by WebDataset's rule: consecutive members
whose names share everything up to the first dot after the last slash. A sample's
members must be adjacent (refused naming them otherwise: WebDataset would read two
samples). The only members skipped are those WebDataset itself skips as metadata
(:data:`WEBDATASET_META`: ``__key__``, ``__meta__/x``); every other name is a sample's
member, ``__0001.jpg`` included (its key gets a ``k`` prefix, as a file name's does).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from shardprep.format.errors import InputError
from shardprep.format.interface import CLI, Interface
from shardprep.inventory import UNLABELLED, InventoryBuilder, InventoryView, SinkFactory
from shardprep.scan.class_folders import OrderedMap
from shardprep.scan.labels import LabelTable, cls_file_text
from shardprep.scan.prefix import join, top_level
from shardprep.scan.walk import Problems, Tick
from shardprep.storage import describe_error, is_url, open_url

__all__ = ["list_tar_shards", "scan_tar_shards"]

LABEL_EXT = "cls"
WEBDATASET_META = re.compile(r"__[^/]*__($|/)")
"""Member names WebDataset's tar reader skips as metadata (its ``skip_meta`` default, matched
at the start of the name): skipped here too, and nothing else is."""


def list_tar_shards(
    raw: str, storage_options: Mapping[str, Any] | None = None, interface: Interface = CLI
) -> list[str]:
    """The ``.tar`` files to read: ``raw`` itself, or every ``*.tar`` in the folder or URL
    prefix, sorted."""
    top = top_level(raw, storage_options, interface)
    url = is_url(raw)
    if top.is_file:
        return [raw if url else os.path.abspath(raw)]
    names = [n for n in top.file_names if n.endswith(".tar")]
    if not names:
        raise InputError(f"{raw}: no .tar files found", raw)
    return [join(raw if url else os.path.abspath(raw), n) for n in names]


def _split_member(name: str) -> tuple[str, str]:
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    return (name, "") if dot < 0 else (name[:dot], name[dot + 1 :])


def scan_tar_shards(
    raw: str,
    tick: Tick,
    ordered_map: OrderedMap | None = None,
    sink: SinkFactory = InventoryBuilder,
    storage_options: Mapping[str, Any] | None = None,
    interface: Interface = CLI,
) -> InventoryView:
    """Inventory of every sample in the tar shards at ``raw``; ``tick(n)`` reports progress
    (``interface``: how storage hints name the options; it travels with each task).

    ``raw`` may be a URL (a tar object, or a prefix of them): each tar is then read through
    fsspec with ``storage_options``, headers only in blocks of ``URL_BLOCK`` bytes
    (:func:`_open_tar`).

    One task per input tar, run by ``ordered_map`` (an engine's, see
    :mod:`shardprep.engine`) when given, else here; the parts are merged in
    tar order with their label texts interned in that order, so the result is
    the same as a serial scan.
    """
    tars = list_tar_shards(raw, storage_options, interface)
    if is_url(raw):
        root = posixpath.dirname(tars[0]) if tars == [raw] else raw.rstrip("/")
    else:
        root = os.path.dirname(tars[0]) if os.path.isfile(raw) else os.path.abspath(raw)
    builder = sink(root, False)
    labels, problems = LabelTable(), Problems()
    unlabelled = 0
    options = dict(storage_options) if storage_options else None  # travels with each task
    jobs = [(root, tar_path, options, interface) for tar_path in tars]
    parts = ordered_map(_scan_tar, jobs) if ordered_map is not None else map(_scan_tar, jobs)
    for part in parts:  # merged one at a time, in tar order
        mapping = labels.merge(part.labels)
        part.builder.relabel(mapping)
        builder.extend(part.builder)
        problems.items += part.problems.items
        unlabelled += part.unlabelled
        tick(len(part.builder))
    if len(labels) and unlabelled:
        problems.add(raw, f"{unlabelled} sample(s) have no .cls while others do; label all or none")
    problems.raise_if_any()
    return labels.freeze(builder)


@dataclass
class _TarPart:
    """One input tar's samples, with labels as ids into its own ``labels`` texts."""

    builder: InventoryBuilder
    labels: LabelTable
    problems: Problems
    unlabelled: int


URL_BLOCK = 8 << 20  # a remote tar is read in ranged reads of this size (its headers' blocks)


@contextlib.contextmanager
def _open_tar(
    tar_path: str, storage_options: Mapping[str, Any] | None, interface: Interface = CLI
) -> Iterator[tarfile.TarFile]:
    """The tar at a path or URL, opened for reading headers member by member.

    A URL is read through an fsspec file with a read-ahead cache of ``URL_BLOCK`` bytes:
    consecutive small members come from one ranged GET, a member larger than the block is
    skipped by seeking past it (the next ranged GET starts at the next header). Memory stays
    bounded by the block, whatever the tar's size.
    """
    if not is_url(tar_path):
        with tarfile.open(tar_path, "r:") as tar:
            yield tar
        return
    fs, path = open_url(tar_path, storage_options, interface)
    with (
        fs.open(path, "rb", block_size=URL_BLOCK, cache_type="readahead") as f,
        tarfile.open(fileobj=f, mode="r:") as tar,
    ):
        yield tar


def _scan_tar(
    job: tuple[str, str, Mapping[str, Any] | None]
    | tuple[str, str, Mapping[str, Any] | None, Interface],
) -> _TarPart:
    """Scan one tar (runs wherever the engine runs tasks); ``job``: (root, tar path, storage
    options[, interface])."""
    root, tar_path, options = job[:3]
    interface = job[3] if len(job) > 3 else CLI
    builder = InventoryBuilder(root)
    labels, problems = LabelTable(), Problems()
    unlabelled = 0
    try:
        with _open_tar(tar_path, options, interface) as tar:
            current, label_text = None, None
            parts: list[tuple[str, int, int]] = []
            first_member: dict[str, str] = {}  # each sample's first member: adjacency check
            skip = False  # the current group is refused (members seen earlier, bad label)
            for member in tar:
                if member.isdir():
                    continue
                if not member.isfile() or member.issparse():
                    problems.add(f"{tar_path}:{member.name}", _not_a_file(member))
                    continue
                if WEBDATASET_META.match(member.name):
                    continue  # WebDataset's own metadata member (__key__, __meta__/...)
                stem, ext = _split_member(member.name)
                if stem != current:
                    if current is not None and not skip:
                        unlabelled += _add(
                            builder, labels, problems, current, parts, label_text, tar_path
                        )
                    current, parts, label_text = stem, [], None
                    skip = stem in first_member  # (reported once; never a duplicate key)
                    if skip:
                        problems.add(
                            f"{tar_path}:{member.name}",
                            _not_adjacent(stem, first_member[stem], member.name, tar_path),
                        )
                    else:
                        first_member[stem] = member.name
                if skip:
                    continue
                if ext == LABEL_EXT:
                    label_text = _tar_label(tar, member, tar_path, problems)
                    skip = label_text is None  # (reported: not counted as unlabelled)
                elif not ext:
                    problems.add(f"{tar_path}:{member.name}", "member has no extension")
                else:
                    parts.append((ext, member.size, member.offset_data))
            if current is not None and not skip:
                unlabelled += _add(builder, labels, problems, current, parts, label_text, tar_path)
    except (tarfile.TarError, OSError) as err:
        problems.add(tar_path, f"cannot read as an uncompressed tar ({err}); decompress it first")
    except InputError:
        raise  # a member or label refused (naming it): not a transport error
    except Exception as err:  # a URL backend's own transport error, not an OSError
        problems.add(tar_path, f"cannot read ({describe_error(tar_path, err, interface)})")
    return _TarPart(builder, labels, problems, unlabelled)


def _tar_label(
    tar: tarfile.TarFile, member: tarfile.TarInfo, tar_path: str, problems: Problems
) -> str | None:
    """The label text of a ``.cls`` member, or None with a problem naming ``tar:member``
    when it is not UTF-8 text."""
    fileobj = tar.extractfile(member)
    data = fileobj.read() if fileobj else b""
    try:
        return cls_file_text(data)
    except UnicodeDecodeError as err:
        problems.add(
            f"{tar_path}:{member.name}",
            f"cannot read label: not UTF-8 text ({err}); write the class index or name as "
            "UTF-8 text",
        )
        return None


def _not_adjacent(stem: str, first: str, again: str, tar_path: str) -> str:
    """Why a sample whose members are not next to each other in the tar is refused."""
    name = posixpath.basename(tar_path)
    return (
        f"the members of sample {stem!r} are not contiguous in {name}: {first!r} comes "
        f"before other samples' members and {again!r} after them; WebDataset groups only "
        "adjacent members into one sample (it would read two samples), so write each "
        "sample's members next to each other (e.g. tar in sorted name order)"
    )


def _not_a_file(member: tarfile.TarInfo) -> str:
    """Why a tar member cannot be a part of a sample: links are not followed."""
    if member.issym() or member.islnk():
        kind = "a symbolic link" if member.issym() else "a hard link"
        return (
            f"member is {kind} to {member.linkname!r}; links are not followed: "
            "store the file itself in the tar (tar --dereference --hard-dereference)"
        )
    if member.issparse():
        return "member is a sparse file; store it as a regular file"
    return "member is not a regular file (device, fifo or other special member)"


def _add(
    builder: InventoryBuilder,
    labels: LabelTable,
    problems: Problems,
    stem: str,
    parts: list[tuple[str, int, int]],
    label_text: str | None,
    tar_path: str,
) -> int:
    """Add one grouped sample; returns 1 if it had no label."""
    if not parts:
        problems.add(f"{tar_path}:{stem}", "sample has no data members, only a label")
        return 0
    where = f"{tar_path}:{stem}.{LABEL_EXT}"
    label = labels.intern(label_text, where, tar_path) if label_text is not None else UNLABELLED
    builder.add(stem, label, parts, container=tar_path)
    return int(label == UNLABELLED)
