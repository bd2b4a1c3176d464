"""Ctrl-C where CPython would garble it or lose it (shardprep/format/interrupts.py).

- A build's scratch folder is removed by ``shutil.rmtree``; a SIGINT at each moment of that
  removal, one run per moment, must give the interrupt after a complete removal, never
  CPython 3.11's ``OSError: [Errno 9] Bad file descriptor`` (seen in CI: a Ctrl-C, a traceback
  and exit 1).
- A KeyboardInterrupt that CPython drops (raised in a weakref callback: it prints
  ``Exception ignored in`` and goes on) is delivered again, in ordinary code, in the CLI's
  process; seen in CI: a Ctrl-C in the write phase, a traceback, and the build ran to its end.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shardprep.format.sigint import deferred
from shardprep.scratch import OwnedFolder
from tests.faults.helpers import class_folders
from tests.interrupts import interrupt_at

CHILD_DEADLINE_S = 60.0


@pytest.fixture(autouse=True)
def default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler, as a program has (pytest-xdist's workers may change it)."""
    assert threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _tree(root: Path) -> None:
    """Nested folders (rmtree opens and closes a descriptor per folder)."""
    for a in range(3):
        for b in range(2):
            folder = root / f"a{a}" / f"b{b}"
            folder.mkdir(parents=True)
            (folder / "column.bin").write_bytes(bytes(100))
        (root / f"a{a}" / "plan.bin").write_bytes(bytes(10))


def _cut_each(
    remove: Callable[[], None], made: Callable[[], Path], gone: bool = True
) -> tuple[int, list[str]]:
    """Run ``remove`` with a SIGINT at its 1st, 2nd, ... moment inside shutil; (runs cut, other
    errors). ``gone``: after each run the folder must be gone."""
    n, cut, other = 1, 0, []
    while True:
        folder = made()
        sys.settrace(interrupt_at(n, ("call", "line", "return"), ("/shutil.py",), by_signal=True))
        try:
            remove()
            done = True
        except KeyboardInterrupt:
            done, cut = False, cut + 1
        except OSError as err:  # recorded: the test fails naming it
            done = False
            other.append(f"moment {n}: errno {err.errno}: {err!r}")
        finally:
            sys.settrace(None)
        assert not gone or not folder.exists(), f"moment {n}: {sorted(folder.rglob('*'))}"
        if done:
            return cut, other
        n += 1


def test_a_ctrl_c_while_the_scratch_folder_goes_comes_after_it_is_gone() -> None:
    folders: list[OwnedFolder] = []

    def made() -> Path:
        folders.append(OwnedFolder("shardprep-build-"))
        _tree(Path(folders[-1].path))
        return Path(folders[-1].path)

    cut, other = _cut_each(lambda: folders[-1].close(), made)
    assert other == []
    assert cut > 50, cut  # every moment of the removal was tried, each one cut it
    for folder in folders:  # the lock descriptor was closed once, in each run
        assert folder._fd == -1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="CPython 3.11's rmtree")
def test_without_the_deferral_a_ctrl_c_in_rmtree_closes_a_descriptor_twice(tmp_path: Path) -> None:
    """The hazard the deferral removes, on the Python that CI runs: this test shows that the
    cuts above reach it."""
    import shutil

    runs = iter(range(10_000))

    def made() -> Path:
        root = tmp_path / f"run{next(runs)}"
        _tree(root)
        return root

    last: list[Path] = []

    def make_and_keep() -> Path:
        last.append(made())
        return last[-1]

    _cut, other = _cut_each(
        lambda: shutil.rmtree(last[-1], ignore_errors=True), make_and_keep, gone=False
    )
    assert [o for o in other if f"errno {errno.EBADF}:" in o], other


def test_deferred_raises_after_the_block_and_keeps_a_handler_it_did_not_set() -> None:
    with pytest.raises(KeyboardInterrupt), deferred() as pressed:
        assert pressed is not None
        signal.raise_signal(signal.SIGINT)
        assert pressed.is_set()  # recorded, not raised: the block goes on
    with deferred() as pressed:  # the block polled and cleared it: nothing is raised
        assert pressed is not None
        signal.raise_signal(signal.SIGINT)
        pressed.clear()
    calls: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: calls.append(signum))
    with deferred() as pressed:  # a program's own handler is kept
        assert pressed is None
        signal.raise_signal(signal.SIGINT)
    assert calls == [signal.SIGINT]


def _child(code: str, tmp_path: Path, module: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh Python (``module``: as ``python -m child``, as ``python -m
    shardprep`` runs)."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    return subprocess.run(
        [sys.executable, *(["-m", "child"] if module else [str(script)])],
        capture_output=True,
        text=True,
        timeout=CHILD_DEADLINE_S,
        env=env,
        check=False,
    )


