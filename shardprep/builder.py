"""Build: the orchestrator, scan → plan → write (in parallel) → manifest.

The only module that knows every stage. It drives the output's life cycle
(refuse, overwrite, resume, publish) through a :mod:`~shardprep.destination`
(a local folder, or an fsspec URL with local staging), and the parallel scan
and write through an :mod:`~shardprep.engine` (local processes, or Ray); the
stages themselves stay pure or single-shard.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import Any

from tqdm import tqdm

from shardprep.append import AppendBase, check_new_keys, class_union, find_base
from shardprep.config import BuildConfig, default_workers
from shardprep.destination import Destination, open_destination
from shardprep.engine import Engine, EngineOptions, WriteContext, open_engine
from shardprep.format.errors import (
    BuildInterrupted,
    InputError,
    ManifestError,
    OutputError,
    StalledError,
    WorkersDiedError,
    WriteError,
    is_interrupt,
)
from shardprep.format.interface import CLI
from shardprep.format.manifest import JOURNAL_NAME, Manifest, manifest_from_records
from shardprep.format.shardformat import MANIFEST_NAME, shard_name
from shardprep.format.sigint import deferred
from shardprep.format.versions import appended_manifest, manifest_version
from shardprep.inventory import InventoryBuilder, InventoryView, SampleRef
from shardprep.out_spill import OutSpill
from shardprep.plan_store import plan_to_files
from shardprep.scan import InputFormat, detect_format, scan
from shardprep.scratch import OwnedFolder, remove_tree, sweep_stale
from shardprep.spill import InventoryStore, StoreFolder
from shardprep.storage import is_url, local_path
from shardprep.transform import MapError, SampleMap
from shardprep.url_output import read_manifest_at
from shardprep.weighting import Selection, select_samples
from shardprep.write import ResumableWriteError, ShardRecord

__all__ = ["JOURNAL_NAME", "BuildSummary", "build"]


class _Bar(tqdm):  # type: ignore[misc]
    """tqdm without its monitor thread, so worker processes can be forked safely."""

    monitor_interval = 0


@dataclass(frozen=True)
class BuildSummary:
    """What a build produced; ``to_dict()`` is the ``--json`` output."""

    out: str
    layout: str  # the input layout read: class-folders, keyed, listing or tar
    layout_detected: bool  # True if auto-detected, False if given with --format
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
    already_complete: bool = False  # --resume found OUT complete, built from this input: no-op
    version: int = 1  # the version of OUT this build made (an append: 2, 3, ...)
    first_shard: int = 0  # the first shard it wrote (an append: after the earlier versions')

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        return asdict(self)


def build(raw: str | os.PathLike[str] | Iterable[Any], out: str, **options: Any) -> BuildSummary:
    """Turn the dataset at ``raw`` into balanced shards in ``out``.

    ``raw`` is a path or URL, or an iterable of sample dicts (:mod:`shardprep.from_iterable`).
    ``options`` are the fields of :class:`~shardprep.config.BuildConfig`
    (``shards`` is required). ``out`` is a folder or an fsspec URL (``s3://bucket/prefix``;
    ``storage_options`` are passed to fsspec for RAW and OUT, ``raw_storage_options`` and
    ``out_storage_options`` for one of them only). Returns the summary the CLI prints.

    Raises:
        ShardprepError: any input, plan or write problem, with a message that
            names the file or shard and what to do.
    """
    if not isinstance(raw, str | os.PathLike):  # samples from code: spilled, then built as tar
        from shardprep.from_iterable import build_from_iterable

        return build_from_iterable(raw, out, **options)
    raw = os.fspath(raw)
    config = BuildConfig(**options)
    started = time.perf_counter()
    stage = _Stage.CHECK
    progress = _Progress()  # what this build knows OUT holds, for the advice after a failure
    try:
        sweep_stale()  # killed builds' scratch and staging folders (only those), whatever follows
        # a URL's client is made here (s3fs: ~0.5 s); nothing is written yet, so a Ctrl-C gets
        # the advice to run it again, also where the CLI cannot look at OUT (a URL)
        destination = open_destination(out, config)
    except BaseException as err:
        if is_interrupt(err) and not isinstance(err, BuildInterrupted):
            raise _before_any_shard(config) from err
        raise
    engine_scope = contextlib.ExitStack()  # the engine is closed when the build ends
    scratch: list[str] = []  # the scratch folder, once made
    try:
        destination.check_apart(raw)
        destination.check()  # a local OUT is locked from here on (shardprep.out_lock)
        _check_engine_for(destination, config)
        spill = _out_spill(out, config)  # Parquet on a Ray cluster: payloads go into OUT
        if spill is not None:
            if config.resume or config.overwrite:  # the earlier build is over: what it left
                spill.clear_all()
            engine_scope.callback(spill.clear)
        # --append: the version it builds on (OUT is locked: it stays the newest, locally)
        base = find_base(destination.read_out, out, config) if config.append else None
        engine = engine_scope.enter_context(open_engine(_engine_options(config)))
        # Whole-dataset metadata lives in column files in a private scratch folder.
        with deferred():  # made and registered for removal, or a Ctrl-C after both
            work = engine_scope.enter_context(OwnedFolder("shardprep-build-"))
            scratch.append(work)
        with _scratch_errors(work):
            # → Inventory: one entry per sample, metadata only (on disk)
            inventory, layout = _scan(raw, config, engine, os.path.join(work, "inventory"), spill)
            engine_scope.callback(inventory.close)
            if base is not None:  # the build's class indices stay; NEW's others come after
                _join_classes(inventory, base, out, raw)
            # → Selection: which inventory samples are written, and how many copies
            selection = select_samples(inventory, config)
            if base is not None:  # keys are unique across every version: nothing written yet
                naming = _key_naming(raw, layout, config)
                check_new_keys(
                    inventory, selection, base.manifest, destination.read_out, out, **naming
                )
            # → Plan: per shard, the selected samples in write order (one file per shard)
            plan = plan_to_files(
                inventory,
                selection,
                config.shards,
                config.seed,
                os.path.join(work, "plan"),
                shards_option=config.interface.option("shards"),
            )
            progress.num_shards = len(plan)
            progress.first_shard = 0 if base is None else base.first_shard
        fingerprint = _fingerprint(inventory, config, selection)
        if base is not None:
            fingerprint = base.fingerprint(fingerprint)
        complete = None
        if config.resume:
            complete = (
                _already_complete(destination, config, fingerprint)
                if base is None
                else _append_complete(destination, config, base, fingerprint)
            )
        if complete is not None:  # --resume of a finished build: nothing to do, not an error
            detected = InputFormat(config.input_format) is InputFormat.AUTO
            elapsed = time.perf_counter() - started
            written = _written(complete, base)
            summary = _summary(
                out, layout, detected, written, inventory, elapsed, len(written.shards)
            )
            return replace(_versioned(summary, complete, base), already_complete=True)
        # Tasks that may run on other machines (Ray) upload their shards into OUT themselves.
        upload = destination.prepare(tasks_elsewhere=not engine.shares_disk)
        stage = _Stage.JOURNAL
        destination.start_journal(fingerprint, None if base is None else base.journal_record())
        stage = _Stage.WRITE  # OUT holds this build's journal: from here on it is resumable
        # → ShardRecords in shard order, then the manifest (its presence means "complete")
        context = WriteContext(
            plan,
            destination.staging,
            config.compression,
            config.zstd_level,
            # the parts are read from RAW, or from OUT where the Parquet payloads went
            config.out_options() if _spilled(spill, layout) else config.raw_options(),
            config.map,  # --map: a transform.SampleMap, run in the write tasks
            upload,
            destination.out_lock,  # held by every writer process too (shardprep.out_lock)
            first_shard=progress.first_shard,
        )
        records, reused = _write_all(engine, context, destination, config, progress)
        if spill is not None:  # before the manifest: a complete OUT holds no spill
            spill.clear()
        if base is None:
            manifest = manifest_from_records(
                records,
                config.output_options(),
                fingerprint,
                inventory.class_names,
                extra=selection.manifest_section(inventory),
            )
            destination.publish(manifest)  # the manifest, then the journal is removed
        else:  # the next version: its immutable file(s), then manifest.json, then the journal
            manifest = appended_manifest(
                base.manifest,
                records,
                config.output_options(),
                fingerprint,
                inventory.class_names,
                selection.section,
            )
            destination.publish(manifest, base.version_files(manifest))
        detected = InputFormat(config.input_format) is InputFormat.AUTO
        elapsed = time.perf_counter() - started
        written = _written(manifest, base)
        summary = _summary(out, layout, detected, written, inventory, elapsed, reused)
        return _versioned(summary, manifest, base)
    except BaseException as err:
        if stage is _Stage.WRITE:  # every task has stopped: no partial file is being written
            destination.discard_partial()
        if is_interrupt(err) and not isinstance(err, BuildInterrupted):
            raise _interrupted(destination, config, stage, progress) from err
        raise
    finally:
        # Clean-up takes time (the scratch folder, Ray's shutdown): a Ctrl-C that lands in it
        # gets the advice for the stage the build reached, like one that lands before.
        try:
            try:
                engine_scope.close()
            finally:
                destination.close()
        except (KeyboardInterrupt, SystemError, RuntimeError) as err:
            if not is_interrupt(err):
                raise
            for folder in scratch:  # its removal may be what the Ctrl-C cut short
                remove_tree(folder)
            if isinstance(err, BuildInterrupted):
                raise
            raise _interrupted(destination, config, stage, progress) from err


@contextlib.contextmanager
def _scratch_errors(work: str) -> Iterator[None]:
    """A full scratch disk becomes an OutputError that says what to do (a bigger TMPDIR)."""
    try:
        yield
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        raise OutputError(
            f"{work}: no room for the build's scratch files ({err.strerror}); they take about "
            "100 bytes per sample plus its path: set TMPDIR to a folder on a disk with room "
            "and run the same command again",
            work,
        ) from err


def _already_complete(
    destination: Destination, config: BuildConfig, fingerprint: str
) -> Manifest | None:
    """With --resume: the manifest of OUT if it holds this very build complete (no journal,
    a manifest of the same input fingerprint and options); None if there is a journal to
    resume, or no manifest (``start_journal`` then says what OUT holds).

    Raises:
        InputError: OUT holds a complete build of other input or options.
        ManifestError: a local OUT's manifest is invalid.
    """
    out = destination.out
    if is_url(out):
        if destination.has_journal():
            return None
        try:
            manifest = read_manifest_at(out, config.out_options())
        except ManifestError:
            return None
    elif is_complete_output(out):
        manifest = read_manifest_at(out)
    else:
        return None
    if manifest.input_fingerprint != fingerprint or manifest.options != config.output_options():
        rebuild = config.interface.setting("overwrite")
        raise InputError(
            f"{out}: already holds a complete build, of other input or options, so there is "
            f"nothing to resume: pass {rebuild} instead to rebuild it from this input",
            out,
        )
    return manifest


def _append_complete(
    destination: Destination, config: BuildConfig, base: AppendBase, fingerprint: str
) -> Manifest | None:
    """With --append --resume: OUT's newest version if it is this very append, published and
    its journal removed (nothing to do); None if there is a journal to resume (the append
    finishes, publishing again what it may have published already).

    Raises:
        InputError: no journal, and OUT's newest version is not this append.
    """
    if destination.has_journal():
        return None
    complete = base.complete(fingerprint, config.output_options())
    if complete is None:
        raise InputError(
            f"{destination.out}: its newest version ({manifest_version(base.newest)}) was not "
            "appended from this input and options, and no append was interrupted, so there is "
            f"nothing to resume; to append this input, {config.interface.without('resume')}",
            destination.out,
        )
    return complete


def _key_naming(raw: str, layout: InputFormat, config: BuildConfig) -> dict[str, str]:
    """How an append's key refusal names a Parquet input (its rows' sources are the build's
    scratch copy) and what it advises: keys unique across exports."""
    if layout is not InputFormat.PARQUET:
        return {}
    key_column = config.interface.option("key_column")
    return {
        "raw": raw,
        "advice": (
            f"give the rows keys unique across every export ({key_column} naming a column "
            "unique across them; without one a key is the file name without run ids and the "
            "row number, the same in every export that names its files alike)"
        ),
    }


def _join_classes(inventory: InventoryStore, base: AppendBase, out: str, raw: str) -> None:
    """Give NEW's samples the build's class indices (NEW's other classes come after them)."""
    union, mapping = class_union(base.manifest.class_names, inventory.class_names, out, raw)
    if mapping is not None:
        inventory.relabel(mapping)
    inventory.class_names = union


def _written(manifest: Manifest, base: AppendBase | None) -> Manifest:
    """The part of ``manifest`` this build wrote (an append: its own shards only)."""
    if base is None:
        return manifest
    return replace(manifest, shards=manifest.shards[base.first_shard :])


def _versioned(summary: BuildSummary, manifest: Manifest, base: AppendBase | None) -> BuildSummary:
    """``summary`` with the version this build made and its first shard."""
    first = 0 if base is None else base.first_shard
    return replace(summary, version=manifest_version(manifest), first_shard=first)


def _check_engine_for(destination: Destination, config: BuildConfig) -> None:
    """Ray tasks upload their shards into OUT themselves: not into this process's memory."""
    if config.engine == "ray" and destination.process_local:
        engine = config.interface.setting
        raise InputError(
            f"{destination.out}: {engine('engine', 'ray')} cannot build into an OUT that lives "
            "in this process's memory (its tasks run in other processes, which upload into OUT "
            f"themselves): use {engine('engine', 'local')}, or an object store or a folder as "
            "OUT",
            destination.out,
        )


def _out_spill(out: str, config: BuildConfig) -> OutSpill | None:
    """Where a Parquet input's payloads are copied when the write tasks run on a Ray
    cluster, whose nodes cannot read this machine's scratch folder: OUT's own storage
    (:mod:`shardprep.out_spill`); None elsewhere (the build's scratch folder)."""
    if config.engine == "ray" and config.cluster_address():
        return OutSpill.under(out, config.out_options(), config.interface)
    return None


def _spilled(spill: OutSpill | None, layout: InputFormat) -> bool:
    """True if the inventory's parts are in OUT's storage (a Parquet input on a cluster)."""
    return spill is not None and layout is InputFormat.PARQUET


def _engine_options(config: BuildConfig) -> EngineOptions:
    """Which engine runs the parallel stages, and with how many workers."""
    return EngineOptions(
        name=config.engine,
        workers=config.workers or default_workers(),
        workers_given=config.workers is not None,
        ray_address=config.ray_address,
        stall_timeout=config.stall_timeout,
        interface=config.interface,
    )


class _Stage(Enum):
    """How far a build got, for the advice after a Ctrl-C and for clean-up."""

    CHECK = "before OUT is touched"
    JOURNAL = "OUT is prepared, the journal is being written"
    WRITE = "the journal is written: resumable"


def is_complete_output(out: str) -> bool:
    """Whether local folder ``out`` holds a manifest and no build journal (False for a URL)."""
    if is_url(out):
        return False
    folder = local_path(out)
    return os.path.exists(os.path.join(folder, MANIFEST_NAME)) and not os.path.exists(
        os.path.join(folder, JOURNAL_NAME)
    )


def interrupted_around(
    out: str,
    was_complete: bool,
    overwrite: bool,
    shards: int,
    compression: str,
    append: bool = False,
) -> str | None:
    """The CLI's advice for a Ctrl-C that landed around :func:`build` rather than inside it (in
    its first steps, or as it returned), read from what local folder ``out`` holds now; None for
    a URL (not looked at after a Ctrl-C). ``was_complete``: ``out`` held a manifest and no
    journal before the build began; ``shards``, ``compression`` and ``append``: the build's
    options (an append's shards are numbered from the ``first_shard`` its journal records)."""
    if is_url(out):
        return None
    folder = local_path(out)
    journal = os.path.exists(os.path.join(folder, JOURNAL_NAME))
    complete = is_complete_output(out)
    if journal:
        first = _journal_first_shard(folder)
        shards_in = _shards_in(folder, range(first, first + shards), compression)
        kept = _kept_words(shards_in, f" in {out}")
        again = CLI.again("resume", "overwrite" if overwrite else None)
        return f"interrupted; {kept}: {again} to finish the build"
    if complete and append:  # complete before and after: which version, inspect tells
        try:
            at = f" at version {manifest_version(read_manifest_at(out))}"
        except ManifestError:  # damaged meanwhile: verify says how
            at = ""
        return (
            f"interrupted as the append began or returned: {out} is complete{at} (shardprep "
            f"inspect {out} lists its versions)"
        )
    if complete and not was_complete:
        return f"interrupted after the build finished: {out} is complete"
    if complete:
        return f"interrupted: {out} holds the complete output it held before"
    return f"interrupted before any shard was written: {CLI.again()}"


def _journal_first_shard(folder: str) -> int:
    """The first shard an interrupted append writes (its journal's record), else 0."""
    try:
        with open(os.path.join(folder, JOURNAL_NAME), encoding="utf-8") as f:
            record = json.load(f)
        first = record["append"]["first_shard"]
    except (OSError, ValueError, KeyError, TypeError):  # a plain build's journal, or unreadable
        return 0
    return first if type(first) is int and first >= 0 else 0


def _interrupted(
    destination: Destination, config: BuildConfig, stage: _Stage, progress: _Progress
) -> BuildInterrupted:
    """The Ctrl-C error, with the advice that works in the state the build left OUT in."""
    out = destination.out
    journal = destination.has_journal()
    interface = config.interface  # "run the same command ..." or "call shardprep.build ..."
    if stage is not _Stage.CHECK and journal:  # (with --overwrite, an old journal is gone by now)
        again = interface.again("resume", "overwrite" if config.overwrite else None)
        kept = _kept_shards(destination, config, progress, f" in {out}")
        return BuildInterrupted(f"interrupted; {kept}: {again} to finish the build", resumable=True)
    if stage is _Stage.WRITE:  # the journal is gone only once the manifest is written
        return BuildInterrupted(
            f"interrupted after the build finished: {out} is complete", resumable=False
        )
    return _before_any_shard(config)


def _before_any_shard(config: BuildConfig) -> BuildInterrupted:
    again = config.interface.again()
    return BuildInterrupted(f"interrupted before any shard was written: {again}", resumable=False)


def _scan(
    raw: str, config: BuildConfig, engine: Engine, folder: str, spill: OutSpill | None = None
) -> tuple[InventoryStore, InputFormat]:
    """The inventory of ``raw`` and its layout (auto-detected unless --format gave one).

    The inventory is an :class:`~shardprep.spill.InventoryStore`: column files in ``folder``;
    Parquet payloads are copied into ``folder`` too, or into ``spill`` (on a Ray cluster).
    """
    layout = InputFormat(config.input_format)
    detected = layout is InputFormat.AUTO
    if detected:
        layout = detect_format(raw, config.raw_options(), config.interface)
    # leave=True: the bar's last state (the real sample count) stays, and ends its line.
    os.makedirs(folder)
    stores: list[InventoryStore] = []
    make_store = StoreFolder(folder)

    def sink(root: str, with_meta: bool) -> InventoryStore:
        stores.append(make_store(root, with_meta))
        return stores[-1]

    try:
        with _Bar(desc=f"scan {layout.value}", unit=" samples", disable=not config.progress) as bar:
            inventory = scan(
                raw,
                layout,
                tick=bar.update,
                path_column=config.path_column,
                label_column=config.label_column,
                workers=config.workers or default_workers(),
                detected=detected,
                # In-process, a class folder streams into the store instead of becoming one task result.
                ordered_map=engine.ordered_map if engine.parallel else None,
                storage_options=config.raw_options(),
                sink=sink,
                # Tasks on this machine write their class folder to disk too; Ray's return it.
                part_sink=make_store if engine.shares_disk else InventoryBuilder,
                key_column=config.key_column,
                scratch=folder,  # Parquet input: payloads are copied there (removed with it)
                interface=config.interface,  # messages name --format or input_format=
                spill_to=spill,
            )
    except BaseException:
        for store in stores:  # a failed scan leaves its column files open for writing
            store.close()
        raise
    assert isinstance(inventory, InventoryStore)
    return inventory, layout


def _fingerprint(inventory: InventoryView, config: BuildConfig, selection: Selection) -> str:
    """sha256 of everything that determines the output: names, sizes, labels, options, weights."""
    digest = hashlib.sha256()
    digest.update(json.dumps(config.output_options(), sort_keys=True).encode())
    digest.update(json.dumps(selection.section, sort_keys=True).encode())
    digest.update(json.dumps(inventory.class_names).encode())
    inventory.digest_into(digest)  # the columns, read a chunk at a time
    return digest.hexdigest()


# --- writing, on the engine ----------------------------------------------------


def _write_all(
    engine: Engine,
    context: WriteContext,
    destination: Destination,
    config: BuildConfig,
    progress: _Progress,
) -> tuple[list[ShardRecord], int]:
    """Write every shard not already finished; returns records in shard order and #reused.

    Each finished shard is handed to the destination (a remote one uploads it while the
    next are written); a shard starts only once the destination has room for it (a remote
    one bounds the shards staged locally). ``progress`` counts the shards reused and written.
    """
    plan, shards = context.plan, context.shards
    records = destination.finished_records(shards) if config.resume else {}
    progress.reused = progress.finished = len(records)
    progress.counted = True
    todo = [s for s in shards if s not in records]
    total = sum(context.shard_size(s) for s in todo)

    def admit(writing: int) -> None:  # before a shard starts: wait until OUT can take it
        while not destination.has_room(writing):
            destination.wait_for_room(0.25)

    try:
        with (
            _Bar(total=total, desc="write", unit=" samples", disable=not config.progress) as bar,
            contextlib.closing(engine.write_shards(context, todo, bar.update, admit)) as written,
        ):
            for shard, record in written:
                records[shard] = record
                progress.finished += 1
                destination.shard_written(record)
    except StalledError as err:  # its sources may hang too: not stat-ed again here
        kept = _kept_shards(destination, config, progress)
        raise StalledError(f"{err}. {stall_advice(kept, config)}", err.shard_index) from err
    except MapError as err:  # the worker named the sample; what to do depends on what is kept
        kept = _kept_shards(destination, config, progress)
        advice = map_error_advice(kept, context.transform, config)
        raise MapError(f"{err}. {advice}", err.shard_index) from err
    except WorkersDiedError as err:  # the engine said how the writer died; not what is kept
        kept = _kept_shards(destination, config, progress)
        raise WorkersDiedError(f"{err}; {resume_advice(kept, config)}", err.task) from err
    except WriteError as err:
        changed = _changed_source(context.samples(err.shard_index))
        if changed is None and isinstance(err, ResumableWriteError):  # a cause outside
            kept = _kept_shards(destination, config, progress)
            raise type(err)(f"{err}; {resume_advice(kept, config)}", err.shard_index) from err
        if changed is None:
            raise
        interface = config.interface
        raise WriteError(
            f"shard {err.shard_index}: {changed} since the scan, and the finished shards were "
            f"planned from the scanned sizes, so {interface.setting('resume')} would refuse "
            f"this input: put the file back as it was and {interface.again('resume')}, or "
            f"rebuild from the current input with {interface.setting('overwrite')}",
            err.shard_index,
        ) from err
    return [records[s] for s in shards], len(plan) - len(todo)


@dataclass
class _Progress:
    """What a build knows OUT holds, for the advice after a failure or a Ctrl-C."""

    num_shards: int = 0  # planned (0 until the plan is made)
    first_shard: int = 0  # the first planned shard's number (an append: after OUT's)
    finished: int = 0  # reused or reported written (once counted)
    reused: int = 0
    counted: bool = False  # True once the shards to reuse were looked up


def _kept_shards(
    destination: Destination, config: BuildConfig, progress: _Progress, where: str = ""
) -> str:
    """Which finished shards a failed or interrupted build leaves in OUT, in words (``where``,
    e.g. " in OUT", after "kept"); claims none it cannot know. Every write task has stopped."""
    finished, reused = progress.finished, progress.reused
    if not is_url(destination.out):  # a folder: what it holds now (others may have finished)
        shards = range(progress.first_shard, progress.first_shard + progress.num_shards)
        return _kept_words(_shards_in(destination.out, shards, config.compression), where)
    if not progress.counted and config.resume:  # stopped before the earlier shards were listed
        return f"the shards an earlier build finished are kept{where}"
    if destination.stages_locally and finished > reused:  # uploads stop with the build
        if not reused:
            return f"the shards whose upload had finished are kept{where}"
        return f"the {reused} reused shard(s) are kept{where}, and any whose upload had finished"
    return _kept_words(finished, where)  # in OUT once written (tasks upload their own shards)


def _kept_words(kept: int, where: str) -> str:
    return (
        f"the {kept} finished shard(s) are kept{where}" if kept else f"no shard was finished{where}"
    )


def _shards_in(folder: str, shards: range, compression: str) -> int:
    """How many of the shard files ``shards`` of a build are in local folder ``folder``."""
    names = (shard_name(s, compression) for s in shards)
    return sum(os.path.exists(os.path.join(folder, name)) for name in names)


def resume_advice(kept: str, config: BuildConfig) -> str:
    """What to do after a write failed on a cause outside the build (a full disk, a writer
    killed: a :class:`~shardprep.write.ResumableWriteError` or a
    :class:`~shardprep.format.errors.WorkersDiedError`): OUT holds this build's journal, so
    the same build resumed finishes it once the cause is fixed, reusing what is ``kept`` (see
    :func:`_kept_shards`)."""
    again = config.interface.again("resume", "overwrite" if config.overwrite else None)
    return f"{kept}: fix the cause, then {again}"


def stall_advice(kept: str, config: BuildConfig) -> str:
    """What to do after the writers made no progress for ``stall_timeout`` seconds: OUT holds
    this build's journal, so the same build with ``--resume`` finishes it once the storage
    answers again, reusing what is ``kept`` (see :func:`_kept_shards`)."""
    interface = config.interface
    again = interface.again("resume", "overwrite" if config.overwrite else None)
    return (
        f"{kept[0].upper()}{kept[1:]}: fix the cause and {again} (or raise "
        f"{interface.option('stall_timeout')} for very slow storage)"
    )


def map_error_advice(kept: str, transform: SampleMap | None, config: BuildConfig) -> str:
    """What to do after a ``--map`` function failed: OUT holds this build's journal, so the
    same build with ``--resume`` (``resume=True``) and the fixed function under the same name
    finishes it, reusing what is ``kept`` (see :func:`_kept_shards`)."""
    name = f" {transform.name}" if transform is not None else ""
    again = config.interface.again("resume", "overwrite" if config.overwrite else None)
    return f"{kept[0].upper()}{kept[1:]}: fix the function, keeping its name{name}, and {again}"


def _changed_source(samples: list[SampleRef]) -> str | None:
    """How a source of ``samples`` differs from the scan (gone, other size), or None."""
    for sample in samples:
        for part in sample.parts:
            if is_url(part.path):
                continue  # the writer's own message names the URL and what changed
            try:
                size = os.stat(part.path).st_size
            except FileNotFoundError:
                return f"{part.path} was removed"
            except OSError:
                continue  # unreadable, not changed: the writer's own message says so
            if part.offset < 0 and size != part.size:
                return f"{part.path} changed size ({part.size} -> {size} bytes)"
            if part.offset >= 0 and size < part.offset + part.size:
                return f"{part.path} was truncated ({size} bytes)"
    return None


def _summary(
    out: str,
    layout: InputFormat,
    detected: bool,
    manifest: Manifest,
    inventory: InventoryView,
    elapsed: float,
    reused: int,
) -> BuildSummary:
    data = manifest.to_json()["totals"]
    source_bytes = inventory.source_bytes()
    return BuildSummary(
        out=out,
        layout=layout.value,
        layout_detected=detected,
        num_samples=data["num_samples"],
        num_classes=len(inventory.class_names or ()),
        num_shards=data["num_shards"],
        num_bytes=data["num_bytes"],
        tar_bytes=data["tar_bytes"],
        min_shard_samples=data["min_shard_samples"],
        max_shard_samples=data["max_shard_samples"],
        shard_bytes_ratio=data["shard_bytes_ratio"],
        elapsed_s=round(elapsed, 3),
        files_per_s=round(inventory.num_parts / elapsed, 1),
        mb_per_s=round(source_bytes / elapsed / 1e6, 1),
        reused_shards=reused,
    )
