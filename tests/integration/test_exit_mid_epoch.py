"""A script that takes a few batches and ends, leaving its epoch open, ends cleanly.

Peeking at a batch or two and ending the script is the usual first use. The epoch's
generators are then closed while the interpreter shuts down, and with ``import loader`` (the
package kept alive by ``__main__``) that can be after the loader's modules have lost their
globals: cleaning up must then neither print "Exception ignored" nor wait for its threads.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.faults.test_hunt_localahead import _build
from tests.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import sys
import torch
import loader

out, batch_size, workers, mixed = sys.argv[1], int(sys.argv[2]) or None, int(sys.argv[3]), sys.argv[4]
kw = dict(batch_size=batch_size, shuffle_buffer_bytes=1 << 20, block_size=8)
if mixed == "mixed":
    ds = loader.MixedDataset([out, out], [0.5, 0.5], batch_size=batch_size)
else:
    ds = loader.ShardDataset(out, **kw)
it = iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers))
for _ in range(3):
    next(it)
print("took 3", flush=True)
"""


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory, built: Path) -> dict[str, Path]:
    """Large samples (70-100 KiB: read straight into the batch, on two threads) and small."""
    return {"large": _build(tmp_path_factory.mktemp("exit"), 40)[0], "small": built}


@pytest.mark.parametrize(
    ("output", "batch_size", "workers", "mixed"),
    [
        ("large", 10, 0, "one"),  # read straight into the batch, on two threads
        ("large", 0, 0, "one"),  # per sample: the local read-ahead thread
        ("small", 4, 0, "one"),
        ("large", 10, 2, "one"),
        ("large", 10, 0, "mixed"),
    ],
)
def test_a_script_that_imports_loader_ends_cleanly_mid_epoch(
    outputs: dict[str, Path], output: str, batch_size: int, workers: int, mixed: str
) -> None:
    done = run_bounded(
        [sys.executable, "-c", CHILD, str(outputs[output]), str(batch_size), str(workers), mixed],
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "took 3"
    assert "Exception ignored" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
