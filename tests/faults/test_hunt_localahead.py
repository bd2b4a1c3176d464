"""Hostile use of the local read-ahead (``loader.io.readahead`` with a ``LocalFetch``, on the
reader's ``loader.io.executor.Executor``): shards changed under a running
epoch, a read error on the thread, Ctrl-C, abandoned iterators, killed and persistent DataLoader
workers, a resumed StatefulDataLoader, a fork from inside an epoch, and memory over many
windows. Real files and processes throughout; samples of 70-100 KiB and 1 MiB windows, so
every window after the first goes through the thread. The thread serves the per-sample path
(``KW`` and the children's ``kw`` have an identity ``transform``); the batch path of such an
output is hunted in tests/faults/test_hunt_scatter.py. Whatever happens, a batch holds its
samples' own bytes, an error names the shard, and no thread or process is left behind."""

from __future__ import annotations

import gc
import os
import random
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from torch.utils.data import DataLoader

import shardprep
from loader import CorruptShardError, ShardDataset
from loader.core import ShardStream
from loader.io import executor
from loader.io.files import THREAD_NAME
from tests.integration.test_localahead import KW, _threads, _until
from tests.processes import run_bounded

ROOT = Path(__file__).resolve().parents[2]


def _build(base: Path, count: int, big: int | None = None) -> tuple[Path, dict[str, bytes]]:
    """``count`` samples of a 70-100 KiB ``.jpg`` (sample ``big``: 20 MiB) and a ``.txt``, in 3
    plain shards; and the ``.jpg`` bytes by key."""
    raw = base / "raw"
    raw.mkdir(parents=True)
    rng = random.Random(7)
    jpgs = {}
    for i in range(count):
        key = f"{i:03d}"
        size = 20 << 20 if i == big else rng.randrange(70 << 10, 100 << 10)
        jpgs[key] = rng.randbytes(size)
        (raw / f"{key}.jpg").write_bytes(jpgs[key])
        (raw / f"{key}.txt").write_bytes(b"caption %d" % i)
    shardprep.build(str(raw), str(base / "out"), shards=3, workers=1, progress=False,
                    input_format="keyed")  # fmt: skip
    return base / "out", jpgs


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    return _build(tmp_path_factory.mktemp("hunt"), 90)


@pytest.fixture
def copy(large: tuple[Path, dict[str, bytes]], tmp_path: Path) -> Path:
    shutil.copytree(large[0], tmp_path / "out")
    return tmp_path / "out"


def _check(batch: dict[str, Any], jpgs: dict[str, bytes]) -> int:
    """Assert every sample of ``batch`` holds its own bytes; how many it holds."""
    keys = list(batch["__key__"])
    for key, data in zip(keys, batch["jpg"].tolist(), strict=True):
        assert data == jpgs[key], f"sample {key} delivered with wrong bytes"
    return len(keys)


def _change(tar: Path, how: str) -> None:
    size = tar.stat().st_size
    if how == "truncate":
        os.truncate(tar, 100_000)
    elif how == "overwrite":
        with open(tar, "r+b") as f:
            f.write(random.Random(1).randbytes(size))
    elif how == "rename":
        other = tar.with_suffix(".new")
        other.write_bytes(random.Random(2).randbytes(size))
        os.replace(other, tar)
    else:
        tar.unlink()


@pytest.mark.parametrize("how", ["truncate", "overwrite", "rename", "delete"])
@pytest.mark.parametrize("at", [0, 3])
def test_a_shard_changed_between_windows(
    large: tuple[Path, dict[str, bytes]], copy: Path, how: str, at: int
) -> None:
    """Each shard changed in turn after batch ``at``: the batches before the error hold their
    own bytes, the error names the changed shard, and a shard changed before it is read
    always raises."""
    _, jpgs = large
    raised = 0
    for shard in range(3):
        out = copy.parent / f"out{shard}"
        shutil.copytree(copy, out)
        tar = out / f"shard-{shard:05d}.tar"
        with pytest.raises(CorruptShardError) as info:  # noqa: PT012 - the epoch is the act
            for n, batch in enumerate(ShardDataset(str(out), **KW)):
                _check(batch, jpgs)
                if n == at:
                    _change(tar, how)
        assert f"shard-{shard:05d}.tar" in str(info.value)
        raised += 1
        assert _until(lambda: not _threads())
    assert raised == 3


