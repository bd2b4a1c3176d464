"""Hostile use of the scatter path (``loader.torch.scatter``, ``loader.io.files``): the batch path of
a local, uncompressed output of large samples, where each batch reads its samples with one
``os.preadv`` each straight into its buffers and checks them there, in process on two threads.

Shards changed under a running epoch (an open shard keeps being read from its open inode: its
original bytes, checked, are fine; wrong bytes, a dropped or repeated sample are not), bytes
flipped in a header, padding or data, ``on_error="skip"``, Ctrl-C while the second thread
reads, DataLoader workers (killed, persistent), a resumed StatefulDataLoader, a fork inside the
epoch, abandoned iterators (no thread, no open shard, no ResourceWarning left), class-weighted
and irregular outputs, samples of many members, and memory over many epochs. The reference is
always the per-sample path (an identity ``transform``), which reads windows whole."""

from __future__ import annotations

import gc
import os
import random
import re
import shutil
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import shardprep
from loader import CorruptShardError, ReadOptions, ShardDataset
from loader.core import ShardStream
from loader.io.files import SPLIT_MIN, THREAD_NAME
from loader.torch.batch import Packed
from loader.torch.output import TorchOutput
from shardprep.format.shardformat import decode_index
from tests.conftest import write_class_folders
from tests.faults import test_hunt_localahead as hunt
from tests.faults.test_hunt_localahead import _build, _change, _check
from tests.integration.test_localahead import _until, same
from tests.processes import run_bounded

KW: dict[str, Any] = {"batch_size": 10, "shuffle_buffer_bytes": 1 << 20, "block_size": 8}
PER_SAMPLE: dict[str, Any] = {**KW, "transform": same}  # the reference: windows read whole
ROOT = Path(__file__).resolve().parents[2]
assert KW["batch_size"] >= SPLIT_MIN  # in process, every full batch is read on two threads

Output = tuple[Path, dict[str, bytes]]
large, copy = hunt.large, hunt.copy  # its fixtures: 90 samples of 70-100 KiB, 3 shards; a copy


def _splits() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME + "-")]


def _open_in(out: Path) -> int:
    """How many of this process's descriptors are open on files under ``out``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(f"{out}/")
        except OSError:  # the descriptor of the listing itself, closed by now
            continue
    return count


def _left(out: Path) -> bool:
    """Nothing left of an epoch: no split thread, no shard of ``out`` open."""
    gc.collect()
    return _until(lambda: not _splits() and _open_in(out) == 0)


def _same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """The batches are equal, field by field and byte for byte, in order."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert list(a) == list(b)
        for name, value in a.items():
            if isinstance(value, Packed):
                assert torch.equal(value.data, b[name].data), name
                assert torch.equal(value.offsets, b[name].offsets), name
            elif isinstance(value, torch.Tensor):
                assert torch.equal(value, b[name]), name
            else:
                assert list(value) == list(b[name]) if name == "__key__" else value == b[name]


