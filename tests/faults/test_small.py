"""Issue 9 item 12: messages for folders that are not builds, exit codes, the scan bar."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.conftest import write_class_folders
from tests.faults.helpers import error_lines, invoke, write


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_folder_that_never_was_a_build_says_so(tmp_path: Path, command: str) -> None:
    folder = write_class_folders(tmp_path / "raw", {"a": 2})
    result = invoke(command, str(folder))
    assert result.exit_code == 1
    assert error_lines(result) == [
        f"Error: {folder / 'manifest.json'}: no manifest; {folder} is not the output of "
        "shardprep build (it holds no shards)"
    ]


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_an_unfinished_build_says_resume(tmp_path: Path, command: str) -> None:
    out = tmp_path / "out"
    write(out / ".shardprep-build.json", json.dumps({"input_fingerprint": "x", "options": {}}))
    result = invoke(command, str(out))
    assert result.exit_code == 1
    assert error_lines(result) == [
        f"Error: {out / 'manifest.json'}: no manifest; the build did not finish (run the same "
        "shardprep build command with --resume)"
    ]


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (["build", "{missing}", "{out}", "-n", "2"], "RAW"),
        (["inspect", "{missing}"], "OUT"),
        (["verify", "{missing}"], "OUT"),
    ],
)
def test_a_missing_path_is_a_usage_error_everywhere(
    tmp_path: Path, args: list[str], name: str
) -> None:
    missing = tmp_path / "missing"
    argv = [a.format(missing=missing, out=tmp_path / "out") for a in args]
    result = invoke(*argv)
    assert result.exit_code == 2
    assert "does not exist" in result.stderr
    assert f"Invalid value for '{name}'" in result.stderr


def test_the_scan_bar_shows_the_real_count_and_errors_start_a_line(tmp_path: Path) -> None:
    raw = write_class_folders(tmp_path / "raw", {"a": 7, "b": 5})
    result = invoke("build", str(raw), str(tmp_path / "out"), "-n", "2", "-j", "1")
    assert result.exit_code == 0
    last_scan = result.stderr.split("\n")[0].split("\r")[-1]
    assert last_scan.startswith("scan class-folders: 12 samples ")
    (raw / "c").mkdir()  # an empty class folder: an error after the scan bar was drawn
    result = invoke("build", str(raw), str(tmp_path / "out2"), "-n", "2", "-j", "1")
    assert result.exit_code == 1
    assert "\nError: 1 input problem(s), nothing was written:\n" in result.stderr


def test_an_in_process_build_leaves_ctrl_c_alone(tmp_path: Path) -> None:
    """Only the real process entry point ignores Ctrl-C after a build (CliRunner must not)."""
    raw = write_class_folders(tmp_path / "raw", {"a": 3})
    # pytest may have started with SIGINT ignored (a background job): start from Python's handler
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert invoke("build", str(raw), str(tmp_path / "out"), "-n", "1", "-q").exit_code == 0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
