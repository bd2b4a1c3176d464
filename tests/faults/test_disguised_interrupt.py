"""A Ctrl-C that CPython reports as a SystemError, or as ``Thread.start``'s RuntimeError, is still
a Ctrl-C (both seen in CI).

When SIGINT's handler raises KeyboardInterrupt inside Python code that a C function
calls back (``os.fspath``'s ``isinstance`` check under ``numpy.fromfile``), CPython
reports ``SystemError: <built-in function fspath> returned a result with an exception
set`` with the KeyboardInterrupt as its ``__cause__``. When it lands in ``Thread.start``'s
wait (a thread pool's first task), CPython reports ``RuntimeError: release unlocked lock`` with
the KeyboardInterrupt as its ``__context__``. The build must treat either as the Ctrl-C it is:
the advice for its stage, exit 130, no traceback, scratch removed. A SystemError or
RuntimeError without a KeyboardInterrupt behind it is a bug and must stay visible.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from shardprep.format.errors import is_interrupt
from shardprep.spill import InventoryStore
from tests.faults.helpers import class_folders, invoke, tree_hashes


def _disguised() -> SystemError:
    """What CPython raises: the SystemError, the KeyboardInterrupt its direct cause."""
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as interrupt:
            raise SystemError(
                "<built-in function fspath> returned a result with an exception set"
            ) from interrupt
    except SystemError as err:
        return err


def _cut_thread_start() -> RuntimeError:
    """What ``Thread.start`` raises when the interrupt cut its wait: the interrupt its context."""
    try:
        try:
            raise KeyboardInterrupt
        finally:
            raise RuntimeError("release unlocked lock")
    except RuntimeError as err:
        return err


def test_is_interrupt_sees_through_a_cut_thread_start_only() -> None:
    assert is_interrupt(_cut_thread_start())
    assert not is_interrupt(RuntimeError("release unlocked lock"))  # no interrupt behind it
    other = RuntimeError("another error")
    other.__context__ = KeyboardInterrupt()
    assert not is_interrupt(other)


def test_is_interrupt_sees_through_system_errors_only() -> None:
    assert is_interrupt(KeyboardInterrupt())
    assert is_interrupt(_disguised())
    outer = SystemError("outer")
    outer.__cause__ = _disguised()
    assert is_interrupt(outer)
    assert not is_interrupt(SystemError("a bug"))
    assert not is_interrupt(ValueError("x"))
    wrapped = ValueError("not a SystemError")  # only SystemError hides a Ctrl-C
    wrapped.__cause__ = KeyboardInterrupt()
    assert not is_interrupt(wrapped)
    looped = SystemError("loop")
    looped.__context__ = looped
    assert not is_interrupt(looped)


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    return class_folders(tmp_path / "raw", seed=3)


def _raise(err: BaseException):  # type: ignore[no-untyped-def]
    def fail(*_args: object, **_kwargs: object) -> None:
        raise err

    return fail


def test_after_the_last_shard_it_says_complete_and_exits_130(
    raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = tmp_path / "clean"
    assert invoke("build", str(raw), str(clean), "--shards", "4", "-j", "1").exit_code == 0
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    # the summary reads the scratch inventory with numpy.fromfile, where CI saw it happen
    monkeypatch.setattr(InventoryStore, "source_bytes", _raise(_disguised()))
    out = tmp_path / "out"
    result = invoke("build", str(raw), str(out), "--shards", "4", "-j", "1")
    assert result.exit_code == 130, result.output
    assert (
        result.stderr.splitlines()[-1] == f"interrupted after the build finished: {out} is complete"
    )
    assert tree_hashes(out) == tree_hashes(clean)
    assert os.listdir(scratch) == []


@pytest.mark.parametrize("disguise", [_disguised, _cut_thread_start])
def test_in_the_scan_it_says_run_again_and_exits_130(
    raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disguise: Callable[[], Exception]
) -> None:
    monkeypatch.setattr(InventoryStore, "freeze", _raise(disguise()))
    out = tmp_path / "out"
    result = invoke("build", str(raw), str(out), "--shards", "4", "-j", "1")
    assert result.exit_code == 130, result.output
    assert result.stderr.splitlines()[-1] == (
        "interrupted before any shard was written: run the same command again"
    )
    assert "Traceback" not in result.stderr
    assert not out.exists() or os.listdir(out) == []


@pytest.mark.parametrize(
    ("method", "error"),
    [
        ("source_bytes", SystemError("a real bug")),
        ("freeze", RuntimeError("release unlocked lock")),  # no interrupt behind it
    ],
)
def test_an_error_that_is_no_interrupt_is_not_hidden(
    raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str, error: Exception
) -> None:
    monkeypatch.setattr(InventoryStore, method, _raise(error))
    from click.testing import CliRunner

    from shardprep.cli import cli

    result = CliRunner().invoke(cli, ["build", str(raw), str(tmp_path / "out"), "--shards", "4"])
    assert type(result.exception) is type(error), result.output
    assert str(result.exception) == str(error)


# numpy's own code that a Ctrl-C can land in while it reads or writes an open file
_NUMPY_CHECKS = ("<frozen abc>", "<frozen os>", "<frozen _collections_abc>")


def test_numpy_file_io_keeps_a_ctrl_c(tmp_path: Path) -> None:
    """np.save and np.load of an open file, a SIGINT at each moment of their path check: the
    interrupt, never numpy's ``TypeError: expected str, bytes or os.PathLike object`` (a fault
    hunt saw it: the Ctrl-C gone, a traceback, exit 1). Checked to fail with plain np.load."""
    import signal
    import sys

    import numpy as np

    from shardprep.plan_store import _load, _save
    from tests.interrupts import interrupt_at

    path = tmp_path / "piece.npy"
    values = np.arange(1000, dtype=np.int64)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for step in ("save", "load"):
            n, cut = 1, 0
            while True:
                mode = "wb" if step == "save" else "rb"
                with open(path, mode) as f:
                    sys.settrace(interrupt_at(n, ("call", "line", "return"), _NUMPY_CHECKS, True))
                    try:
                        if step == "save":
                            _save(f, values)
                        else:
                            assert (_load(f) == values).all()
                        break
                    except KeyboardInterrupt:
                        cut += 1
                    finally:
                        sys.settrace(None)
                n += 1
            assert cut >= 3, (step, cut)  # each moment of the check was cut, the call done
            with open(path, "rb") as f:  # the interrupt came after the whole call
                assert (np.load(f) == values).all()
    finally:
        signal.signal(signal.SIGINT, previous)
