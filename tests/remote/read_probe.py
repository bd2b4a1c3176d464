"""One remote read in a child process, reported as JSON on stdout.

For tests whose read could hang without the fix under test: the parent runs this with
``tests.processes.run_bounded``, which kills it at its deadline.

    python -m tests.remote.read_probe URL NAME START STOP OPTIONS_JSON

reads bytes ``[START, STOP)`` of ``NAME`` (``Source.fetch``), or the manifest when NAME is
``manifest.json`` (``Source.manifest``), with ``RemoteOptions(**OPTIONS_JSON)``.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    url, name, start, stop, spec = sys.argv[1:6]
    from loader import RemoteOptions
    from loader.io.source import Source

    source = Source(url, RemoteOptions(**json.loads(spec)))
    began = time.monotonic()
    outcome: dict[str, object] = {"error": None, "url": None, "message": ""}
    try:
        if name == "manifest.json":
            source.manifest()
        else:
            source.fetch(name, int(start), int(stop))
    except Exception as err:  # reported to the parent, which asserts on it
        outcome = {
            "error": type(err).__name__,
            "url": getattr(err, "url", None),
            "message": str(err),
        }
    outcome["elapsed"] = time.monotonic() - began
    print(json.dumps(outcome))


if __name__ == "__main__":
    main()
