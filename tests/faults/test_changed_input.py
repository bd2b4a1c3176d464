"""Issue 9 item 11: a source that changes during the build gets advice that works."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

import shardprep
from shardprep.format.errors import InputError, WriteError
from tests.conftest import write_class_folders
from tests.faults.helpers import tree_hashes

BUILD = importlib.import_module("shardprep.builder")


def _grow_after_the_scan(monkeypatch: pytest.MonkeyPatch, path: Path) -> bytes:
    """Append to ``path`` once the scan is done (when the plan is made); returns the original."""
    original = path.read_bytes()
    plan = BUILD.plan_to_files

    def plan_then_grow(*args: Any, **kwargs: Any) -> Any:
        with open(path, "ab") as f:
            f.write(b"grown")
        return plan(*args, **kwargs)

    monkeypatch.setattr(BUILD, "plan_to_files", plan_then_grow)
    return original


@pytest.mark.parametrize("workers", [1, 2])
def test_a_file_that_grew_gets_advice_that_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    raw = write_class_folders(tmp_path / "raw", {"a": 12, "b": 8})
    grown = raw / "a" / "00003.bin"
    original = _grow_after_the_scan(monkeypatch, grown)
    out = tmp_path / "out"
    with pytest.raises(WriteError) as info:
        shardprep.build(str(raw), str(out), shards=3, workers=workers, progress=False)
    message = str(info.value)
    size = len(original)
    assert f": {grown} changed size ({size} -> {size + 5} bytes) since the scan, and the " in (
        message
    )
    assert message.endswith(  # shardprep.build: its keywords (was: the CLI's flags)
        "so resume=True would refuse this input: put the file back as it was and call "
        "shardprep.build again with the same arguments and resume=True, or rebuild from the "
        "current input with overwrite=True"
    ), message
    monkeypatch.undo()
    # the advice holds: --resume refuses the changed input ...
    with pytest.raises(InputError, match="used other input or options"):
        shardprep.build(str(raw), str(out), shards=3, workers=1, resume=True, progress=False)
    # ... --overwrite builds from it ...
    shardprep.build(str(raw), str(out), shards=3, workers=1, overwrite=True, progress=False)
    # ... and with the file put back, --resume finishes the interrupted build byte-identically
    again = tmp_path / "again"
    _grow_after_the_scan(monkeypatch, grown)
    grown.write_bytes(original)
    with pytest.raises(WriteError):
        shardprep.build(str(raw), str(again), shards=3, workers=workers, progress=False)
    monkeypatch.undo()
    grown.write_bytes(original)
    shardprep.build(str(raw), str(again), shards=3, workers=1, resume=True, progress=False)
    clean = tmp_path / "clean"
    shardprep.build(str(raw), str(clean), shards=3, workers=1, progress=False)
    assert tree_hashes(again) == tree_hashes(clean)
