"""Build: the orchestrator, scan → plan → write (in parallel) → manifest.

The only module that knows every stage. It owns the output folder's life
cycle (refuse, overwrite, resume), the worker processes and the progress bars;
the stages themselves stay pure or single-shard.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from shardprep.config import BuildConfig, default_workers
from shardprep.errors import InputError
from shardprep.inventory import Inventory, SampleRef
from shardprep.manifest import Manifest, manifest_from_records, write_manifest
from shardprep.plan import plan_shards
from shardprep.scan import InputFormat, scan
from shardprep.shardformat import MANIFEST_NAME, shard_name
from shardprep.weighting import Selection, select_samples
from shardprep.write import ShardRecord, record_from_files, write_shard

__all__ = ["BuildSummary", "build"]

JOURNAL_NAME = ".shardprep-build.json"
_OWN_FILE = re.compile(r"^\.?(shard-\d{5}\.(tar|tar\.zst|idx)|manifest\.json)(\.partial)?$")


class _Bar(tqdm):  # type: ignore[misc]
    """tqdm without its monitor thread, so worker processes can be forked safely."""

    monitor_interval = 0


@dataclass(frozen=True)
class BuildSummary:
    """What a build produced; ``to_dict()`` is the ``--json`` output."""

    out: str
    num_samples: int
    num_classes: int
    num_shards: int
    num_bytes: int
    tar_bytes: int
    min_shard_samples: int
    max_shard_samples: int
    shard_bytes_ratio: float
    elapsed_s: float
    files_per_s: float
    mb_per_s: float
    reused_shards: int

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        return asdict(self)


def build(raw: str, out: str, **options: Any) -> BuildSummary:
    """Turn the dataset at ``raw`` into balanced shards in ``out``.

    ``options`` are the fields of :class:`~shardprep.config.BuildConfig`
    (``shards`` is required). Returns the summary the CLI prints.

    Raises:
        ShardprepError: any input, plan or write problem, with a message that
            names the file or shard and what to do.
    """
    config = BuildConfig(**options)
    started = time.perf_counter()
    _check_out(out, config)
    # → Inventory: one entry per sample, metadata only
    inventory = _scan(raw, config)
    # → Selection: which inventory samples are written, and how many copies
    selection = select_samples(inventory, config)
    # → Plan: per shard, the selected samples' positions in write order
    labels = inventory.label[selection.source]
    sizes = inventory.sample_bytes()[selection.source]
    plan = plan_shards(labels, sizes, config.shards, config.seed, groups=selection.source)
    fingerprint = _fingerprint(inventory, config, selection)
    _prepare_out(out, config)
    journal = _journal(out, config, fingerprint)
    # → ShardRecords in shard order, then the manifest (its presence means "complete")
    records, reused = _write_all(inventory, selection, plan, out, config)
    manifest = manifest_from_records(
        records,
        config.output_options(),
        fingerprint,
        inventory.class_names,
        extra=selection.manifest_section(inventory),
    )
    write_manifest(manifest, out)
    os.remove(journal)
    return _summary(out, manifest, inventory, time.perf_counter() - started, reused)


def _check_out(out: str, config: BuildConfig) -> None:
    """Refuse an unusable ``out`` before any work: a file, or non-empty without a flag."""
    if not os.path.exists(out):
        if config.resume:
            raise InputError(
                f"{out}: no interrupted build to resume here; run without --resume", out
            )
        return
    if not os.path.isdir(out):
        raise InputError(f"{out}: exists and is not a folder; choose another OUT", out)
    existing = sorted(os.listdir(out))
    if existing and not (config.overwrite or config.resume):
        raise InputError(
            f"{out}: the output folder is not empty ({len(existing)} entries, e.g. "
            f"{existing[0]!r}); pass --overwrite to replace a previous build, "
            "--resume to finish an interrupted one, or choose an empty folder",
            out,
        )


def _prepare_out(out: str, config: BuildConfig) -> None:
    """Create ``out``; with --overwrite remove the files a previous build wrote (only those)."""
    os.makedirs(out, exist_ok=True)
    if config.overwrite:
        for name in os.listdir(out):
            if _OWN_FILE.match(name) or name == JOURNAL_NAME:
                os.remove(os.path.join(out, name))


def _scan(raw: str, config: BuildConfig) -> Inventory:
    with _Bar(desc="scan", unit=" samples", disable=not config.progress, leave=False) as bar:
        return scan(
            raw,
            InputFormat(config.input_format),
            tick=bar.update,
            path_column=config.path_column,
            label_column=config.label_column,
            workers=config.workers or default_workers(),
        )


def _fingerprint(inventory: Inventory, config: BuildConfig, selection: Selection) -> str:
    """sha256 of everything that determines the output: names, sizes, labels, options, weights."""
    digest = hashlib.sha256()
    digest.update(json.dumps(config.output_options(), sort_keys=True).encode())
    digest.update(json.dumps(selection.section, sort_keys=True).encode())
    digest.update(json.dumps(inventory.class_names).encode())
    for array in (inventory.stem_end, inventory.label, inventory.part_size, inventory.part_ext):
        digest.update(np.ascontiguousarray(array).tobytes())
    digest.update(inventory.stem_blob)
    digest.update(json.dumps(inventory.exts).encode())
    digest.update(inventory.meta_blob)
    return digest.hexdigest()


def _journal(out: str, config: BuildConfig, fingerprint: str) -> str:
    """Write (or, with --resume, check) the journal that marks a build in progress."""
    path = os.path.join(out, JOURNAL_NAME)
    record = {"input_fingerprint": fingerprint, "options": config.output_options()}
    if config.resume:
        if os.path.exists(os.path.join(out, MANIFEST_NAME)) and not os.path.exists(path):
            raise InputError(f"{out}: the build is already complete; nothing to resume", out)
        try:
            with open(path, encoding="utf-8") as f:
                previous = json.load(f)
        except FileNotFoundError as err:
            raise InputError(
                f"{out}: no interrupted build to resume here; run without --resume", out
            ) from err
        if previous != record:
            raise InputError(
                f"{out}: the interrupted build used other input or options; rerun it with "
                "the same RAW and options, or start over with --overwrite",
                out,
            )
        return path
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, sort_keys=True)
    return path


# --- writing in parallel ---------------------------------------------------------


@dataclass(frozen=True)
class _WriteContext:
    """Everything a worker needs to write any shard; inherited once per worker process."""

    inventory: Inventory
    selection: Selection
    plan: list[np.ndarray]
    out: str
    compression: str
    zstd_level: int

    def samples(self, shard: int) -> list[SampleRef]:
        return self.selection.samples(self.inventory, self.plan[shard])

    def write(self, shard: int, progress: Any = None) -> ShardRecord:
        num_classes = len(self.inventory.class_names or ())
        return write_shard(
            shard,
            self.samples(shard),
            self.out,
            num_classes,
            self.compression,
            self.zstd_level,
            progress,
        )


_worker_context: _WriteContext | None = None  # set once per worker process by _init_worker
_worker_counter: Any = None


def _init_worker(context: _WriteContext, counter: Any) -> None:
    global _worker_context, _worker_counter
    _worker_context, _worker_counter = context, counter


def _count(n: int) -> None:
    with _worker_counter.get_lock():
        _worker_counter.value += n


def _write_in_worker(shard: int) -> ShardRecord:
    if _worker_context is None:
        raise RuntimeError("worker used before _init_worker")
    return _worker_context.write(shard, _count)


def _write_all(
    inventory: Inventory,
    selection: Selection,
    plan: list[np.ndarray],
    out: str,
    config: BuildConfig,
) -> tuple[list[ShardRecord], int]:
    """Write every shard not already finished; returns records in shard order and #reused."""
    records: dict[int, ShardRecord] = {}
    if config.resume:
        for shard in range(len(plan)):
            if os.path.exists(os.path.join(out, shard_name(shard, config.compression))):
                records[shard] = record_from_files(out, shard, config.compression)
    todo = [s for s in range(len(plan)) if s not in records]
    context = _WriteContext(inventory, selection, plan, out, config.compression, config.zstd_level)
    total = sum(len(plan[s]) for s in todo)
    workers = min(config.num_workers(), max(1, len(todo)))
    if workers == 1:
        with _Bar(total=total, desc="write", unit=" samples", disable=not config.progress) as bar:
            for shard in todo:
                records[shard] = context.write(shard, bar.update)
    else:
        records.update(_write_parallel(context, todo, workers, total, config.progress))
    return [records[s] for s in range(len(plan))], len(plan) - len(todo)


