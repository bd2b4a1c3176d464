"""A build from code: ``shardprep.build(samples, OUT, shards=N)`` with ``samples`` an iterable.

The iterable (a generator, a Hugging Face ``datasets.Dataset``, a list) of WebDataset-style
sample dicts is consumed once and spilled to tar files in a private scratch folder
(:mod:`shardprep.scan.iterable`: every sample checked, its bytes on disk as they come);
then the ordinary build reads those files as tar input. Everything a file build guarantees
(N shards, counts ±1, stratified classes, class weighting, byte-identical output for the
same samples in the same order and seed, --resume) therefore holds unchanged.

Checks that need no sample (the options, OUT, the engine) run before the iterable is
touched, so a 100 GB pipeline is not spilled for nothing. ``--resume`` consumes the
iterable again: pass the same samples (a new generator of the same pipeline); the journal's
fingerprint (keys, sizes, classes and the options) refuses other ones, as for files.
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
from collections.abc import Iterable, Sized
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from shardprep.builder import BuildSummary, build
from shardprep.config import BuildConfig
from shardprep.destination import open_destination
from shardprep.format.errors import (
    BuildInterrupted,
    DuplicateKeyError,
    InputError,
    KeyInBuildError,
    OutputError,
)
from shardprep.scan.iterable import Spilled, spill_samples
from shardprep.scratch import OwnedFolder, sweep_stale
from shardprep.storage import is_url

__all__ = ["build_from_iterable"]

LAYOUT = "iterable"  # BuildSummary.layout of a build from code


class _Bar(tqdm):  # type: ignore[misc]
    """tqdm without its monitor thread (the build forks worker processes after it)."""

    monitor_interval = 0


def build_from_iterable(samples: Iterable[Any], out: str, **options: Any) -> BuildSummary:
    """Spill ``samples``, then ``build(spill, out, input_format="tar", **options)``.

    :func:`shardprep.builder.build` dispatches here when its input is not a path. Returns its :class:`~shardprep.builder.BuildSummary` with ``layout="iterable"`` and
    the times and rates of the whole build, spill included.

    Raises:
        InputError: a bad sample (named by its key, or its position), a duplicate key,
            ``input_format`` given, OUT unusable, or Ray on a cluster (the spill is on
            this machine's disk).
        OutputError: no room for the spill in TMPDIR.
        BuildInterrupted: Ctrl-C while the samples were spilled (nothing written to OUT).
    """
    if isinstance(samples, str | bytes | os.PathLike):
        raise InputError("build_from_iterable takes samples, not a path: use build(path, ...)")
    config = BuildConfig(**options)  # bad options are refused before a sample is read
    if config.input_format != "auto":
        given = config.interface.setting("input_format", config.input_format)
        raise InputError(
            f"{given} names a layout of files; samples given as a Python iterable have none: "
            "leave it out"
        )
    _check_engine(config)
    _check_out(out, config)
    started = time.perf_counter()
    sweep_stale()  # the scratch folders of killed builds (a killed spill's too)
    with OwnedFolder("shardprep-build-") as folder:
        spilled = _spill(samples, os.path.join(folder, "samples"), config)
        try:
            summary = build(spilled.folder, out, **{**options, "input_format": "tar"})
        except KeyInBuildError as err:  # append=True: the scratch file names nothing useful
            raise InputError(
                f"sample key {err.key!r} is already in {err.held}; keys are unique across "
                "every version of a build: give the sample another __key__ or leave it out "
                "(nothing was written to OUT)"
            ) from err
        except DuplicateKeyError as err:
            raise InputError(
                f"sample key {err.key!r} is given to more than one sample: give every sample "
                "its own __key__ (nothing was written to OUT)"
            ) from err
    elapsed = time.perf_counter() - started
    return replace(
        summary,
        layout=LAYOUT,
        layout_detected=False,
        elapsed_s=round(elapsed, 3),
        files_per_s=round(spilled.num_parts / elapsed, 1),
        mb_per_s=round(spilled.num_bytes / elapsed / 1e6, 1),
    )


def _spill(samples: Iterable[Any], folder: str, config: BuildConfig) -> Spilled:
    """Spill ``samples`` into ``folder`` with a progress bar; Ctrl-C and a full disk explained."""
    os.mkdir(folder)
    total = len(samples) if isinstance(samples, Sized) else None
    reserved = frozenset({"weight"}) if config.weights_only else frozenset()
    try:
        with _Bar(
            total=total, desc="spill samples", unit=" samples", disable=not config.progress
        ) as bar:
            spilled = spill_samples(
                samples, folder, bar.update, reserved, interface=config.interface
            )
    except KeyboardInterrupt as err:
        raise BuildInterrupted(
            "interrupted while the samples were read, before anything was written: "
            + config.interface.again(),
            resumable=False,
        ) from err
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        raise OutputError(
            f"{folder}: no room to spill the samples ({err.strerror}); they take their own "
            "size on disk until the build ends: set TMPDIR to a folder on a disk with room "
            f"and {config.interface.again()}",
            folder,
        ) from err
    if not spilled.num_samples:
        raise InputError("the samples iterable yielded no samples; nothing to build")
    return spilled


def _check_engine(config: BuildConfig) -> None:
    """Ray tasks on other nodes cannot read the spill in this machine's TMPDIR."""
    if config.engine == "ray" and config.cluster_address():
        interface = config.interface
        raise InputError(
            f"{interface.setting('engine', 'ray')} on a cluster cannot build from a Python "
            "iterable yet: its samples are spilled to this machine's TMPDIR, which the other "
            f"nodes cannot read. Leave out {interface.option('ray_address')} / RAY_ADDRESS to "
            "run Ray on this machine, or write the samples to files on storage every node "
            "reads and build from those"
        )


def _check_out(out: str, config: BuildConfig) -> None:
    """OUT's own checks (exists without --overwrite, nothing to --resume), before the spill;
    and OUT must not hold TMPDIR (``--overwrite`` would delete the spill being read)."""
    destination = open_destination(out, config)
    try:
        destination.check()
    finally:
        destination.close()
    if is_url(out):
        return
    real_out, real_tmp = os.path.realpath(out), os.path.realpath(tempfile.gettempdir())
    if real_tmp == real_out or real_tmp.startswith(real_out.rstrip(os.sep) + os.sep):
        raise InputError(
            f"{out}: the output folder holds TMPDIR ({real_tmp}), where the samples are "
            "spilled: choose an output folder outside it, or set TMPDIR elsewhere",
            out,
        )
