"""The ``shardprep`` command line: a thin layer that parses options, calls the API, reports.

Exit codes: 0 success; 1 data or I/O error (``ShardprepError``); 2 usage
error (bad option values, a path argument that does not exist, impossible
requests such as more shards than samples); 130 interrupted. Expected errors print one message, never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import click

from shardprep.format.errors import BuildInterrupted, PlanError, ShardprepError, is_interrupt
from shardprep.format.interrupts import redeliver_dropped
from shardprep.storage import is_url

__all__ = ["main"]


def _run(
    action: Callable[[], Any],
    progress: bool = False,
    advice: Callable[[], str | None] | None = None,
) -> Any:
    """Call ``action``, turning our exceptions into click errors with the right exit code.

    ``progress``: progress bars may be on stderr; a Ctrl-C can cut one mid-line,
    so the interrupt message then starts with a line break of its own. ``advice``: the
    message for a Ctrl-C that ``action`` did not turn into a ``BuildInterrupted`` (one that
    landed as it began or returned), if it can tell.
    """
    try:
        return action()
    except PlanError as err:
        raise click.UsageError(str(err)) from err
    except ShardprepError as err:
        raise click.ClickException(str(err)) from err
    except (KeyboardInterrupt, SystemError, RuntimeError) as err:
        if not is_interrupt(err):  # an error that is not a Ctrl-C in disguise is a bug
            raise
        _ignore_interrupts()  # a second Ctrl-C must not cut the message short ("Aborted!")
        # BuildInterrupted says how to go on; for a bare Ctrl-C, ``advice`` may (else none).
        message = str(err) if isinstance(err, BuildInterrupted) else None
        if message is None:
            message = (advice() if advice is not None else None) or "interrupted"
        click.echo(("\n" if progress else "") + message, err=True)
        _exit_130()


_BEFORE_BEGAN = "interrupted before the {} began; nothing was written"
_BEGAN = "shardprep.command_began"  # click context meta key: a command's callback was called


class _Command(click.Command):
    """A command that notes in its context when its callback begins (see :class:`_Group`)."""

    def invoke(self, ctx: click.Context) -> Any:
        ctx.meta[_BEGAN] = True
        return super().invoke(ctx)


class _Group(click.Group):
    """The ``shardprep`` group: a Ctrl-C while click reads the command line (before the
    command's callback, which handles its own) exits 130 with one line, not click's
    ``Aborted!`` and exit 1; one that escapes a running command's own handling exits 130 too."""

    command_class = _Command

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            if isinstance(extra.get("obj"), _OwnProcess):
                # a Ctrl-C that CPython drops in a callback still stops the command (here, not
                # before cli.main: one that lands while its thread starts is handled below)
                redeliver_dropped()
            return super().make_context(info_name, args, parent, **extra)
        except KeyboardInterrupt:
            _interrupted_early("command", isinstance(extra.get("obj"), _OwnProcess))

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            owned = isinstance(ctx.obj, _OwnProcess)
            if ctx.meta.get(_BEGAN):  # in the command, outside its own handling (_run)
                _exit_interrupted("interrupted", owned)
            name = ctx.invoked_subcommand
            _interrupted_early("build" if name == "build" else "command", owned)


def _interrupted_early(what: str, owned: bool) -> NoReturn:
    """Exit 130 for a Ctrl-C before the command began: nothing was written."""
    _exit_interrupted(_BEFORE_BEGAN.format(what), owned)


def _exit_interrupted(message: str, owned: bool) -> NoReturn:
    if owned:  # a second Ctrl-C must not cut the message short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    click.echo(message, err=True)
    _exit_130()


def _exit_130() -> NoReturn:
    """Exit 130, the code for Ctrl-C, also under ``python -m shardprep``.

    CPython ends the process by SIGINT at exit (``subprocess`` sees -2) when a KeyboardInterrupt
    once propagated out of code it ran from a string, even though it was caught since:
    dataclasses and namedtuple make their methods with ``exec``/``eval`` while the builder is
    imported, where a Ctrl-C can land (a fault hunt: 26 of ~1,100 signals). Running a string
    resets that record (CPython's ``run_eval_code_obj``); tested by
    tests/faults/test_interrupt.py, which accepts 130 only.
    """
    exec("")  # resets CPython's "unhandled KeyboardInterrupt" record (see above)
    # The requests in flight when Ctrl-C came are abandoned on purpose; as their connections
    # close at exit, asyncio would print each one's error ("Task exception was never retrieved",
    # aiohttp's "Cannot write to closing transport": a fault hunt, after the advice, for a URL
    # OUT). Tested by tests/unit/test_interrupts.py::test_the_exit_after_a_ctrl_c_is_quiet.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="shardprep")
def cli() -> None:
    """Pre-shard a dataset into balanced WebDataset tar shards for distributed training."""


@cli.command()
@click.argument("raw", callback=lambda _ctx, _param, value: _input_path(value))
@click.argument("out", type=click.Path(path_type=str))
@click.option(
    "--shards", "-n", type=click.IntRange(min=1), required=True, help="Number of shards to write."
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Seed of every random choice.",
)
@click.option(
    "--workers",
    "-j",
    type=click.IntRange(min=1),
    default=None,
    help="Writer processes [default: CPU count].",
)
@click.option(
    "--engine",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="Where scan and write tasks run: this machine's processes, or a Ray cluster "
    '(pip install "shardprep[ray]").',
)
@click.option(
    "--ray-address",
    default=None,
    help="Ray cluster to join with --engine ray [default: $RAY_ADDRESS, else a local instance].",
)
@click.option(
    "--stall-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=1800.0,
    show_default=True,
    help="Seconds without any written sample (worker processes or Ray tasks) before the build "
    "stops with an error instead of waiting on a hung read.",
)
@click.option(
    "--compress",
    "compression",
    type=click.Choice(["none", "zstd"]),
    default="none",
    show_default=True,
    help="Write .tar.zst shards of independent, seekable zstd frames.",
)
@click.option(
    "--zstd-level",
    type=click.IntRange(1, 22),
    default=3,
    show_default=True,
    help="zstd compression level.",
)
@click.option(
    "--format",
    "input_format",
    type=click.Choice(["auto", "class-folders", "keyed", "listing", "parquet", "tar"]),
    default="auto",
    show_default=True,
    help="Input layout; auto-detected by default.",
)
@click.option(
    "--path-column", default="path", show_default=True, help="Listing column with the file path."
)
@click.option(
    "--label-column",
    default=None,
    help="Listing or Parquet column with the label [default: 'label' if present].",
)
@click.option(
    "--key-column",
    default=None,
    help="Parquet column with each row's key [default: 'key' or '__key__' if present, "
    "else <file>-<row number>].",
)
@click.option(
    "--class-weights",
    default=None,
    help="Resample classes: 'balanced', 'sqrt', a JSON file, or 'cat=2,dog=1'.",
)
@click.option(
    "--num-samples",
    type=click.IntRange(min=1),
    default=None,
    help="Total samples after resampling [default: as many as the input].",
)
@click.option("--keep-all", is_flag=True, help="Resample without dropping any original sample.")
@click.option(
    "--weights-only",
    is_flag=True,
    help="Keep the data as is; write each sample's weight as <key>.weight.",
)
@click.option(
    "--allow-zero-weights",
    is_flag=True,
    help="Give classes not named in an inline --class-weights weight 0.",
)
@click.option(
    "--map",
    "map",
    default=None,
    metavar="MODULE:FUNCTION",
    help="Transform every sample while writing: FUNCTION(sample dict) -> sample dict, imported "
    "from MODULE (the current folder is on the path); it must keep __key__ and cls.",
)
@click.option("--overwrite", is_flag=True, help="Replace a previous build in OUT.")
@click.option(
    "--resume", is_flag=True, help="Finish an interrupted build in OUT, reusing finished shards."
)
@click.option(
    "--append",
    is_flag=True,
    help="Add RAW's samples to the build in OUT as N new shards: its next version "
    "(docs/pipelines.md, Appending).",
)
@click.option(
    "--storage-option",
    "storage_options",
    multiple=True,
    callback=lambda _ctx, param, values: _storage_options(values, param),
    metavar="KEY=VALUE",
    help="fsspec storage option for a URL RAW, listed URLs and a URL OUT alike (repeatable); "
    'VALUE is JSON if it parses, else a string: \'client_kwargs={"endpoint_url": '
    '"http://host:9000"}\'. With --engine ray the options are sent to the tasks.',
)
@click.option(
    "--raw-storage-option",
    "raw_storage_options",
    multiple=True,
    callback=lambda _ctx, param, values: _storage_options(values, param),
    metavar="KEY=VALUE",
    help="Like --storage-option, for the input only (on top of --storage-option).",
)
@click.option(
    "--out-storage-option",
    "out_storage_options",
    multiple=True,
    callback=lambda _ctx, param, values: _storage_options(values, param),
    metavar="KEY=VALUE",
    help="Like --storage-option, for OUT only (on top of --storage-option).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bars and no summary.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the summary as JSON (implies no progress bars)."
)
def build(raw: str, out: str, quiet: bool, as_json: bool, **options: Any) -> None:
    """Turn the dataset at RAW into exactly N balanced shards in OUT.

    RAW is a folder of class folders, a folder of files grouped by key, a
    CSV/TSV/JSONL listing (whose paths may be URLs such as s3://bucket/a.jpg),
    a folder of existing .tar shards, or Parquet files (a .parquet file or a folder
    of them). Any of these folders may be an fsspec URL prefix instead
    (s3://bucket/train, gs://..., ...). OUT is a folder or an fsspec URL.
    """
    progress = not (quiet or as_json)
    # (a Ctrl-C can land as the build begins or returns, outside its own handling: the advice
    # then comes from what OUT holds, and whether it held a complete output before)
    was_complete = _run(lambda: _import_and_look(out), progress, lambda: _BEFORE_ANY_SHARD)
    from shardprep.builder import build as run_build
    from shardprep.builder import interrupted_around
    from shardprep.format.interface import CLI

    def run_to_the_end() -> Any:
        summary = run_build(raw, out, progress=progress, interface=CLI, **options)
        # The build is complete and the process about to exit: a Ctrl-C from now on would only
        # turn exit 0 into a silent death by SIGINT (or "interrupted" and 130).
        _ignore_interrupts()
        return summary

    with _stdout_to_stderr(as_json):  # --json: the summary alone on stdout
        summary = _run(
            run_to_the_end,
            progress,
            lambda: interrupted_around(
                out,
                was_complete,
                bool(options["overwrite"]),
                options["shards"],
                options["compression"],
                bool(options["append"]),
            ),
        )
    if summary.already_complete:  # --resume of a finished build: exit 0, as a pipeline wants
        what = f"append (version {summary.version})" if summary.first_shard else "build"
        click.echo(f"{out}: the {what} is already complete; nothing to resume", err=True)
    if as_json:
        click.echo(json.dumps(summary.to_dict(), indent=1))
    elif not quiet:
        click.echo(_format_summary(summary.to_dict()))


_BEFORE_ANY_SHARD = "interrupted before any shard was written: run the same command again"


def _import_and_look(out: str) -> bool:
    """Import the builder (a Ctrl-C while it loads is the build's "before any shard" case)
    and tell whether OUT holds a complete output now."""
    from shardprep.builder import is_complete_output

    return is_complete_output(out)


def _ignore_interrupts() -> None:
    """From now on ignore SIGINT, where the CLI owns the process (see :class:`_OwnProcess`):
    it is about to print its last message and exit."""
    context = click.get_current_context(silent=True)
    if context is not None and isinstance(context.obj, _OwnProcess):
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _input_path(value: str) -> str:
    """RAW: an existing path, or a URL (a prefix or an object, read through fsspec)."""
    if is_url(value) or os.path.exists(value):
        return value
    raise click.BadParameter(f"Path {value!r} does not exist.")


def _storage_options(
    values: tuple[str, ...], param: click.Parameter | None = None
) -> dict[str, Any] | None:
    """``KEY=VALUE`` pairs as a dict; a VALUE that parses as JSON is that JSON value."""
    options: dict[str, Any] = {}
    for item in values:
        key, equals, value = item.partition("=")
        if not (equals and key.strip()):
            name = param.name if param is not None and param.name else "storage_options"
            hint = "--" + name.replace("_", "-")[: -len("s")]
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint=hint)
        try:
            options[key.strip()] = json.loads(value)
        except ValueError:
            options[key.strip()] = value
    return options or None