def _outcome(out: Path, kw: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """The batches of one epoch, and the error that ended it (its message), if any."""
    got: list[dict[str, Any]] = []
    try:
        for batch in ShardDataset(str(out), **kw):
            got.append(batch)
    except CorruptShardError as err:
        return got, str(err)
    return got, None


@pytest.mark.parametrize(("seed", "batch_size"), [(0, 10), (5, 13)])
def test_batches_are_the_per_sample_paths_byte_for_byte(
    large: Output, seed: int, batch_size: int
) -> None:
    """Three epochs, batches spanning windows (and a short last one of 13): exactly the
    per-sample path's batches, in order; the second thread reads while the epoch runs and is
    gone, with every shard file, when it ends."""
    out, jpgs = large
    kw = {**KW, "batch_size": batch_size, "seed": seed}
    for epoch in range(3):
        fast = ShardDataset(str(out), **kw)
        slow = ShardDataset(str(out), **kw, transform=same)
        fast.set_epoch(epoch)
        slow.set_epoch(epoch)
        it = iter(fast)
        got = [next(it)]
        assert len(_splits()) == 1  # the scatter path is the one taken
        got.extend(it)
        _same(got, list(slow))
        assert sum(_check(b, jpgs) for b in got) == 90
        assert sorted(k for b in got for k in b["__key__"]) == sorted(jpgs)
    assert _left(out)


def test_on_error_skip_takes_the_read_ahead_path(large: Output, copy: Path) -> None:
    """``on_error="skip"`` turns the scatter path off (the windows are read ahead and whole):
    the damaged sample's stand-in is padded, as on the per-sample path."""
    out, _ = large
    index = decode_index((copy / "shard-00001.idx").read_bytes(), "idx")
    _flip(copy / "shard-00001.tar", _data_at(index, 7, "jpg") + 99)
    skip = ReadOptions(on_error="skip")
    it = iter(ShardDataset(str(copy), **KW, read=skip))
    got = [next(it)]
    # (one thread: the reader's, reading the windows ahead; the scatter path reads each batch
    # when it is asked for, the windows are not read ahead)
    assert [t.name for t in threading.enumerate() if t.name.startswith(THREAD_NAME)] == [
        f"{THREAD_NAME}-0"
    ]
    got.extend(it)
    want = list(ShardDataset(str(copy), **PER_SAMPLE, read=skip))
    _same(got, want)
    padded = [
        (k, p) for b in got for k, p in zip(b["__key__"], b["__padded__"].tolist(), strict=True)
    ]
    assert [p for _, p in padded].count(True) == 1 and index.key(7) not in dict(padded)
    assert _left(copy)


# ----------------------------------------------------------------------------- damage


def _flip(tar: Path, at: int) -> None:
    with open(tar, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x5A]))


def _member(index: Any, sample: int, ext: str) -> int:
    members = range(int(index.member_start[sample]), int(index.member_start[sample + 1]))
    return next(m for m in members if index.exts[int(index.member_ext[m])] == ext)


def _data_at(index: Any, sample: int, ext: str) -> int:
    return int(index.member_offset[_member(index, sample, ext)])


def _site(index: Any, sample: int, where: str) -> int:
    """The file offset of a byte of ``sample`` of the kind ``where``."""
    jpg, txt = _member(index, sample, "jpg"), _member(index, sample, "txt")
    if where == "first header":  # (its name field)
        return int(index.sample_offset[sample]) + 3
    if where == "second header":  # (its size field)
        return int(index.member_offset[txt]) - 512 + 130
    if where == "padding between":  # after the .jpg's data, before the .txt's header
        return int(index.member_offset[jpg] + index.member_size[jpg]) + 5
    if where == "padding after":  # after the last member's data
        return int(index.member_offset[txt] + index.member_size[txt]) + 5
    if where == "jpg data":
        return int(index.member_offset[jpg]) + 4321
    return int(index.member_offset[txt]) + 2  # "txt data"


SITES = ["first header", "second header", "padding between", "padding after", "jpg data"]


@pytest.mark.parametrize("where", [*SITES, "txt data"])
def test_a_flipped_byte_is_named_as_the_per_sample_path_names_it(
    large: Output, copy: Path, where: str
) -> None:
    """One byte flipped in sample 17 of shard 1: the batch path delivers exactly the
    per-sample path's batches before it and raises its very error, naming the shard and the
    key (padding after the last member is no sample's byte: both deliver the whole epoch)."""
    _, jpgs = large
    index = decode_index((copy / "shard-00001.idx").read_bytes(), "idx")
    assert int(index.member_size[_member(index, 17, "jpg")]) % 512  # there is padding
    _flip(copy / "shard-00001.tar", _site(index, 17, where))
    got, error = _outcome(copy, KW)
    want, expected = _outcome(copy, PER_SAMPLE)
    _same(got, want)
    assert error == expected
    for batch in got:
        _check(batch, jpgs)
    if where == "padding after":
        assert error is None and len(got) == 9
    else:
        assert error is not None and f"shard-00001.tar: sample '{index.key(17)}'" in error
    assert _left(copy)


