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
from tests.s3 import Proxy, S3Server  # noqa: E402

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

# Another exit hook, registered before obstore's (so it runs after it), takes 0.3 s (as
# logging's or multiprocessing's can): the interpreter finalizes 0.3 s after obstore's hook.
LATER_EXIT_HOOK = """
import atexit, time

atexit.register(time.sleep, 0.3)
"""

# a request in flight (a stalled body) when the program ends: cancelled at exit, and the
# exit waits for obstore's thread to check the cancellation, not for the read timeout
IN_FLIGHT_AT_EXIT = (
    LATER_EXIT_HOOK
    + """
import json, sys, threading
from loader import RemoteOptions
from loader.io import obstore_backend
from loader.io import source as source_module
from loader.io.source import Source

source_module.BACKOFF_S = 0.01  # the reader is done retrying before the exit hooks are
url, options = sys.argv[1], json.loads(sys.argv[2])
source = Source(
    url, RemoteOptions(storage_options=options, backend="obstore", read_timeout_s=60)
)
if sys.argv[3] == "fetch":
    read, args = source.fetch, ("shard-00000.tar", 0, 1000)
else:  # several ranges at once (asyncio.gather): cancelled at exit, nothing logged
    read, args = source.fetch_ranges, ("shard-00000.tar", [(0, 1000), (0, 1000)])

def read_until_the_exit():
    try:
        read(*args)
    except Exception as err:  # the exit's cancel: the error (and what it holds) is dropped
        print(type(err).__name__, flush=True)

threading.Thread(target=read_until_the_exit, daemon=True).start()
while not obstore_backend._outstanding:
    time.sleep(0.01)
print("in flight", flush=True)
"""
)

# A reader thread that had passed the exit check submits its request only once the exit has
# begun (as a read-ahead thread can), and obstore's thread takes 0.5 s to hand a result over: without the check on the loop thread, the request
# starts, and its hand-over meets the finalizing interpreter.
SUBMITTED_AS_THE_EXIT_BEGINS = (
    LATER_EXIT_HOOK
    + """
import asyncio, atexit, json, sys, threading
from asyncio import selector_events

submitted = threading.Event()
write = selector_events.BaseSelectorEventLoop._write_to_self

def late(self):
    write(self)
    if submitted.is_set() and threading.get_ident() not in {t.ident for t in threading.enumerate()}:
        for _ in range(50):  # 0.5 s, taking the GIL back every 10 ms
            time.sleep(0.01)

selector_events.BaseSelectorEventLoop._write_to_self = late

from loader import RemoteOptions
from loader.io import obstore_backend
from loader.io.source import Source

url, options = sys.argv[1], json.loads(sys.argv[2])
source = Source(url, RemoteOptions(storage_options=options, backend="obstore"))
print(bytes(source.fetch("object.bin", 2, 9)).decode(), flush=True)
submit, waiting = asyncio.run_coroutine_threadsafe, threading.Event()

def submit_once_exiting(coroutine, loop):
    if threading.current_thread().name == "reader":
        waiting.set()
        while not obstore_backend._closing:
            time.sleep(0.001)
        submitted.set()
    return submit(coroutine, loop)

asyncio.run_coroutine_threadsafe = submit_once_exiting
threading.Thread(target=source.fetch, args=("object.bin", 0, 4), name="reader", daemon=True).start()
waiting.wait(10)
"""
)

# The loop thread is switched out for 0.3 s between starting a request and counting it (the
# exit sees none in flight); the result is handed over late: without the exit always
# cancelling on the loop thread and waiting for it, the hand-over meets the finalizing
# interpreter.
STARTED_NOT_YET_COUNTED = (
    LATER_EXIT_HOOK
    + """
import json, sys, threading
from asyncio import selector_events
import obstore

write = selector_events.BaseSelectorEventLoop._write_to_self
get, started, second = obstore.get_range_async, threading.Event(), threading.Event()

def late(self):
    write(self)
    if second.is_set() and threading.get_ident() not in {t.ident for t in threading.enumerate()}:
        for _ in range(50):
            time.sleep(0.01)

def switched_out(*args, **kwargs):
    request = get(*args, **kwargs)
    if second.is_set():
        started.set()
        time.sleep(0.3)
    return request

selector_events.BaseSelectorEventLoop._write_to_self = late
obstore.get_range_async = switched_out

from loader import RemoteOptions
from loader.io.source import Source

url, options = sys.argv[1], json.loads(sys.argv[2])
source = Source(url, RemoteOptions(storage_options=options, backend="obstore"))
print(bytes(source.fetch("object.bin", 2, 9)).decode(), flush=True)
second.set()
threading.Thread(target=source.fetch, args=("object.bin", 0, 4), daemon=True).start()
started.wait(10)
"""
)

