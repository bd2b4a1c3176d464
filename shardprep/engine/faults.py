"""Which task failures are worth a retry, and the test-only fault hooks of the Ray engine.

A write fails for good when its input is wrong (a source vanished or changed
size since the scan: the same bytes can never be written) or the disk is
full; it may succeed on a second try when the I/O error is of the passing
kind (a network filesystem's EIO or timeout, a reset connection). Only the
second kind is raised as :class:`TransientWriteError`, the exception class
the Ray engine names in ``retry_exceptions``; Ray's own ``max_retries`` then
decides how often.
"""

from __future__ import annotations

import errno
import os
import time

from shardprep.format.errors import WriteError
from shardprep.inventory import SampleRef

__all__ = ["TEST_FAULTS_ENV", "TransientWriteError", "check_test_faults", "classify"]

TRANSIENT_ERRNOS = frozenset(
    {
        errno.EIO,
        errno.EAGAIN,
        errno.EINTR,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ECONNREFUSED,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ESTALE,  # NFS: a file handle gone stale under a re-export
    }
)

# Test-only hook (read by the Ray write task; never set it in production):
# a folder in which every write attempt appends ``<shard>`` to ``attempts``;
# the file ``fail-<shard>`` makes the next write of that shard fail once with
# a transient EIO (the file is removed when it fires), ``deny-<shard>`` makes
# every write of it fail with EACCES (not transient), ``crash-<shard>`` makes every
# write of it end its own worker process at once (``os._exit``, as if the kernel's OOM
# killer had struck), and ``hold-<shard>`` makes the write of that shard wait until the
# file is removed (at most HOLD_LIMIT_S seconds).
TEST_FAULTS_ENV = "SHARDPREP_TEST_FAULTS"
HOLD_LIMIT_S = 120.0


class TransientWriteError(WriteError):
    """A write failed on an I/O error that may pass: the Ray engine retries the task."""


def classify(err: WriteError, samples: list[SampleRef]) -> WriteError:
    """``err`` as a :class:`TransientWriteError` if a retry may succeed, else ``err`` itself.

    Transient: the cause is an OSError with an errno in ``TRANSIENT_ERRNOS``
    and every source still has the size the scan recorded.
    """
    cause = err.__cause__
    if not isinstance(cause, OSError) or cause.errno not in TRANSIENT_ERRNOS:
        return err
    if _sources_changed(samples):
        return err
    transient = TransientWriteError(str(err), err.shard_index)
    transient.__cause__ = cause
    return transient


def _sources_changed(samples: list[SampleRef]) -> bool:
    for sample in samples:
        for part in sample.parts:
            try:
                size = os.stat(part.path).st_size
            except FileNotFoundError:
                return True
            except OSError:
                continue  # unreadable now: may pass
            if (part.offset < 0 and size != part.size) or size < part.offset + part.size:
                return True
    return False


def check_test_faults(shard: int) -> None:
    """The test-only hook (see ``TEST_FAULTS_ENV``); does nothing unless the variable is set.

    Raises:
        OSError: EIO, once per ``fail-<shard>`` file; EACCES while ``deny-<shard>`` exists.
        (While ``crash-<shard>`` exists the process exits instead.)
        TimeoutError: ``hold-<shard>`` was not removed within ``HOLD_LIMIT_S`` s.
    """
    folder = os.environ.get(TEST_FAULTS_ENV)
    if not folder:
        return
    with open(os.path.join(folder, "attempts"), "a", encoding="utf-8") as log:
        log.write(f"{shard}\n")
    if os.path.exists(os.path.join(folder, f"crash-{shard}")):
        os._exit(137)  # the worker dies as if SIGKILLed: no exception reaches Ray
    if os.path.exists(os.path.join(folder, f"deny-{shard}")):
        raise OSError(errno.EACCES, f"injected lasting failure of shard {shard} (test hook)")
    try:
        os.remove(os.path.join(folder, f"fail-{shard}"))  # atomic: fires exactly once
    except FileNotFoundError:
        pass
    else:
        raise OSError(errno.EIO, f"injected transient failure of shard {shard} (test hook)")
    hold = os.path.join(folder, f"hold-{shard}")
    deadline = time.monotonic() + HOLD_LIMIT_S
    while os.path.exists(hold):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{hold} still exists after {HOLD_LIMIT_S} s (test hook)")
        time.sleep(0.02)