@pytest.mark.parametrize("how", ["truncate", "overwrite", "rename", "delete"])
def test_a_shard_changed_before_the_epoch_is_named(large: Output, copy: Path, how: str) -> None:
    """Truncated, overwritten in place, replaced by another file, deleted before the epoch:
    the batches of shards 0 and 1 (all but the last, which waits for shard 2's window), then
    an error naming the shard and a sample (a truncated shard: the first one it lacks)."""
    clean = list(ShardDataset(str(large[0]), **KW, shuffle=False))
    tar = copy / "shard-00002.tar"
    index = decode_index((copy / "shard-00002.idx").read_bytes(), "idx")
    if how == "truncate":
        os.truncate(tar, int(index.sample_offset[20]) + 100)
    else:
        _change(tar, how)
    got, error = _outcome(copy, {**KW, "shuffle": False})
    assert len(got) in (5, 6)
    _same(got, clean[: len(got)])
    assert error is not None
    if how == "truncate":
        assert f"shard-00002.tar: sample '{index.key(20)}'" in error and "truncated" in error
    elif how == "delete":
        assert f"shard-00002.tar: sample '{index.key(0)}'" in error and "missing" in error
    else:
        assert re.search(r"shard-00002\.tar: sample '\d{3}'", error), error
    assert _left(copy)


@pytest.mark.parametrize("how", ["truncate", "overwrite", "rename", "delete"])
def test_a_shard_changed_mid_epoch(large: Output, copy: Path, how: str) -> None:
    """Each shard changed in turn after batch 1 (every shard is open by then or not, by the
    shuffle): what is delivered is each sample's own bytes, none twice; an error names the
    changed shard and a sample of it; a change the open file sees (truncated, overwritten in
    place) always raises; one it does not (replaced, deleted) may give the whole epoch."""
    _, jpgs = large
    for shard in range(3):
        out = copy.parent / f"out{shard}"
        shutil.copytree(copy, out)
        index = decode_index((out / f"shard-{shard:05d}.idx").read_bytes(), "idx")
        keys = {index.key(i) for i in range(index.num_samples)}
        delivered: list[str] = []
        error = None
        try:
            for n, batch in enumerate(ShardDataset(str(out), **KW)):
                _check(batch, jpgs)
                delivered.extend(batch["__key__"])
                if n == 1:
                    _change(out / f"shard-{shard:05d}.tar", how)
        except CorruptShardError as err:
            error = str(err)
        assert len(set(delivered)) == len(delivered)
        if error is None:
            assert how in ("rename", "delete") and sorted(delivered) == sorted(jpgs)
        else:
            found = re.search(rf"shard-{shard:05d}\.tar: sample '(\d{{3}})'", error)
            assert found and found[1] in keys, error
        assert _left(out)