def test_bytes_scribbled_while_the_thread_reads(
    large: tuple[Path, dict[str, bytes]], copy: Path
) -> None:
    """Another thread overwrites 4 KiB blocks of the shards all through the epoch (mid-window
    too): nothing wrong is ever delivered, and the damage is named as a checksum mismatch.

    A trial whose scribbles all land on bytes the epoch has already read (or lose the race to
    its end: about 1 trial in 180 on a quiet machine, more under load) delivers every sample
    right and raises nothing; at least 3 of the 4 trials must meet damage and name it."""
    _, jpgs = large
    named = 0
    for trial in range(4):
        out = copy.parent / f"scribbled{trial}"
        shutil.copytree(copy, out)
        stop = threading.Event()
        rng = random.Random(trial)

        def scribble(
            rng: random.Random = rng, out: Path = out, stop: threading.Event = stop
        ) -> None:
            while not stop.is_set():
                with open(out / f"shard-{rng.randrange(3):05d}.tar", "r+b") as f:
                    f.seek(rng.randrange(2_600_000))
                    f.write(rng.randbytes(4096))
                stop.wait(0.002)

        scribbler = threading.Thread(target=scribble)
        try:
            for n, batch in enumerate(ShardDataset(str(out), **KW)):
                if n == 1:
                    scribbler.start()
                _check(batch, jpgs)  # every sample delivered is the sample as built
        except CorruptShardError as err:
            assert re.search(r"shard-0000\d\.tar: sample '\d{3}'", str(err)), err
            named += 1
        finally:
            stop.set()
            if scribbler.is_alive():
                scribbler.join(10)
        assert _until(lambda: not _threads())
    assert named >= 3, named


def test_a_read_error_on_the_thread_names_the_shard(copy: Path) -> None:
    """The thread's read fails (EIO: the shard is a link to this process's memory, read at
    unmapped addresses): the consumer's error names the shard, not just the errno."""
    tar = copy / "shard-00002.tar"
    tar.unlink()
    tar.symlink_to("/proc/self/mem")
    with pytest.raises(OSError, match="shard-00002.tar"):
        list(ShardDataset(str(copy), **KW, shuffle=False))
    assert _until(lambda: not _threads())


# where the reader starts and joins its threads: the executor, through start_thread
READER_THREADS = ("/loader/io/executor.py", "/shardprep/format/threads.py")


def _interrupt_when(name: str) -> Callable[[FrameType, str, Any], Any]:
    code = getattr(threading.Thread, name).__code__
    """A trace function that raises KeyboardInterrupt (as Python's SIGINT handler raises a
    Ctrl-C: in the main thread, at the code it is running) as the main thread enters
    ``threading.Thread.<name>`` called by the read-ahead: a moment a real Ctrl-C may land."""

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is code:
            caller = frame.f_back
            if caller is not None and caller.f_code.co_filename.endswith(READER_THREADS):
                sys.settrace(None)
                raise KeyboardInterrupt
        return None

    return trace


# (an interrupt between a file's ``open`` and its ``with`` leaves that file to the collector)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("where", ["start", "join"])
def test_ctrl_c_as_the_thread_starts_or_stops(copy: Path, where: str) -> None:
    """Ctrl-C while the thread is being started (or joined): the consumer gets the
    KeyboardInterrupt itself (not an error of the cleanup), and the thread is gone after."""
    it = ShardStream(str(copy), **KW).iterate(0)
    sys.settrace(_interrupt_when(where))
    try:
        with pytest.raises(KeyboardInterrupt):
            if where == "start":
                next(it)
            else:
                next(it)
                it.close()  # type: ignore[attr-defined]
    except RuntimeError as err:  # the KeyboardInterrupt lost in the cleanup
        pytest.fail(f"Ctrl-C became {err!r}")
    finally:
        sys.settrace(None)
    del it
    gc.collect()
    assert _until(lambda: not _threads())


CHILD_CTRL_C = """
import gc, random, signal, sys, threading, warnings
from loader import ShardDataset
from loader.io.files import THREAD_NAME

warnings.simplefilter("ignore", ResourceWarning)  # an interrupt between open and with
armed = [False]

def interrupt(signum, frame):
    if armed[0]:
        raise KeyboardInterrupt

signal.signal(signal.SIGALRM, interrupt)
rng = random.Random(3)
kw = {"batch_size": 5, "shuffle_buffer_bytes": 1 << 20, "block_size": 8,
      "transform": lambda s: s}
interrupted = 0
for _ in range(100):
    ds = ShardDataset(sys.argv[1], **kw)
    try:
        armed[0] = True
        signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0005, 0.02))
        try:
            for _batch in ds:
                pass
        finally:
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except KeyboardInterrupt:
        interrupted += 1
    except BaseException as err:
        print("OTHER", repr(err))
        sys.exit(1)
gc.collect()
# (a thread whose start() the interrupt cut before it was started stays in threading's
# limbo, listed but never run: CPython's own bookkeeping, no thread; not joinable)
left = [t for t in threading.enumerate()
        if t.name.startswith(THREAD_NAME + "-") and t.ident is not None]
for t in left:
    t.join(10)
print("INTERRUPTED", interrupted, "LEFT", sum(t.is_alive() for t in left))
"""


