"""OUT's lock: one build at a time uses a local OUT, a killed build's writers included.

A build takes ``flock(LOCK_EX)`` on OUT's folder itself (no file is added to OUT; a missing OUT
is created first) *before it looks at what OUT holds*, and keeps it until it ends: what the
build found there (empty, a journal to resume, a finished build) stays true while it scans,
writes and publishes, and nothing another build checked can change under it. Every process
that writes shards into OUT holds the same lock: forked workers inherit the descriptor,
spawned ones get it passed (:class:`OutLock` pickles as
:func:`multiprocessing.reduction.DupFd` while a process is being spawned). The kernel
releases a ``flock`` when the last descriptor of it is closed, so the lock is free only
once the build *and every one of its workers* are gone, however they died.

A second build into the same OUT (two builds started together, a ``--resume`` started right
after a kill, an ``--overwrite`` while the first still runs) waits up to ``LOCK_WAIT_S`` for
the lock (a killed build's writers exit within a fraction of a second:
:mod:`shardprep.format.lifeline`), then is refused with an
:class:`~shardprep.format.errors.InputError` naming the processes that have OUT open. If the
first build ends within that wait, the second checks OUT as the first left it (a finished
build: refused without ``--overwrite``; with ``--resume``: already complete). Once a build
holds the lock, a ``.partial`` file in OUT belongs to a dead build: nothing writes it any more.

A build that made OUT removes it again when it ends with OUT still empty (refused, or failed
before it wrote anything), while it still holds the lock (:meth:`OutLock.remove_if_made`);
a build that waited on that folder meanwhile sees it is gone once it gets the lock, and makes
and locks OUT anew.

A filesystem without ``flock`` (some network filesystems refuse it) builds without the
lock, with a warning: concurrent builds into that OUT are then not detected.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from multiprocessing import context as mp_context
from multiprocessing import reduction
from typing import Any

from shardprep.format.errors import InputError

__all__ = ["LOCK_WAIT_S", "OutLock", "hold_out", "processes_with_open"]

LOCK_WAIT_S = 5.0  # a killed build's writers are gone well within this
POLL_S = 0.05
LOG = logging.getLogger("shardprep")


class OutLock:
    """The held ``flock`` on OUT's folder: a descriptor that every writer process keeps open.

    ``made``: the folders :func:`hold_out` created for it (OUT first, then the parents it
    made), empty in a worker. Pickles only for a process being spawned (the descriptor is
    passed to it); a forked process inherits it as it is.
    """

    def __init__(self, fd: int, path: str, made: tuple[str, ...] = ()) -> None:
        self.fd = fd
        self.path = path
        self.made = made

    def remove_if_made(self) -> None:
        """Remove the folders this lock's :func:`hold_out` made, OUT first, as long as they are
        empty (a build that wrote nothing leaves no OUT it made); call while the lock is held."""
        for folder in self.made:
            try:
                os.rmdir(folder)
            except OSError:  # not empty (or gone): it and its parents stay
                return

    def close(self) -> None:
        """Close this process's descriptor (the lock is released once no process holds it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __reduce__(self) -> tuple[Any, ...]:
        if mp_context.get_spawning_popen() is None:
            raise TypeError(
                f"the lock on {self.path} goes only to a worker process being started "
                "(a pickle of it elsewhere would not hold the lock)"
            )
        return (_received, (reduction.DupFd(self.fd), self.path))


def _received(handle: Any, path: str) -> OutLock:
    """In a spawned worker: the descriptor its parent passed (the same lock)."""
    return OutLock(handle.detach(), path)


def hold_out(out: str, wait_s: float = LOCK_WAIT_S) -> OutLock | None:
    """Lock the folder ``out`` for this build (made first, with its parents, if absent),
    waiting up to ``wait_s`` for another build (or a killed build's writers) to let go; None
    where the filesystem has no flock.

    Raises:
        InputError: another process still holds the lock after ``wait_s``; the message names
            the processes that have ``out`` open.
        OSError: ``out`` cannot be made or opened.
    """
    deadline = time.monotonic() + wait_s
    while True:
        made = _make_folders(out)
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            unsupported = _wait_for_lock(fd, out, max(0.0, deadline - time.monotonic()))
            if unsupported is None and not _still_at(fd, out):
                # the build that made it removed it, empty, while this one waited: again
                if time.monotonic() >= deadline:
                    raise _busy(out, wait_s)
                os.close(fd)
                continue
        except BaseException:  # refused, or Ctrl-C while waiting: this process lets go
            os.close(fd)
            raise
        if unsupported is None:
            return OutLock(fd, out, made)
        os.close(fd)
        LOG.warning(
            "%s: cannot lock the output folder (%s): another build writing into it at the "
            "same time would not be noticed",
            out,
            unsupported,
        )
        return None


def _make_folders(out: str) -> tuple[str, ...]:
    """Make ``out`` and its missing parents; the folders this call made, deepest first."""
    missing = []
    folder = os.path.abspath(out)
    while not os.path.isdir(folder):
        missing.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    made = []
    for folder in reversed(missing):
        try:
            os.mkdir(folder)
        except FileExistsError:  # another build made it meanwhile (a file: open() says so)
            continue
        made.append(folder)
    return tuple(reversed(made))


def _still_at(fd: int, out: str) -> bool:
    """Whether the folder locked through ``fd`` is still the one at ``out``."""
    try:
        now = os.stat(out)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _wait_for_lock(fd: int, out: str, wait_s: float) -> str | None:
    """Take the lock on ``fd`` within ``wait_s``; None once held, else why flock cannot work.

    Raises:
        InputError: still held by another process after ``wait_s``.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                return err.strerror or str(err)  # no flock on this filesystem
        if time.monotonic() >= deadline:
            raise _busy(out, wait_s)
        time.sleep(POLL_S)  # a bounded poll: flock has no timeout of its own


def _busy(out: str, waited: float) -> InputError:
    holders = processes_with_open(out)
    named = "; ".join(f"{pid} ({command})" for pid, command in holders[:8]) or (
        "none of them visible to this user"
    )
    return InputError(
        f"{out}: another shardprep build is still writing into this folder (it held the "
        f"folder's lock for {waited:g} s more; processes with it open: {named}); let that "
        "build end or stop it (its writers stop within a second of their build's process), "
        "then run the same command again",
        out,
    )


def processes_with_open(path: str) -> list[tuple[int, str]]:
    """(pid, command line) of the processes of this user with ``path`` open, from /proc."""
    target = os.path.realpath(path)
    me = os.getpid()
    found = []
    for entry in sorted(filter(str.isdigit, os.listdir("/proc")), key=int):
        pid = int(entry)
        if pid == me:
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if not any(_link(f"/proc/{pid}/fd/{fd}") == target for fd in fds):
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # another user's process, or it exited meanwhile
            continue
        found.append((pid, command[:160]))
    return found


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""
