"""loader.io.files: a shard file whose own closing an interrupt cut is closed by its owner.

A ``ShardFile`` collected unclosed closes its file in a ``weakref.finalize``. A Ctrl-C that
lands at the first line of that finalizer's call is reported and dropped by CPython, and the
finalizer's registry keeps the file open (a rare leak seen by
tests/faults/test_hunt_scatter.py::test_ctrl_c_at_random_moments, "OPEN 1"). The owners
(``ShardFiles``, the local read-ahead's ``LocalFetch``) close such files when they close.
The interrupt here is a real SIGINT raised at that line by a trace function (Python's own
handler raises the KeyboardInterrupt there, as for a Ctrl-C).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from loader.io.files import OPEN_FILES, ShardFiles
from loader.io.readahead import LocalFetch
from loader.io.source import Source


def _open_on(path: str) -> int:
    """How many of this process's descriptors are open on ``path``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == path
        except OSError:  # the descriptor of the listing itself, closed by now
            continue
    return count


def _sigint_in_finalizer() -> Callable[[FrameType, str, Any], Any]:
    """A trace function that sends SIGINT as the first ``weakref.finalize`` call starts."""

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if (
            event == "call"
            and frame.f_code.co_name == "__call__"
            and frame.f_code.co_filename.endswith("weakref.py")
        ):
            sys.settrace(None)
            signal.raise_signal(signal.SIGINT)
        return trace

    return trace


@pytest.fixture
def dropped() -> Iterator[list[BaseException]]:
    """The exceptions CPython reports and drops (``sys.unraisablehook``) meanwhile."""
    seen: list[BaseException] = []
    previous = sys.unraisablehook
    sys.unraisablehook = lambda info: seen.append(info.exc_value)  # type: ignore[arg-type]
    yield seen
    sys.unraisablehook = previous


def _collect_with_a_cut_close(drop: Callable[[], None]) -> None:
    """Run ``drop`` (which lets the last reference to a ShardFile go) with a SIGINT landing
    as its finalizer starts."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    sys.settrace(_sigint_in_finalizer())
    try:
        drop()
        gc.collect()
    finally:
        sys.settrace(None)


def test_a_reader_closes_a_file_whose_closing_was_cut(
    built_zstd: Path, dropped: list[BaseException]
) -> None:
    source = Source(str(built_zstd))  # (10 shards: more than the reader keeps open)
    manifest = source.manifest()
    files = ShardFiles(source, manifest, None)
    path = source.path(manifest.shards[0].file)
    held = [files.get(0)]
    assert held[0] is not None and _open_on(path) == 1
    for shard in range(1, OPEN_FILES + 1):  # shard 0 leaves the files kept open
        assert files.get(shard) is not None

    _collect_with_a_cut_close(held.clear)  # the last reference to shard 0's file goes

    assert [type(e) for e in dropped] == [KeyboardInterrupt]  # the cut: reported, dropped
    assert _open_on(path) == 1  # the finalizer's registry holds it open
    files.close()
    assert _open_on(path) == 0


def test_a_local_read_ahead_closes_a_file_whose_closing_was_cut(
    built: Path, dropped: list[BaseException]
) -> None:
    source = Source(str(built))
    manifest = source.manifest()
    fetch = LocalFetch(source, manifest)
    path = source.path(manifest.shards[0].file)
    assert len(fetch.part(0, 0, 512)) == 512 and _open_on(path) == 1
    second: list[Any] = []
    # reading shard 1 lets shard 0 go (one shard kept open): its file is collected there
    _collect_with_a_cut_close(lambda: second.append(fetch.part(1, 0, 512)))
    assert len(second[0]) == 512

    assert [type(e) for e in dropped] == [KeyboardInterrupt]
    assert _open_on(path) == 1
    fetch.close()
    assert _open_on(path) == 0