# obstore's thread runs Python for 0.5 s after it released its request (taking the GIL back
# every 10 ms) (a thread switch
# right after the release): without the exit waiting for it to leave Python, it takes the
# GIL back while the interpreter finalizes. In the hand-over of a result ("result"), and in
# the check of a request cancelled at exit ("cancelled", a stalled read).
LEAVES_PYTHON_LATE = (
    LATER_EXIT_HOOK
    + """
import json, sys, threading
from loader import RemoteOptions
from loader.io import obstore_backend
from loader.io.source import Source

release = obstore_backend._release

def release_then_pause(request):
    release(request)
    for _ in range(50):
        time.sleep(0.01)

obstore_backend._release = release_then_pause
case, url, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
source = Source(url, RemoteOptions(storage_options=options, backend="obstore", read_timeout_s=60))
if case == "result":
    print(bytes(source.fetch("object.bin", 2, 9)).decode(), flush=True)
else:
    threading.Thread(target=source.fetch, args=("shard-00000.tar", 0, 1000), daemon=True).start()
    while not obstore_backend._outstanding:
        time.sleep(0.01)
    print("in flight", flush=True)
"""
)


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


@pytest.mark.parametrize("method", ["fetch", "fetch_ranges"])
def test_a_request_in_flight_at_exit_is_cancelled_not_waited_for(method: str) -> None:
    stalled = Endpoint(STALLED_ANSWER)
    try:
        options = json.dumps(s3_options(stalled.url))
        began = time.monotonic()
        done = run_bounded(
            [sys.executable, "-c", IN_FLIGHT_AT_EXIT, "s3://bucket/out", options, method],
            60,
            cwd=ROOT,
        )
        took = time.monotonic() - began
    finally:
        stalled.stop()
    # the reader's read fails once the exit began (no new request); fetch_ranges without the
    # gather's error retrieved: "_GatheringFuture exception was never retrieved" on stderr
    expected = (0, "in flight\nUnreachableError\n", "")
    assert (done.returncode, done.stdout, done.stderr) == expected, done
    # not the 60 s read timeout, nor QUIESCE_S (5 s) of waiting for a request never released
    assert took < 4.5, took


def object_url(s3: S3Server, bucket: str) -> tuple[str, str]:
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
    fs.pipe(f"{bucket}/object.bin", b"0123456789abcdef")
    return f"s3://{bucket}", json.dumps(s3.storage_options())


@pytest.mark.parametrize(
    "script",
    [SUBMITTED_AS_THE_EXIT_BEGINS, STARTED_NOT_YET_COUNTED],
    ids=["submitted-as-the-exit-begins", "started-not-yet-counted"],
)
def test_a_request_starting_as_the_exit_begins_does_not_abort_it(
    s3: S3Server, bucket: str, proxy: Proxy, script: str
) -> None:
    url, _ = object_url(s3, bucket)
    proxy.latency = 0.2  # the request is still in flight when the exit looks for requests
    options = json.dumps(s3.storage_options(proxy.endpoint))
    done = run_bounded([sys.executable, "-c", script, url, options], 60, cwd=ROOT)
    # without the check on the loop thread, or the cancel sent whatever is counted: -6
    assert (done.returncode, done.stdout, done.stderr) == (0, "2345678\n", ""), done


def test_a_thread_that_released_a_result_and_is_still_in_python_is_waited_for(
    s3: S3Server, bucket: str
) -> None:
    url, options = object_url(s3, bucket)
    done = run_bounded(
        [sys.executable, "-c", LEAVES_PYTHON_LATE, "result", url, options], 60, cwd=ROOT
    )
    # without waiting for the thread to leave Python: -6, stdout "2345678", stderr empty
    assert (done.returncode, done.stdout, done.stderr) == (0, "2345678\n", ""), done


def test_a_thread_that_released_a_cancelled_request_and_is_still_in_python_is_waited_for() -> None:
    stalled = Endpoint(STALLED_ANSWER)
    try:
        options = json.dumps(s3_options(stalled.url))
        done = run_bounded(
            [sys.executable, "-c", LEAVES_PYTHON_LATE, "cancelled", "s3://bucket/out", options],
            60,
            cwd=ROOT,
        )
    finally:
        stalled.stop()
    # without waiting: -6 ("PyGILState_Release: thread state ... must be current")
    assert (done.returncode, done.stdout, done.stderr) == (0, "in flight\n", ""), done
