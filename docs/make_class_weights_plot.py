"""Regenerate docs/class-weights.png from a real build (needs matplotlib: ``shardprep[plot]``).

    python docs/make_class_weights_plot.py [--out docs/class-weights.png]

Writes the imbalanced example dataset (``shardprep.example.write_example``: 1000
samples in 5 classes, the largest about 20 times the smallest) to a temporary
folder, runs ``shardprep build RAW OUT --shards 8 --class-weights balanced`` on
it, prints ``shardprep inspect OUT`` and draws the figure with
``shardprep.inspect.plot_histograms`` -- the same figure ``shardprep inspect
OUT --plot FILE.png`` draws. Everything is seeded, so the numbers are the same
on every run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from shardprep.example import write_example
from shardprep.inspect import format_inspection, inspection, plot_histograms

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "class-weights.png"))
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--classes", type=int, default=5)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        raw, out = os.path.join(tmp, "raw"), os.path.join(tmp, "balanced")
        counts = write_example(raw, args.samples, args.classes, args.seed)
        print(f"example: {sum(counts)} samples, class counts {counts}")
        command = [
            sys.executable, "-m", "shardprep", "build", raw, out,
            "--shards", str(args.shards), "--seed", str(args.seed),
            "--class-weights", "balanced", "--quiet",
        ]  # fmt: skip
        subprocess.run(command, check=True)
        print(format_inspection(inspection(out)).replace(tmp + os.sep, ""))
        plot_histograms(out, args.out)
    print(f"wrote {args.out} ({os.path.getsize(args.out):,} bytes)")


if __name__ == "__main__":
    main()