def test_ctrl_c_at_random_moments(copy: Path) -> None:
    """SIGALRM-driven KeyboardInterrupts at random moments of 100 epochs (about 1 in 50 landed
    in the thread's start before the fix): always the KeyboardInterrupt, never another error,
    no thread left. In a child process: an interrupt that escapes must not end the test
    session."""
    done = run_bounded([sys.executable, "-c", CHILD_CTRL_C, str(copy)], timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    words = done.stdout.split()
    assert words[0] == "INTERRUPTED" and int(words[1]) > 0, done.stdout
    assert words[2:] == ["LEFT", "0"], done.stdout


@pytest.mark.parametrize("how", ["break", "del", "unfinished", "raise"])
def test_the_consumer_leaves_the_epoch(
    large: tuple[Path, dict[str, bytes]], copy: Path, how: str
) -> None:
    _, jpgs = large

    def epoch() -> Iterator[dict[str, Any]]:
        yield from ShardDataset(str(copy), **KW)

    if how == "break":
        for n, batch in enumerate(ShardDataset(str(copy), **KW)):
            _check(batch, jpgs)
            if n == 3:
                break
    elif how == "del":
        it = iter(ShardDataset(str(copy), **KW))
        _check(next(it), jpgs)
        assert len(_threads()) == 1
        del it
    elif how == "unfinished":
        gen = epoch()
        _check(next(gen), jpgs)
        del gen
    else:
        with pytest.raises(ValueError, match="training step"):
            for n, _batch in enumerate(ShardDataset(str(copy), **KW)):
                if n == 2:
                    raise ValueError("training step")
    gc.collect()
    assert _until(lambda: not _threads())


def test_two_datasets_of_one_output_and_a_fork_inside_the_epoch(
    large: tuple[Path, dict[str, bytes]],
) -> None:
    """Two epochs of one output interleaved in one process, and DataLoaders (forked workers)
    made and run inside that loop while both threads read: every sample of each, its bytes."""
    out, jpgs = large
    a, b = ShardDataset(str(out), **KW), ShardDataset(str(out), **KW, seed=3)
    seen_a, seen_b, inner = 0, 0, 0
    for n, (x, y) in enumerate(zip(a, b, strict=True)):
        seen_a += _check(x, jpgs)
        seen_b += _check(y, jpgs)
        if n in (1, 9):
            assert len(_threads()) == 2
            inner_ds = ShardDataset(str(out), **KW, seed=9)
            for z in DataLoader(inner_ds, batch_size=None, num_workers=2):
                inner += _check(z, jpgs)
    assert (seen_a, seen_b, inner) == (90, 90, 180)
    assert _until(lambda: not _threads())


def test_persistent_workers_over_three_epochs(large: tuple[Path, dict[str, bytes]]) -> None:
    out, jpgs = large
    ds = ShardDataset(str(out), **KW)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    for epoch in range(3):
        ds.set_epoch(epoch)
        ref = ShardDataset(str(out), **KW)
        ref.set_epoch(epoch)
        want = sorted(k for batch in ref for k in batch["__key__"])
        got = []
        for batch in loader:
            _check(batch, jpgs)
            got.extend(batch["__key__"])
        assert sorted(got) == want and len(got) == 90
    del loader
    assert not _threads()


def test_a_stateful_dataloader_resumes_with_the_exact_rest(
    large: tuple[Path, dict[str, bytes]],
) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    out, jpgs = large
    whole = [list(b["__key__"]) for b in DataLoader(ShardDataset(str(out), **KW),
                                                    batch_size=None, num_workers=2)]  # fmt: skip
    first = StatefulDataLoader(ShardDataset(str(out), **KW), batch_size=None, num_workers=2)
    it = iter(first)
    head = [list(next(it)["__key__"]) for _ in range(5)]
    state = first.state_dict()
    del it, first
    again = StatefulDataLoader(ShardDataset(str(out), **KW), batch_size=None, num_workers=2)
    again.load_state_dict(state)
    rest = []
    for batch in again:
        _check(batch, jpgs)
        rest.append(list(batch["__key__"]))
    assert head + rest == whole and len(rest) == len(whole) - 5


CHILD_KILL = """
import os, signal, sys, time
import psutil
from torch.utils.data import DataLoader
from loader import ShardDataset
ds = ShardDataset(sys.argv[1], batch_size=5, shuffle_buffer_bytes=1 << 20, block_size=8,
                  transform=lambda s: s)
it = iter(DataLoader(ds, batch_size=None, num_workers=2))
next(it)
workers = psutil.Process().children()
os.kill(workers[0].pid, signal.SIGKILL)
try:
    for _ in it:
        pass
    print("NO ERROR")
except RuntimeError as err:
    print("RAISED", err)
del it
deadline = time.monotonic() + 30
while psutil.Process().children() and time.monotonic() < deadline:
    time.sleep(0.05)
print("LEFT", len(psutil.Process().children()))
"""


def test_a_killed_worker_raises_and_leaves_nothing(large: tuple[Path, dict[str, bytes]]) -> None:
    out, _ = large
    done = run_bounded([sys.executable, "-c", CHILD_KILL, str(out)], timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "RAISED DataLoader worker (pid" in done.stdout, done.stdout + done.stderr
    assert "LEFT 0" in done.stdout


CHILD_MEMORY = """
import gc, sys
import psutil
from loader import ShardDataset
rss = []
for epoch in range(8):
    ds = ShardDataset(sys.argv[1], batch_size=5, shuffle_buffer_bytes=1 << 20, block_size=8,
                      transform=lambda s: s)
    ds.set_epoch(epoch)
    n = 0
    for batch in ds:
        n += len(batch["__key__"])
        if "040" in list(batch["__key__"]):
            assert len(batch["jpg"].tolist()[list(batch["__key__"]).index("040")]) == 20 << 20
    assert n == 90
    gc.collect()
    rss.append(psutil.Process().memory_info().rss)
print(" ".join(str(r >> 20) for r in rss))
"""


def test_memory_is_steady_over_epochs_with_a_20_mib_sample(tmp_path: Path) -> None:
    """A 20 MiB sample among ~85 KiB ones (a window of its own), 8 epochs of ~30 windows: the
    resident size after epoch 2 stays within 12 MiB of it (one leaked big window a epoch
    would add 20 MiB each)."""
    out, _ = _build(tmp_path, 90, big=40)
    done = run_bounded([sys.executable, "-c", CHILD_MEMORY, str(out)], timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    rss = [int(x) for x in done.stdout.split()]
    assert len(rss) == 8
    assert max(rss[2:]) - rss[1] < 12, rss


CHILD_FORK = """
import os, sys
from loader import ShardDataset
kw = dict(batch_size=5, shuffle_buffer_bytes=1 << 20, block_size=8, transform=lambda s: s)
whole = [[str(k) for k in b["__key__"]] for b in ShardDataset(sys.argv[1], **kw)]
it = iter(ShardDataset(sys.argv[1], **kw))
head = [[str(k) for k in next(it)["__key__"]] for _ in range(3)]  # the thread is reading ahead
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # the child goes on with the iterator it inherited
    os.close(read)
    rest = [[str(k) for k in b["__key__"]] for b in it]
    os.write(write, repr(rest).encode())
    os._exit(0)
os.close(write)
rest = [[str(k) for k in b["__key__"]] for b in it]
got = b""
while chunk := os.read(read, 1 << 16):
    got += chunk
_, status = os.waitpid(pid, 0)
print("PARENT", head + rest == whole, "CHILD", eval(got) == rest, os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_goes_on_with_the_inherited_iterator(
    large: tuple[Path, dict[str, bytes]],
) -> None:
    """User code forks while the thread reads ahead, and the child goes on with the iterator
    it inherited (the thread is not in the child): both get the rest of the epoch, the child
    without waiting for windows no thread will read (before: 300 s, then a TimeoutError)."""
    out, _ = large
    done = run_bounded([sys.executable, "-c", CHILD_FORK, str(out)], timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["PARENT", "True", "CHILD", "True", "0"], done.stdout


def _in_open(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside ``Source.open`` (blocked opening a shard)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "open" and frame.f_code.co_filename.endswith("source.py"):
            return True
        frame = frame.f_back
    return False


def test_leaving_while_the_thread_hangs_in_open_is_bounded(
    copy: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung file system, for real: shard 1 is a FIFO that no one writes, so the thread's
    ``open`` of it blocks. Leaving the epoch then returns after ``JOIN_TIMEOUT_S`` with a
    warning (not never); the thread ends once the open returns. (The join timeout is cut from
    5 s to 1 s here: the same wait, a shorter real timeout.)"""
    monkeypatch.setattr(executor, "JOIN_TIMEOUT_S", 1.0)
    fifo = copy / "shard-00001.tar"
    fifo.unlink()
    os.mkfifo(fifo)
    it = ShardStream(str(copy), **KW, shuffle=False).iterate(0)
    for _ in range(5):  # shard 0's batches, until the thread reads ahead into shard 1
        next(it)
        if _until(lambda: any(_in_open(t) for t in _threads()), timeout=2):
            break
    assert [_in_open(t) for t in _threads()] == [True]
    started = time.monotonic()
    it.close()  # type: ignore[attr-defined]
    took = time.monotonic() - started
    assert 0.5 < took < 1.0 + 20
    assert f"{THREAD_NAME}-0 still busy" in caplog.text
    writer = os.open(
        fifo, os.O_WRONLY | os.O_NONBLOCK
    )  # the open returns: the thread sees the stop
    try:
        assert _until(lambda: not _threads())
    finally:
        os.close(writer)


CHILD_CHMOD = """
import os, sys, threading
from loader import ShardDataset
out, n = sys.argv[1], 0
try:
    for n, batch in enumerate(ShardDataset(out, batch_size=5, shuffle_buffer_bytes=1 << 20,
                                           block_size=8, shuffle=False,
                                           transform=lambda s: s)):
        if n == 2:
            os.chmod(out, 0)
    print("NO ERROR")
except Exception as err:
    print("RAISED", type(err).__name__, err)
finally:
    os.chmod(out, 0o755)
print("THREADS", len(threading.enumerate()))
"""


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_the_output_folder_made_unreadable_mid_epoch(copy: Path) -> None:
    """``chmod 000`` of the output folder after batch 2, in a process without the capabilities
    that let root ignore it: the next open fails naming its file (the thread's of
    shard-00001.tar, or of shard-00002.tar if it opened that one before the chmod), no thread
    is left."""
    drop = "-dac_override,-dac_read_search"
    command = ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}"]
    command += [sys.executable, "-c", CHILD_CHMOD, str(copy)]
    done = run_bounded(command, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1:] == ["THREADS 1"], done.stdout
    # (the indexes were read and checked when the dataset was made: the next shard opened,
    # on the thread or by the reader, is the one named)
    assert lines[0] in (
        f"RAISED PermissionError [Errno 13] Permission denied: '{copy}/shard-0000{n}.tar'"
        for n in (1, 2)
    ), done.stdout


ATTEMPTS = 12  # epochs until one has the thread read shard 1 (see below)


def test_a_thread_ended_by_a_base_exception_fails_the_reads_it_left(
    large: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``BaseException`` that ends the read-ahead thread (none is raised there in practice; it
    is injected here, the only way to make one) fails the read that asks for the window at once,
    naming the thread and the shard, instead of an AssertionError or a 300 s wait."""
    from loader.io.readahead import LocalFetch

    out, jpgs = large
    real = LocalFetch.part

    def part(self: Any, shard: int, start: int, stop: int) -> bytes:
        if shard == 1 and threading.current_thread().name.startswith(THREAD_NAME + "-"):
            raise SystemExit(3)
        return real(self, shard, start, stop)

    monkeypatch.setattr(LocalFetch, "part", part)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # its traceback, silenced
    # the thread reads shard 1 only if it takes that read before the epoch needs it; on a busy
    # machine the iterating thread may read it itself (an epoch then delivers everything, and
    # right: checked), so epochs are run until one has the thread take it (about 1 in 4 does
    # not under a load of 3 busy processes on 2 cores)
    for _ in range(ATTEMPTS):
        started = time.monotonic()
        delivered = 0
        try:
            for batch in ShardDataset(str(out), **KW):
                delivered += _check(batch, jpgs)
        except RuntimeError as err:
            assert re.search(f"{THREAD_NAME}-0.*shard-00001.tar", str(err)), err
            assert "SystemExit(3)" in str(err)
            assert time.monotonic() - started < 60
            assert delivered < len(jpgs)
            break
        assert delivered == len(jpgs)
        assert _until(lambda: not _threads())
    else:
        raise AssertionError(f"the thread never took shard 1's read in {ATTEMPTS} epochs")
    assert _until(lambda: not _threads())
