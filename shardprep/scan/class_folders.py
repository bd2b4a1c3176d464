"""Scanner for ``RAW/<class>/<file>``: one sample per file, the class is the folder name.

Classes are the sorted names of the top-level folders, numbered 0..C-1, and
files may sit at any depth below their class folder. Metadata only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from shardprep.format.errors import InputError
from shardprep.format.interface import CLI, Interface
from shardprep.inventory import InventoryBuilder, InventorySink, InventoryView, SinkFactory
from shardprep.scan.keyed_files import LABEL_EXT
from shardprep.scan.parquet import is_parquet_name
from shardprep.scan.prefix import join, top_level, walk_input
from shardprep.scan.walk import Problems, Tick
from shardprep.workers import worker_pool

__all__ = ["scan_class_folders"]


def class_folder_names(
    root: str, storage_options: Mapping[str, Any] | None = None, interface: Interface = CLI
) -> list[str]:
    """Sorted non-hidden sub-folders of ``root`` (a folder or a URL prefix; ``interface``: how
    the refusal names ``--format``).

    Raises:
        InputError: ``root`` also holds files (then it is not a class-folder layout), or a
            folder's name is not UTF-8 (it becomes a class name in manifest.json).
    """
    top = top_level(root, storage_options, interface)
    if top.files:
        raise InputError(
            f"{root}: class-folder input must contain only folders, but it has files "
            f"such as {top.files[0][0]!r}; move them into a class folder or use "
            f"{interface.setting('input_format', 'keyed')}",
            path=root,
        )
    for name in top.folders:
        _check_class_name(root, name)
    return top.folders


def _check_class_name(root: str, name: str) -> None:
    """Refuse a folder name that is not UTF-8: class names are written to manifest.json."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as err:
        path = os.path.join(root, name)
        raise InputError(
            f"{os.fsencode(path)!r}: the class folder's name {os.fsencode(name)!r} is not "
            "valid UTF-8, and class names are written to manifest.json as text; nothing was "
            "written: rename the folder to a UTF-8 name (e.g. convmv -f latin1 -t utf8) and "
            "run the same command again",
            path=path,
        ) from err


OrderedMap = Callable[[Callable[[Any], Any], Iterable[Any]], Iterable[Any]]


def scan_class_folders(
    root: str,
    tick: Tick,
    workers: int = 1,
    ordered_map: OrderedMap | None = None,
    sink: SinkFactory = InventoryBuilder,
    part_sink: SinkFactory = InventoryBuilder,
    storage_options: Mapping[str, Any] | None = None,
    strict: bool = False,
    interface: Interface = CLI,
) -> InventoryView:
    """Inventory of every file below ``root/<class>/``; ``tick(n)`` reports progress.

    ``strict`` (the layout was detected) refuses a ``.parquet`` file: a Parquet file is
    never one sample on a guess (``--format class-folders`` says it is). ``interface``: how
    refusals name the options (it travels with each task: a frozen dataclass, picklable).

    ``root`` is a folder or a URL prefix (one paginated listing per class folder, with
    ``storage_options``: :func:`~shardprep.scan.prefix.walk_input`).

    One task per class folder. With ``workers > 1`` class folders are scanned
    in parallel processes; ``ordered_map(fn, jobs)`` (an engine's, see
    :mod:`shardprep.engine`) runs them wherever it runs tasks instead. Either
    way the parts are merged in class order, so the result is the same as a
    serial scan. ``sink`` makes what the samples go into (an on-disk store
    keeps the build's memory flat; a serial scan adds each file straight into it),
    ``part_sink`` what a parallel task collects its class folder in (on disk
    too when the tasks run on this machine: ``StoreFolder``).
    """
    classes = class_folder_names(root, storage_options, interface)
    builder = sink(root, False)
    problems = Problems()
    options = dict(storage_options) if storage_options else None  # travels with each task
    jobs = [
        (root, label, name, part_sink, options, strict, interface)
        for label, name in enumerate(classes)
    ]
    if ordered_map is not None:
        results: Iterator[tuple[InventorySink, Problems]] = iter(ordered_map(_scan_class, jobs))
        for part, part_problems in results:  # merged one at a time, in class order
            _merge(builder, problems, part, part_problems, tick)
    elif workers > 1 and len(classes) > 1:
        with worker_pool(workers) as pool:
            futures = [pool.executor.submit(_scan_class, job) for job in reversed(jobs)]
            # Merged one at a time, in class order, and dropped once merged.
            while futures:
                while not pool.wait(futures[-1:]):
                    pass
                _merge(builder, problems, *futures.pop().result(), tick)
    else:
        for job in jobs:
            before = len(builder)
            _scan_class_into(job[:3], builder, problems, options, strict, interface)
            tick(len(builder) - before)
    problems.raise_if_any()
    return builder.freeze(tuple(classes))


def _merge(
    builder: InventorySink,
    problems: Problems,
    part: InventorySink,
    part_problems: Problems,
    tick: Tick,
) -> None:
    builder.extend(part)
    problems.items += part_problems.items
    tick(len(part))


def _scan_class(
    job: tuple[str, int, str, SinkFactory, Mapping[str, Any] | None]
    | tuple[str, int, str, SinkFactory, Mapping[str, Any] | None, bool]
    | tuple[str, int, str, SinkFactory, Mapping[str, Any] | None, bool, Interface],
) -> tuple[InventorySink, Problems]:
    """Scan one class folder into its own part (runs in a worker process when parallel);
    ``job``: (root, label, folder name, part sink, storage options[, strict[, interface]])."""
    root, label, name, part_sink, options = job[:5]
    strict = len(job) > 5 and bool(job[5])
    interface = job[6] if len(job) > 6 else CLI
    builder = part_sink(root, False)
    problems = Problems()
    _scan_class_into((root, label, name), builder, problems, options, strict, interface)
    return builder.finish_part(), problems


def _scan_class_into(
    job: tuple[str, int, str],
    builder: InventorySink,
    problems: Problems,
    storage_options: Mapping[str, Any] | None = None,
    strict: bool = False,
    interface: Interface = CLI,
) -> None:
    """Add every file of one class folder to ``builder``, in sorted order (``strict``: a
    ``.parquet`` file refused)."""
    root, label, name = job
    before = len(builder)
    for entry in walk_input(join(root, name), problems, storage_options, interface):
        rel_dir = f"{name}/{entry.rel_dir}" if entry.rel_dir else name
        stem, dot, ext = entry.name.rpartition(".")
        if not dot or not stem:
            problems.add(
                join(root, rel_dir, entry.name),
                "file has no extension; the extension names the sample's part "
                "(e.g. .jpg): rename it or move it out of the input",
            )
            continue
        if ext == LABEL_EXT:
            problems.add(
                join(root, rel_dir, entry.name),
                "a .cls label file in class-folder input, where the folder names the class; "
                "remove it, or if .cls files label keyed samples, give every sample one "
                "(then the input is read as keyed files)",
            )
            continue
        if strict and is_parquet_name(entry.name):
            problems.add(
                join(root, rel_dir, entry.name),
                "a Parquet file in class folders (the first class folder holds no Parquet, so "
                "the input was read as class folders); a Parquet file is never read as one "
                f"sample on a guess: pass {interface.setting('input_format', 'parquet')} to read "
                f"rows as samples, or {interface.setting('input_format', 'class-folders')} to "
                "take each file as one sample",
            )
            continue
        builder.add(f"{rel_dir}/{stem}", label, [(ext, entry.size, -1)])
    if len(builder) == before:
        problems.add(join(root, name), "class folder has no files; remove it or add samples")
