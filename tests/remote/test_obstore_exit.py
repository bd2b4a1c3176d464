"""A process that read with obstore exits cleanly, however late obstore's threads call back.

obstore's threads call into Python when they hand a finished request to the loop
(``call_soon_threadsafe``) and when they check a cancelled one. CPython stops a thread
that takes the GIL while the interpreter finalizes; inside obstore's Rust code that
aborts the process (SIGABRT) after the program has printed its result. It happened in
CI and in 8 of 40 runs of a stalled-read probe on a loaded machine (2026-11-29). Each
test here runs a child that widens one such window, so the crash is certain without
``loader.io.obstore_backend._quiesce``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("obstore")

from tests.processes import run_bounded  # noqa: E402
from tests.remote.test_silent_endpoint import STALLED_ANSWER, Endpoint, s3_options  # noqa: E402
from tests.s3 import S3Server  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# obstore's thread, after handing a result over, waits 0.5 s outside the GIL before it
# takes the GIL back: without the wait at exit, the main thread is finalizing by then.
LATE_HAND_OVER = """
import json, sys, threading, time
from asyncio import selector_events

write = selector_events.BaseSelectorEventLoop._write_to_self

def late(self):
    write(self)
    if threading.get_ident() != self._thread_id:
        time.sleep(0.5)

selector_events.BaseSelectorEventLoop._write_to_self = late

from loader import RemoteOptions
from loader.io.source import Source

url, options = sys.argv[1], json.loads(sys.argv[2])
source = Source(url, RemoteOptions(storage_options=options, backend="obstore"))
print(bytes(source.fetch("object.bin", 2, 9)).decode(), flush=True)
"""

# a request in flight (a stalled body) when the program ends: cancelled at exit, and the
# exit waits for obstore's thread to check the cancellation, not for the read timeout
IN_FLIGHT_AT_EXIT = """
import json, sys, threading, time
from loader import RemoteOptions
from loader.io import obstore_backend
from loader.io.source import Source

url, options = sys.argv[1], json.loads(sys.argv[2])
source = Source(
    url, RemoteOptions(storage_options=options, backend="obstore", read_timeout_s=60)
)
threading.Thread(target=source.fetch, args=("shard-00000.tar", 0, 1000), daemon=True).start()
while not obstore_backend._outstanding:
    time.sleep(0.01)
print("in flight", flush=True)
"""


def test_a_result_handed_over_late_does_not_abort_the_exit(s3: S3Server, bucket: str) -> None:
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
    fs.pipe(f"{bucket}/object.bin", b"0123456789abcdef")
    options = json.dumps(s3.storage_options())
    done = run_bounded(
        [sys.executable, "-c", LATE_HAND_OVER, f"s3://{bucket}", options], 60, cwd=ROOT
    )
    # without the wait at exit: -6 (SIGABRT), stdout "2345678", stderr empty
    assert (done.returncode, done.stdout, done.stderr) == (0, "2345678\n", ""), done


def test_a_request_in_flight_at_exit_is_cancelled_not_waited_for() -> None:
    stalled = Endpoint(STALLED_ANSWER)
    try:
        options = json.dumps(s3_options(stalled.url))
        began = time.monotonic()
        done = run_bounded(
            [sys.executable, "-c", IN_FLIGHT_AT_EXIT, "s3://bucket/out", options], 60, cwd=ROOT
        )
        took = time.monotonic() - began
    finally:
        stalled.stop()
    assert (done.returncode, done.stdout, done.stderr) == (0, "in flight\n", ""), done
    # not the 60 s read timeout, nor QUIESCE_S (5 s) of waiting for a request never released
    assert took < 4.5, took
