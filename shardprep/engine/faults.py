"""Which task failures are worth a retry (the Ray engine's ``retry_exceptions``).

A write fails for good when its input is wrong (a source vanished or changed
size since the scan: the same bytes can never be written) or the disk is
full; it may succeed on a second try when the I/O error is of the passing
kind (a network filesystem's EIO or timeout, a reset connection). Only the
second kind is raised as :class:`TransientWriteError`, the exception class
the Ray engine names in ``retry_exceptions``; Ray's own ``max_retries`` then
decides how often. (Tests inject such failures by wrapping the engine's write task:
tests/engine/faulty.py.)
"""

from __future__ import annotations

import errno
import os

from shardprep.format.errors import WriteError
from shardprep.inventory import SampleRef
from shardprep.storage import is_url
from shardprep.write import ResumableWriteError

__all__ = ["TransientWriteError", "classify"]

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


class TransientWriteError(ResumableWriteError):
    """A write failed on an I/O error that may pass: the Ray engine retries the task (and
    after its last retry the builder advises a resume, as for any
    :class:`~shardprep.write.ResumableWriteError`)."""


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
            if is_url(part.path):
                continue  # its reader checked the size it got against the scan's
            try:
                size = os.stat(part.path).st_size
            except FileNotFoundError:
                return True
            except OSError:
                continue  # unreadable now: may pass
            if (part.offset < 0 and size != part.size) or size < part.offset + part.size:
                return True
    return False
