"""A script that takes a few batches of a remote output and exits, leaving the epoch open.

Peeking at one batch and ending the script is the usual first use. The epoch's generator is
then closed by the interpreter's shutdown, after module globals are gone: closing the
read-ahead must neither print "Exception ignored" nor wait for its threads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.processes import run_bounded
from tests.s3 import S3Server

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
import torch
import loader
from loader import ReadOptions, RemoteOptions

url, options, batch_size = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]) or None
cache = sys.argv[4] or None
read = ReadOptions(remote=RemoteOptions(storage_options=options, cache_dir=cache))
ds = loader.ShardDataset(url, batch_size=batch_size, read=read)
it = iter(torch.utils.data.DataLoader(ds, batch_size=None))
first = next(it)
keys = first["__key__"] if batch_size else [first["__key__"]]
print(json.dumps({"keys": len(keys)}), flush=True)
"""


@pytest.mark.parametrize(
    ("form", "batch_size", "cached"),
    [("tar", 4, False), ("tar", 0, False), ("zstd", 4, False), ("tar", 4, True)],
)
def test_a_script_exits_cleanly_in_the_middle_of_a_remote_epoch(
    s3: S3Server,
    uploaded: dict[str, str],
    tmp_path: Path,
    form: str,
    batch_size: int,
    cached: bool,
) -> None:
    done = run_bounded(
        [
            sys.executable,
            "-c",
            CHILD,
            uploaded[form],
            json.dumps(s3.storage_options()),
            str(batch_size),
            str(tmp_path / "cache") if cached else "",
        ],
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"keys": batch_size or 1}
    assert "Exception ignored" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