DROPPED = """
    import signal, weakref

    def dropped():
        class Thing:
            pass

        thing = Thing()
        # a Ctrl-C landing in a weakref callback: CPython prints it and drops it
        ref = weakref.ref(thing, lambda _ref: signal.raise_signal(signal.SIGINT))
        del thing
        return ref
"""


@pytest.mark.parametrize("redeliver", [True, False])
def test_a_ctrl_c_dropped_in_a_callback_is_raised_again(tmp_path: Path, redeliver: bool) -> None:
    done = _child(
        DROPPED
        + f"""
    from shardprep.format.interrupts import redeliver_dropped
    if {redeliver}:
        redeliver_dropped()
    import threading
    try:
        dropped()
        # ordinary code: it waits for the interrupt, at most a bound (CPython drops it: no wait)
        threading.Event().wait({CHILD_DEADLINE_S / 2 if redeliver else 0.1})
        print("went on")
    except KeyboardInterrupt:
        print("interrupted")
    """,
        tmp_path,
    )
    if redeliver:
        assert (done.stdout, done.stderr, done.returncode) == ("interrupted\n", "", 0)
    else:  # what CPython does by itself
        assert done.stdout == "went on\n"
        assert "Exception ignored in" in done.stderr and "KeyboardInterrupt" in done.stderr


def test_the_cli_stops_a_build_at_a_ctrl_c_dropped_in_a_callback(tmp_path: Path) -> None:
    raw = class_folders(tmp_path / "raw", seed=3)
    out = tmp_path / "out"
    done = _child(
        DROPPED
        + f"""
    import shardprep.builder
    from shardprep.cli import main

    sweep = shardprep.builder.sweep_stale

    def sweep_and_drop(*args, **kwargs):  # as the build starts
        dropped()
        return sweep(*args, **kwargs)

    shardprep.builder.sweep_stale = sweep_and_drop
    main(["build", {str(raw)!r}, {str(out)!r}, "--shards", "2", "--quiet"])
    """,
        tmp_path,
    )
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == "interrupted before any shard was written: run the same command again"
    assert not out.exists() or [p.name for p in out.iterdir()] == []


def _signal_in_the_making(n: int) -> Any:
    """SIGINT at the n-th moment inside tempfile or OwnedFolder's constructor, up to (not at) the
    constructor's return: after it, the folder is the caller's to register for removal (the
    builder does both under one deferral)."""
    seen = [0]

    def trace(frame: Any, event: str, arg: Any) -> Any:
        name = frame.f_code.co_filename
        inside = name.endswith("/tempfile.py") or (
            name.endswith("/scratch.py") and frame.f_code.co_name == "__init__"
        )
        if inside and event in ("call", "line", "return"):
            if event == "return" and frame.f_code.co_name == "__init__":
                return trace
            seen[0] += 1
            if seen[0] == n:
                sys.settrace(None)
                signal.raise_signal(signal.SIGINT)
        return trace

    return trace


def test_a_ctrl_c_while_the_scratch_folder_is_made_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGINT at each moment of making a scratch folder (tempfile's and ours): either the
    folder is made, locked and kept, or the interrupt comes and nothing is left. One landing in
    mkdtemp after it made the folder left an empty folder without a lock file, which no sweep
    removes (a fault hunt: once in 300 signals)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    n, cut = 1, 0
    while True:
        sys.settrace(_signal_in_the_making(n))
        try:
            folder = OwnedFolder("shardprep-build-")
        except KeyboardInterrupt:
            cut += 1
            assert list(tmp_path.iterdir()) == [], f"moment {n}"
            n += 1
            continue
        finally:
            sys.settrace(None)
        assert [p.name for p in Path(folder.path).iterdir()] == ["shardprep.lock"]
        folder.close()
        break
    assert cut > 20, cut
    assert list(tmp_path.iterdir()) == []


def test_the_exit_after_a_ctrl_c_is_quiet(tmp_path: Path) -> None:
    """After the advice, the CLI exits 130 without asyncio's report of the requests that the
    Ctrl-C abandoned (seen after a URL build's advice: aiohttp's "Cannot write to closing
    transport", never retrieved), also under ``python -m`` where CPython would die by SIGINT."""
    done = _child(
        """
    import asyncio
    from shardprep.cli import _exit_130

    loop = asyncio.new_event_loop()

    async def abandoned():
        raise ConnectionResetError("Cannot write to closing transport")

    task = loop.create_task(abandoned())
    loop.run_until_complete(asyncio.sleep(0.01))
    try:
        exec("raise KeyboardInterrupt")  # as a Ctrl-C landing in a dataclass's exec
    except KeyboardInterrupt:
        _exit_130()
    """,
        tmp_path,
        module=True,
    )
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "")