CHILD_CHMOD = """
import os, sys
from loader import ShardDataset
out, tar = sys.argv[1], sys.argv[1] + "/shard-00001.tar"
kw = dict(batch_size=10, shuffle_buffer_bytes=1 << 20, block_size=8, shuffle=False)
for at in (-1, 0, 4):
    n, keys = -1, []
    if at == -1:
        os.chmod(tar, 0)
    try:
        for n, batch in enumerate(ShardDataset(out, **kw)):
            keys.extend(batch["__key__"])
            if n == at:
                os.chmod(tar, 0)
        print(at, "WHOLE", len(keys), len(set(keys)))
    except Exception as err:
        print(at, "RAISED", len(keys), type(err).__name__, err)
    finally:
        os.chmod(tar, 0o644)
"""


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_a_shard_made_unreadable(copy: Path) -> None:
    """``chmod 000`` of shard 1, in a process without the capabilities that let root ignore
    it: before the epoch or while shard 0 is read, its open fails naming it (when the window
    of batch 2, which goes on in it, is read); once it is open (batch 4 is in it), reading
    goes on (the open file's bytes, checked)."""
    drop = "-dac_override,-dac_read_search"
    command = ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}"]
    done = run_bounded([*command, sys.executable, "-c", CHILD_CHMOD, str(copy)], 60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    denied = f"PermissionError [Errno 13] Permission denied: '{copy}/shard-00001.tar'"
    assert done.stdout.splitlines() == [
        f"-1 RAISED 20 {denied}",
        f"0 RAISED 20 {denied}",
        "4 WHOLE 90 90",
    ], done.stdout


def test_a_sample_of_many_members(tmp_path: Path) -> None:
    """Samples of 600 members (more iovecs than one ``os.preadv`` takes, 1024): the same
    batches as the per-sample path, not an ``OSError`` naming nothing."""
    raw = tmp_path / "raw"
    raw.mkdir()
    rng = random.Random(5)
    for i in range(12):
        for f in range(600):
            (raw / f"{i:02d}.f{f:03d}").write_bytes(rng.randbytes(100))
    shardprep.build(str(raw), str(tmp_path / "out"), shards=1, workers=1, progress=False,
                    input_format="keyed")  # fmt: skip
    out = tmp_path / "out"
    _same(list(ShardDataset(str(out), **KW)), list(ShardDataset(str(out), **PER_SAMPLE)))
    assert _left(out)


def test_a_shard_held_by_many_chunks_is_open_once(tmp_path: Path) -> None:
    """20 shards, windows of ~50 one-sample pieces from all of them: each shard is opened
    once however many chunks hold it (not once per piece after it left the last few kept:
    74 descriptors here before, thousands with a large ``shuffle_buffer_bytes``); the
    per-sample path's batches."""
    raw = tmp_path / "raw"
    raw.mkdir()
    rng = random.Random(9)
    for i in range(120):
        (raw / f"{i:03d}.jpg").write_bytes(rng.randbytes(rng.randrange(64 << 10, 90 << 10)))
        (raw / f"{i:03d}.txt").write_bytes(b"t%d" % i)
    shardprep.build(str(raw), str(tmp_path / "out"), shards=20, workers=1, progress=False,
                    input_format="keyed")  # fmt: skip
    out = tmp_path / "out"
    kw: dict[str, Any] = {"batch_size": 10, "block_size": 1, "shuffle_buffer_bytes": 4 << 20}
    got, peak = [], 0
    for batch in ShardDataset(str(out), **kw):
        got.append(batch)
        peak = max(peak, _open_in(out))
    assert 8 < peak <= 20
    _same(got, list(ShardDataset(str(out), **kw, transform=same)))
    assert _left(out)


# -------------------------------------------------------------------------- interrupts


# where the reader starts and joins its threads: the executor, through start_thread
READER_THREADS = ("/loader/io/executor.py", "/shardprep/format/threads.py")


def _interrupt_when(name: str) -> Callable[[FrameType, str, Any], Any]:
    """A trace function raising KeyboardInterrupt (as Python's SIGINT handler does: in the
    main thread, at the code it runs) as the main thread enters ``threading.Thread.<name>``
    called from ``loader/io/executor.py`` (or its ``start_thread``): a moment a real Ctrl-C may land."""
    code = getattr(threading.Thread, name).__code__

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is code:
            caller = frame.f_back
            if caller is not None and caller.f_code.co_filename.endswith(READER_THREADS):
                sys.settrace(None)
                raise KeyboardInterrupt
        return None

    return trace


@pytest.mark.parametrize("where", ["start", "join"])
def test_ctrl_c_as_the_split_thread_starts_or_stops(copy: Path, where: str) -> None:
    """Ctrl-C while the second thread is started (the first batch) or joined (the epoch
    left): the consumer gets the KeyboardInterrupt itself, not an error of the cleanup, and
    no thread or shard file is left, without waiting for the collector."""
    it = ShardStream(str(copy), **KW, output=TorchOutput()).iterate(0)  # (ShardDataset's)
    sys.settrace(_interrupt_when(where))
    try:
        with pytest.raises(KeyboardInterrupt) as info:  # noqa: PT012 - either is the act
            next(it)
            it.close()  # type: ignore[attr-defined]
    except RuntimeError as err:  # the KeyboardInterrupt lost in the cleanup
        pytest.fail(f"Ctrl-C became {err!r}")
    finally:
        sys.settrace(None)
    # (while the handler holds the interrupt, and its traceback the reader's frames)
    assert _until(lambda: not _splits() and _open_in(copy) == 0, timeout=10)
    del it, info
    assert _left(copy)


CHILD_CTRL_C = """
import gc, os, random, signal, sys, threading, warnings
from loader import ShardDataset
from loader.io.files import THREAD_NAME

# an interrupt between a file's open() and the object that owns it leaves the file to the
# garbage collector, which closes it (a ResourceWarning, no descriptor left: OPEN below)
warnings.simplefilter("ignore", ResourceWarning)
armed = [False]

def interrupt(signum, frame):
    if armed[0]:  # a Ctrl-C: SIGINT, whose own (Python's) handler raises KeyboardInterrupt
        signal.raise_signal(signal.SIGINT)

def open_in(out):
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{fd}")]
    return sum(f.startswith(out + "/") for f in fds)

signal.signal(signal.SIGALRM, interrupt)
rng = random.Random(3)
kw = {"batch_size": 10, "shuffle_buffer_bytes": 1 << 20, "block_size": 8}
interrupted = 0
for _ in range(60):
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
# (a thread whose start() the interrupt cut before the system thread was made stays in
# threading's limbo, listed but never run: CPython's own bookkeeping, no thread, no ident; one
# with an ident and never started would be stuck: join raises for it)
left = [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME + "-") and t.ident is not None]
for t in left:
    t.join(10)
whole = sum(len(b["__key__"]) for b in ShardDataset(sys.argv[1], **kw))
print("INTERRUPTED", interrupted, "LEFT", sum(t.is_alive() for t in left),
      "OPEN", open_in(sys.argv[1]), "WHOLE", whole)
"""


def test_ctrl_c_at_random_moments(copy: Path) -> None:
    """SIGALRM-timed Ctrl-Cs (SIGINT, Python's own handler) at random moments of 60 epochs
    (many while the second thread reads): always the KeyboardInterrupt, never another error, no
    thread or shard file left open (tests/unit/test_shard_files.py, tests/unit/test_threads.py:
    the rare cases), and the next epoch whole. In a child process: an interrupt that
    escapes must not end the test session. (An interrupt landing between a shard's open() and
    the object that owns it leaves that file to the garbage collector: about 1 run in 25 saw
    it as a ResourceWarning; no descriptor is left either way.)"""
    done = run_bounded([sys.executable, "-c", CHILD_CTRL_C, str(copy)], timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    words = done.stdout.split()
    assert words[0] == "INTERRUPTED" and int(words[1]) > 0, done.stdout
    assert words[2:] == ["LEFT", "0", "OPEN", "0", "WHOLE", "90"], done.stdout


@pytest.mark.parametrize("how", ["break", "del", "unfinished", "raise"])
def test_the_consumer_leaves_the_epoch(large: Output, copy: Path, how: str) -> None:
    """However the epoch is left, the second thread and every shard file are gone (counted in
    /proc/self/fd), and no ResourceWarning is raised."""
    _, jpgs = large
    before = len(os.listdir("/proc/self/fd"))

    def epoch() -> Iterator[dict[str, Any]]:
        yield from ShardDataset(str(copy), **KW)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "break":
            for n, batch in enumerate(ShardDataset(str(copy), **KW)):
                _check(batch, jpgs)
                if n == 3:
                    assert len(_splits()) == 1 and _open_in(copy) > 0
                    break
        elif how == "del":
            it = iter(ShardDataset(str(copy), **KW))
            _check(next(it), jpgs)
            assert len(_splits()) == 1
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
        assert _left(copy)
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert len(os.listdir("/proc/self/fd")) <= before


def test_two_datasets_of_one_output_interleaved_and_a_dataloader_inside(large: Output) -> None:
    """Two epochs of one output interleaved in one process (two second threads), and a
    DataLoader with 2 workers made and run inside that loop: each sample of each, its bytes."""
    out, jpgs = large
    a, b = ShardDataset(str(out), **KW), ShardDataset(str(out), **KW, seed=3)
    seen_a, seen_b, inner = 0, 0, 0
    for n, (x, y) in enumerate(zip(a, b, strict=True)):
        seen_a += _check(x, jpgs)
        seen_b += _check(y, jpgs)
        if n == 4:
            assert len(_splits()) == 2
            inner_ds = ShardDataset(str(out), **KW, seed=9)
            for z in DataLoader(inner_ds, batch_size=None, num_workers=2):
                inner += _check(z, jpgs)
    assert (seen_a, seen_b, inner) == (90, 90, 90)
    assert _left(out)


# ----------------------------------------------------------------------------- workers


def test_workers_scatter_into_their_ring_as_the_per_sample_path(large: Output) -> None:
    """Two workers, each reading its batches into its shared-memory ring: the per-sample
    path's batches through the same DataLoader, in order, over two epochs; no thread in the
    process that forks them."""
    out, _ = large
    for epoch in range(2):
        fast = ShardDataset(str(out), **KW)
        slow = ShardDataset(str(out), **PER_SAMPLE)
        fast.set_epoch(epoch)
        slow.set_epoch(epoch)
        got = []
        for batch in DataLoader(fast, batch_size=None, num_workers=2):
            assert not _splits()
            got.append(batch)
        _same(got, list(DataLoader(slow, batch_size=None, num_workers=2)))
    assert _left(out)


def test_persistent_workers_over_three_epochs(large: Output) -> None:
    out, jpgs = large
    ds = ShardDataset(str(out), **KW)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    for epoch in range(3):
        ds.set_epoch(epoch)
        ref = ShardDataset(str(out), **PER_SAMPLE)
        ref.set_epoch(epoch)
        want = list(DataLoader(ref, batch_size=None, num_workers=2))
        got = []
        for batch in loader:
            _check(batch, jpgs)
            got.append(batch)
        _same(got, want)
    del loader
    assert _left(out)


def test_a_stateful_dataloader_resumes_with_the_exact_rest(large: Output) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    out, _ = large
    whole = list(DataLoader(ShardDataset(str(out), **KW), batch_size=None, num_workers=2))
    first = StatefulDataLoader(ShardDataset(str(out), **KW), batch_size=None, num_workers=2)
    it = iter(first)
    head = [next(it) for _ in range(3)]
    state = first.state_dict()
    del it, first
    again = StatefulDataLoader(ShardDataset(str(out), **KW), batch_size=None, num_workers=2)
    again.load_state_dict(state)
    rest = list(again)
    assert len(rest) == len(whole) - 3
    _same(head + rest, whole)


CHILD_KILL = """
import os, signal, sys, time
import psutil
from torch.utils.data import DataLoader
from loader import ShardDataset
ds = ShardDataset(sys.argv[1], batch_size=10, shuffle_buffer_bytes=1 << 20, block_size=8)
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


def test_a_killed_worker_raises_and_leaves_nothing(large: Output) -> None:
    out, _ = large
    done = run_bounded([sys.executable, "-c", CHILD_KILL, str(out)], timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "RAISED DataLoader worker (pid" in done.stdout, done.stdout + done.stderr
    assert "LEFT 0" in done.stdout


CHILD_FORK = """
import os, sys
from loader import ShardDataset
kw = dict(batch_size=10, shuffle_buffer_bytes=1 << 20, block_size=8)
def rows(batches):
    return [[(str(k), bytes(j)) for k, j in zip(b["__key__"], b["jpg"].tolist())] for b in batches]
whole = rows(ShardDataset(sys.argv[1], **kw))
it = iter(ShardDataset(sys.argv[1], **kw))
head = rows(next(it) for _ in range(3))  # the second thread has read
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # the child goes on with the iterator it inherited
    os.close(read)
    rest = rows(it)
    os.write(write, repr(rest).encode())
    os._exit(0)
os.close(write)
rest = rows(it)
got = b""
while chunk := os.read(read, 1 << 16):
    got += chunk
_, status = os.waitpid(pid, 0)
print("PARENT", head + rest == whole, "CHILD", eval(got) == rest, os.waitstatus_to_exitcode(status))
"""


# the second thread reads slowly; the fork checks that it is not inside a read (nothing is read
# ahead of the batch asked for, so between batches the second thread has nothing in flight)
SLOW_SECOND_THREAD = """
import os, threading, time
import loader.torch.scatter
from loader.io.files import THREAD_NAME
_read, _fork, _lock = loader.torch.scatter.positioned_read, os.fork, threading.Lock()
_in_flight, _reads, _reading = [0], [0], threading.Event()
_waited = [False]
def _slow(*args):
    if not threading.current_thread().name.startswith(THREAD_NAME + "-"):
        if not _waited[0]:  # the first read here waits (bounded) until the second thread reads
            _waited[0] = True  # too: on a loaded machine, this thread can be done before it runs
            _reading.wait(10)
        return _read(*args)
    with _lock:
        _in_flight[0] += 1
        _reads[0] += 1
    _reading.set()
    time.sleep(0.02)
    try:
        return _read(*args)
    finally:
        with _lock:
            _in_flight[0] -= 1
def _fork_between_batches():
    _reading.clear()
    # (a negative check, bounded: a read begun ahead would start within this time)
    assert not _reading.wait(0.5), "the second thread reads while no batch is asked for"
    with _lock:
        assert _reads[0] > 0, "the second thread read nothing"
        assert _in_flight[0] == 0, "the second thread reads while no batch is asked for"
    return _fork()
loader.torch.scatter.positioned_read, os.fork = _slow, _fork_between_batches
"""


@pytest.mark.parametrize("second", ["as is", "slow"])
def test_a_forked_child_goes_on_with_the_inherited_iterator(large: Output, second: str) -> None:
    """User code forks inside an epoch (the second thread exists in the parent only): parent
    and child each get the exact rest of the epoch, the child's own bytes included. With the
    second thread slowed down, the fork finds it out of every read (nothing is read ahead of
    the batch asked for), and the child starts its own."""
    out, _ = large
    code = (SLOW_SECOND_THREAD if second == "slow" else "") + CHILD_FORK
    done = run_bounded([sys.executable, "-c", code, str(out)], timeout=45, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["PARENT", "True", "CHILD", "True", "0"], done.stdout


# ----------------------------------------------------------------------------- outputs


@pytest.fixture(scope="module")
def weighted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """57 samples of ~1-170 KiB in classes a, b, c: plain, resampled, weights only."""
    base = tmp_path_factory.mktemp("weighted")
    raw = write_class_folders(base / "raw", {"a": 40, "b": 12, "c": 5}, repeat=200)
    common: dict[str, Any] = {"shards": 3, "workers": 1, "progress": False}
    shardprep.build(str(raw), str(base / "plain"), **common)
    shardprep.build(str(raw), str(base / "resampled"), **common, class_weights="balanced")
    shardprep.build(str(raw), str(base / "weights"), **common, class_weights="balanced",
                    weights_only=True)  # fmt: skip
    return base


@pytest.mark.parametrize(
    ("name", "extra"),
    [("plain", {"class_weights": "balanced"}), ("resampled", {}), ("weights", {})],
)
def test_class_weighted_outputs(weighted: Path, name: str, extra: dict[str, Any]) -> None:
    """Read-time reweighting (copies of a sample in one batch), a resampled output, one with
    weights: the per-sample path's batches, labels and weights included, for two epochs."""
    out = weighted / name
    for epoch in range(2):
        fast = ShardDataset(str(out), **KW, **extra)
        slow = ShardDataset(str(out), **PER_SAMPLE, **extra)
        fast.set_epoch(epoch)
        slow.set_epoch(epoch)
        it = iter(fast)
        got = [next(it)]
        assert len(_splits()) == 1
        got.extend(it)
        _same(got, list(slow))
    assert _left(out)


def test_an_irregular_output_of_large_samples(tmp_path: Path) -> None:
    """Large samples on average, with tiny ones, ones without a ``.txt``, an empty ``.txt``,
    and an extra ``.json`` on some: each batch the per-sample path's (those with fields that
    differ are made from the windows read whole)."""
    raw = tmp_path / "raw"
    raw.mkdir()
    rng = random.Random(3)
    for i in range(60):
        key = f"{i:03d}"
        big = i % 7 != 3
        (raw / f"{key}.jpg").write_bytes(rng.randbytes((100 << 10) + i if big else 1 + i))
        if i % 5 != 1:
            (raw / f"{key}.txt").write_bytes(b"" if i % 13 == 6 else b"cap %d" % i)
        if i % 11 == 4:
            (raw / f"{key}.json").write_bytes(b"{}")
    shardprep.build(str(raw), str(tmp_path / "out"), shards=2, workers=1, progress=False,
                    input_format="keyed")  # fmt: skip
    out = tmp_path / "out"
    for epoch in range(2):
        fast, slow = ShardDataset(str(out), **KW), ShardDataset(str(out), **PER_SAMPLE)
        fast.set_epoch(epoch)
        slow.set_epoch(epoch)
        _same(list(fast), list(slow))
    assert _left(out)


CHILD_MEMORY = """
import gc, os, sys
import psutil
from loader import ShardDataset
out = sys.argv[1]
rows = []
for epoch in range(10):
    ds = ShardDataset(out, batch_size=10, shuffle_buffer_bytes=1 << 20, block_size=8)
    ds.set_epoch(epoch)
    n = 0
    for batch in ds:
        n += len(batch["__key__"])
    assert n == 90
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    rows.append(f"{psutil.Process().memory_info().rss >> 20}:{fds}")
print(" ".join(rows))
"""


def test_memory_and_descriptors_are_flat_over_epochs(tmp_path: Path) -> None:
    """A 20 MiB sample among ~85 KiB ones, 10 epochs in process: the same descriptors open
    after each, and the resident size after the last within 48 MiB of the second's (the
    reused batch buffer may grow once by that sample's batch; a leaked 20 MiB buffer an
    epoch would add 160 MiB)."""
    out, _ = _build(tmp_path, 90, big=40)
    done = run_bounded([sys.executable, "-c", CHILD_MEMORY, str(out)], timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    rows = [tuple(int(x) for x in r.split(":")) for r in done.stdout.split()]
    assert len(rows) == 10
    assert len({fds for _, fds in rows}) == 1, rows
    assert rows[-1][0] - rows[1][0] < 48, rows


def test_a_read_error_of_an_open_shard_names_it(
    copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``OSError`` of ``os.preadv`` names no file (EIO from a disk, say): raised as the
    same type naming the shard and the bytes it was reading. (A directory's descriptor in
    place of shard 1's gives a real one: EISDIR.)"""
    from loader.io.files import ShardFiles

    directory = os.open(copy, os.O_RDONLY)
    real = ShardFiles.get

    def get(self: ShardFiles, shard: int) -> Any:
        file = real(self, shard)
        if file is not None and shard == 1:
            file.fd = directory
        return file

    monkeypatch.setattr(ShardFiles, "get", get)
    try:
        with pytest.raises(IsADirectoryError) as info:
            for _ in ShardDataset(str(copy), **KW):
                pass
        assert info.value.filename == str(copy / "shard-00001.tar")
        assert re.search(r"\(reading \d+ bytes at offset \d+\)", str(info.value))
        assert _until(lambda: not _splits())
    finally:
        os.close(directory)
