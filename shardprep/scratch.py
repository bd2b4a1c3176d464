"""Scratch folders: a build's private folders under TMPDIR, and the sweep of killed builds' ones.

A build makes two kinds of folder in ``tempfile.gettempdir()`` (``TMPDIR``): its scratch
folder (``shardprep-build-XXXXXXXX``: the inventory and plan columns) and, when OUT is a
URL, its staging folder (``shardprep-staging-XXXXXXXX``: shards waiting for upload). A
build removes them when it ends; a build that is killed (SIGKILL, out of memory, power)
cannot. So each folder holds a lock file, ``shardprep.lock``, that its build keeps
``flock``-ed for as long as it runs; the kernel releases the lock when the build's last
process dies, however it dies. :func:`sweep_stale` (called as a build starts) removes a
folder only if all of these hold:

- its name is one of the two patterns above, it is a real folder (not a link) owned by
  this user, directly in the temp folder;
- it holds a regular file ``shardprep.lock`` (so only folders a shardprep build made);
- that file's lock can be taken at once (so no live process holds it).

A new folder's lock file is made under another name, locked, then renamed: a sweep never
sees a lock file that is not locked yet.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import tempfile
from types import TracebackType

from shardprep.format.sigint import deferred

__all__ = ["LOCK_NAME", "OwnedFolder", "remove_tree", "sweep_stale"]

LOCK_NAME = "shardprep.lock"
PREFIXES = ("shardprep-build-", "shardprep-staging-")
_OURS = re.compile(r"^shardprep-(build|staging)-[A-Za-z0-9_]{8}$")  # tempfile.mkdtemp names
LOG = logging.getLogger("shardprep")


class OwnedFolder:
    """A new folder ``<tmp>/<prefix>XXXXXXXX`` that holds its locked ``shardprep.lock`` until
    :meth:`close` removes it (with everything in it)."""

    def __init__(self, prefix: str) -> None:
        assert prefix in PREFIXES, prefix
        # A Ctrl-C meanwhile (recorded, and raised as the deferral ends) removes the folder
        # again: one landing in mkdtemp after it made the folder left an empty folder that no
        # sweep removes (no lock file; a fault hunt saw it once in 300 signals). Tested by
        # tests/unit/test_interrupts.py. Registering the folder for removal is the caller's.
        self.path, self._fd = "", -1
        try:
            with deferred():
                self.path = tempfile.mkdtemp(prefix=prefix)
                pending = os.path.join(self.path, f".{LOCK_NAME}.new")
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                self._fd = os.open(pending, flags, 0o600)
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.rename(pending, os.path.join(self.path, LOCK_NAME))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove the folder, then release its lock (idempotent). A Ctrl-C meanwhile is raised
        when both are done (see :func:`remove_tree`)."""
        with deferred():
            if self.path:
                shutil.rmtree(self.path, ignore_errors=True)
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> str:
        return self.path

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def remove_tree(path: str) -> None:
    """``shutil.rmtree(path, ignore_errors=True)``, with a Ctrl-C meanwhile raised after it: one
    that cuts CPython 3.11's rmtree between a close and its record closes that descriptor twice
    (OSError instead of the interrupt; see :mod:`shardprep.format.interrupts`)."""
    with deferred():
        shutil.rmtree(path, ignore_errors=True)


def sweep_stale(folder: str | None = None) -> list[str]:
    """Remove the scratch and staging folders of dead builds from ``folder`` (default: the
    temp folder); returns their paths. Never raises for a folder it cannot judge or remove:
    it is left as it is (see the module doc for what is removed)."""
    top = folder or tempfile.gettempdir()
    removed = []
    try:
        names = [name for name in os.listdir(top) if _OURS.match(name)]
    except OSError:
        return []
    for name in sorted(names):
        path = os.path.join(top, name)
        if _remove_if_stale(path):
            removed.append(path)
    if removed:
        LOG.info("removed %d folder(s) left by killed shardprep builds", len(removed))
    return removed


def _remove_if_stale(path: str) -> bool:
    try:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return False
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # gone, not ours, or no lock file: not a folder this module made
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False  # its build is alive
            raise
        remove_tree(path)
        return not os.path.lexists(path)
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