def _format_summary(s: dict[str, Any]) -> str:
    how = "auto-detected" if s["layout_detected"] else "--format"
    return "\n".join(
        [
            (
                f"already complete: {s['num_shards']} shards in {s['out']}"
                if s["already_complete"]
                else f"wrote {s['num_shards']} shards to {s['out']}"
            )
            + (
                f" (version {s['version']}: shards {s['first_shard']}-"
                f"{s['first_shard'] + s['num_shards'] - 1})"
                if s["version"] > 1
                else ""
            ),
            f"  input     {s['layout']} ({how})",
            f"  samples   {s['num_samples']} ({s['min_shard_samples']}-{s['max_shard_samples']} per shard), "
            f"{s['num_classes']} classes",
            f"  bytes     {s['num_bytes']:,} on disk, {s['tar_bytes']:,} as tar; "
            f"max/min shard bytes {s['shard_bytes_ratio']:.4f}",
            f"  time      {s['elapsed_s']:.2f} s, {s['files_per_s']:,.0f} files/s, {s['mb_per_s']:,.1f} MB/s"
            + (f", {s['reused_shards']} shards reused" if s["reused_shards"] else ""),
        ]
    )


def _output_path(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """OUT of inspect/verify: an existing folder, or a URL (read through fsspec)."""
    if is_url(value):
        return value
    folder = click.Path(exists=True, file_okay=False, path_type=str)
    converted: str = folder.convert(value, param, ctx)
    return converted


_READ_STORAGE_OPTION = click.option(
    "--storage-option",
    "storage_options",
    multiple=True,
    callback=lambda _ctx, _param, values: _storage_options(values),
    metavar="KEY=VALUE",
    help="fsspec storage option for a URL OUT (repeatable), as for build.",
)


@cli.command()
@click.argument("out", callback=_output_path)
@click.option("--json", "as_json", is_flag=True, help="Print the manifest summary as JSON.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="Draw per-shard class histograms to a PNG (needs matplotlib).",
)
@_READ_STORAGE_OPTION
def inspect(
    out: str, as_json: bool, plot: str | None, storage_options: dict[str, Any] | None
) -> None:
    """Show the summary and a per-shard table of a built OUT (a folder or a URL)."""
    from shardprep.inspect import format_inspection, inspection, plot_histograms

    data = _run(lambda: inspection(out, storage_options))
    if plot:
        _run(lambda: plot_histograms(out, plot, storage_options))
    click.echo(json.dumps(data, indent=1) if as_json else format_inspection(data))


@cli.command()
@click.argument("out", callback=_output_path)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@_READ_STORAGE_OPTION
def verify(out: str, quiet: bool, storage_options: dict[str, Any] | None) -> None:
    """Re-read every shard: checksums, counts, index offsets, complete samples.

    OUT is a folder or a URL (its shards are read with ranged parallel reads).
    """
    from shardprep.verify import verify_output

    report = _run(lambda: verify_output(out, progress=not quiet, storage_options=storage_options))
    for line in report.problems:
        click.echo(line, err=True)
    if report.problems:
        raise click.ClickException(f"{len(report.problems)} problem(s) in {out}")
    versions = f" (version {report.version}; its earlier versions checked too)"
    click.echo(
        f"ok: {report.num_shards} shards, {report.num_samples} samples verified"
        + (versions if report.version > 1 else "")
    )


@cli.command()
@click.argument("raw", type=click.Path(path_type=str))
@click.option("--samples", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--classes", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
def example(raw: str, samples: int, classes: int, seed: int) -> None:
    """Write a small imbalanced class-folder dataset to RAW to try shardprep on."""
    from shardprep.example import write_example

    counts = _run(lambda: write_example(raw, samples, classes, seed))
    click.echo(f"wrote {sum(counts)} samples in {len(counts)} class folders to {raw}: {counts}")


def _workers_option(_ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    from shardprep.cli_bench import default_workers, parse_workers

    if value is None:
        return default_workers()
    try:
        return parse_workers(value)
    except ValueError as err:
        raise click.BadParameter(str(err), param=param) from err


@cli.command("bench")
@click.argument("out", callback=_output_path)
@click.option(
    "--workers",
    callback=_workers_option,
    metavar="N,N,...",
    help="DataLoader worker counts to try, comma-separated  [default: 0 and the CPU count]",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--epochs", type=click.IntRange(min=1), default=2, show_default=True, help="Per worker count."
)
@click.option(
    "--decode", is_flag=True, help="Decode members (images, .cls, .npy) as training would."
)
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=str),
    default=None,
    help="A URL OUT: cache whole shards here (RemoteOptions.cache_dir).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON (a list).")
@_READ_STORAGE_OPTION
def bench_command(
    out: str,
    workers: tuple[int, ...],
    batch_size: int,
    epochs: int,
    decode: bool,
    cache_dir: str | None,
    as_json: bool,
    storage_options: dict[str, Any] | None,
) -> None:
    """Read OUT as training would, per worker count: speed and where the time goes.

    Prints per worker count samples/s, MB/s (shard bytes), the time to the first batch, the
    seconds per epoch of each stage (added over workers), for a URL the requests, bytes and
    cache hit rate per epoch, and which worker count to use. Progress goes to stderr.
    """
    from shardprep.cli_bench import BenchOptions, bench, format_results, pick

    if cache_dir is not None and not is_url(out):
        raise click.BadParameter(
            "only for a URL OUT (a local output is read in place)", param_hint="--cache-dir"
        )
    options = BenchOptions(
        workers=workers,
        batch_size=batch_size,
        epochs=epochs,
        decode=decode,
        cache_dir=cache_dir,
        storage_options=storage_options or {},
    )
    results = _run(lambda: bench(out, options, lambda line: click.echo(line, err=True)))
    if as_json:
        chosen, why = pick(results)
        for r in results:
            r["picked"] = r["workers"] == chosen
        click.echo(json.dumps(results, indent=1))
        click.echo(f"pick: {chosen} workers: {why}", err=True)
    else:
        click.echo(format_results(results))


class _OwnProcess:
    """click context object that :func:`main` sets: the CLI owns the process and exits after
    the command, so a command may change process-wide state such as signal handlers (not under
    ``CliRunner`` or another in-process caller)."""


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (``shardprep``, ``python -m shardprep``); exits the process."""
    cli.main(
        args=argv if argv is not None else sys.argv[1:], prog_name="shardprep", obj=_OwnProcess()
    )


@contextlib.contextmanager
def _stdout_to_stderr(active: bool) -> Iterator[None]:
    """While active, file descriptor 1 (this process's and its children's) writes to stderr.

    With ``--json`` a script reads the summary from stdout; what Ray (its raylet's notices
    of a dead node) or a library prints there during the build must not come before it.
    """
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
