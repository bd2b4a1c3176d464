"""Steps: how many function calls an epoch's first sample takes, from ``ShardStream.items``
to the first read of shard bytes, and through how many files (issue 36's readability measure).

``python -m bench.steps OUT [--tree PATH] [--batch-size N]``: builds nothing; OUT is a finished
build. With ``--tree``, the loader of that checkout is measured (a worktree of an older commit).
A step is one call of a Python function defined in ``loader`` or ``shardprep``; ``functions``
counts the distinct named ones (comprehensions left out); a return is a step into a file that
the walk already left once. The walk ends at the first call of
``os.pread``/``os.preadv``/``readinto``/``mmap`` (the bytes), or at the first item.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

BYTES = {"pread", "preadv", "readinto", "mmap", "read"}


def walk(out: str, batch_size: int | None) -> dict[str, object]:
    from loader.core import ShardStream

    stream = ShardStream(out, batch_size=batch_size, seed=0)
    items = stream.iterate(0)
    steps: list[tuple[str, str]] = []
    done = False

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        nonlocal done
        if done:
            return
        if event == "c_call" and getattr(arg, "__name__", "") in BYTES and steps:
            if arg.__name__ != "read" or "loader" in steps[-1][0]:
                done = True
            return
        if event != "call":
            return
        path = frame.f_code.co_filename
        rel = path.split(os.sep + "loader" + os.sep, 1)
        if len(rel) == 2 and "site-packages" not in path:
            steps.append(("loader/" + rel[1], frame.f_code.co_name))
        elif os.sep + "shardprep" + os.sep in path and "site-packages" not in path:
            steps.append(
                (
                    "shardprep/" + path.split(os.sep + "shardprep" + os.sep, 1)[1],
                    frame.f_code.co_name,
                )
            )

    sys.setprofile(profile)
    try:
        next(items)
    finally:
        sys.setprofile(None)
    files: list[str] = []
    returns = 0
    last = None
    for file, _ in steps:
        if file != last and file in files:
            returns += 1
        if file not in files:
            files.append(file)
        last = file
    named = [s for s in steps if not s[1].startswith("<")]  # comprehensions and genexprs out
    distinct = list(dict.fromkeys(named))
    return {
        "steps": len(steps),
        "functions": len(distinct),
        "files": len(files),
        "returns": returns,
        "walk": [f"{f}:{n}" for f, n in steps],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tree", default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--walk", action="store_true", help="print every step")
    args = parser.parse_args()
    if args.tree:
        sys.path.insert(0, args.tree)
    result = walk(args.out, args.batch_size)
    if not args.walk:
        result.pop("walk")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