def _write_parallel(
    context: _WriteContext, todo: list[int], workers: int, total: int, progress: bool
) -> dict[int, ShardRecord]:
    """Write shards ``todo`` over ``workers`` processes; the first failure cancels the rest."""
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    mp = multiprocessing.get_context(method)
    counter = mp.Value("q", 0)
    records: dict[int, ShardRecord] = {}
    with (
        _pool(workers, mp, context, counter) as pool,
        _Bar(total=total, desc="write", unit=" samples", disable=not progress) as bar,
    ):
        pending: dict[Future[ShardRecord], int] = {
            pool.submit(_write_in_worker, shard): shard for shard in todo
        }
        while pending:
            done, _ = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
            bar.update(counter.value - bar.n)
            for future in done:
                shard = pending.pop(future)
                records[shard] = future.result()  # re-raises the worker's WriteError
        bar.update(counter.value - bar.n)
    return records


@contextmanager
def _pool(
    workers: int, mp: Any, context: _WriteContext, counter: Any
) -> Iterator[ProcessPoolExecutor]:
    pool = ProcessPoolExecutor(
        workers, mp_context=mp, initializer=_init_worker, initargs=(context, counter)
    )
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _summary(
    out: str, manifest: Manifest, inventory: Inventory, elapsed: float, reused: int
) -> BuildSummary:
    data = manifest.to_json()["totals"]
    source_bytes = int(inventory.part_size.sum())
    return BuildSummary(
        out=out,
        num_samples=data["num_samples"],
        num_classes=len(inventory.class_names or ()),
        num_shards=data["num_shards"],
        num_bytes=data["num_bytes"],
        tar_bytes=data["tar_bytes"],
        min_shard_samples=data["min_shard_samples"],
        max_shard_samples=data["max_shard_samples"],
        shard_bytes_ratio=data["shard_bytes_ratio"],
        elapsed_s=round(elapsed, 3),
        files_per_s=round(len(inventory.part_size) / elapsed, 1),
        mb_per_s=round(source_bytes / elapsed / 1e6, 1),
        reused_shards=reused,
    )
