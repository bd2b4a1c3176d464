"""Where a build on a Ray cluster copies Parquet payloads: into OUT's own storage.

A Parquet build copies each file's payloads once into a spill (:mod:`shardprep.scan.parquet`),
which the write tasks then read by offset, as tar members. On this machine the spill is in the
build's scratch folder; on a cluster the tasks run on other nodes, which cannot read it, so
the spill goes to ``OUT/.shardprep-spill/`` instead: an object store every node reaches (the
tasks read it by ranged GETs, as a URL input's members), or OUT's folder, which every node
shares already (the tasks write their shards there). No shared disk is needed beyond OUT.

Reading the Parquet files themselves from each write task was weighed and not done: a shard
takes its samples from every part of the input (the plan deals them by size and class), so
each task would decompress nearly every row group to take a few rows from it (the input read
about once per shard), where the spill reads it once.

Each build spills into a folder of its own, ``OUT/.shardprep-spill/<random id>/`` (two builds
racing into one OUT never read each other's bytes), removed once the shards are written and
when the build fails. A build killed outright leaves its folder: the next build into that OUT
with ``--resume`` or ``--overwrite`` (which say the earlier build is over) removes every one
first; a plain build is refused, OUT not being empty.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardprep.format.errors import OutputError
from shardprep.format.interface import CLI, Interface
from shardprep.storage import describe_error, is_url, open_url

__all__ = ["SPILL_DIR", "OutSpill"]

SPILL_DIR = ".shardprep-spill"  # in OUT: the payloads of a Parquet build on a cluster


@dataclass(frozen=True)
class OutSpill:
    """``OUT/.shardprep-spill/<id>``: a URL (with OUT's storage options) or a local folder."""

    root: str
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False)
    interface: Interface = field(default=CLI, repr=False)

    @classmethod
    def under(
        cls, out: str, storage_options: Mapping[str, Any] | None, interface: Interface = CLI
    ) -> OutSpill:
        """A new spill of a build into ``out`` (its own random id)."""
        name = f"{SPILL_DIR}/{uuid.uuid4().hex}"
        root = f"{out.rstrip('/')}/{name}" if is_url(out) else os.path.join(out, *name.split("/"))
        return cls(root, storage_options, interface)

    @property
    def top(self) -> str:
        """``OUT/.shardprep-spill``: every build's spill."""
        return self.root.rsplit("/", 1)[0] if is_url(self.root) else os.path.dirname(self.root)

    def clear(self) -> None:
        """Remove this build's spill (nothing there: nothing to do).

        Raises:
            OutputError: it cannot be removed, naming it.
        """
        self._remove(self.root)
        if not is_url(self.root):  # (a prefix with no object left is gone by itself)
            try:
                os.rmdir(self.top)
            except OSError as err:  # another build's spill is there, or none was made
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    raise OutputError(
                        f"{self.top}: cannot remove the empty folder of the build's copy of "
                        f"the Parquet payloads ({err.strerror or err}); remove it yourself",
                        self.top,
                    ) from err

    def clear_all(self) -> None:
        """Remove every build's spill: what builds killed outright left in OUT.

        Raises:
            OutputError: it cannot be removed, naming it.
        """
        self._remove(self.top)

    def _remove(self, where: str) -> None:
        if not is_url(where):
            try:
                shutil.rmtree(where)
            except FileNotFoundError:
                return
            except OSError as err:
                raise OutputError(
                    f"{where}: cannot remove the build's copy of the Parquet payloads "
                    f"({err.strerror or err}); remove the folder yourself",
                    where,
                ) from err
            return
        fs, path = open_url(where, self.storage_options, self.interface)
        try:
            fs.invalidate_cache(path)
            if fs.find(path):
                fs.rm(path, recursive=True)
        except FileNotFoundError:
            return
        except Exception as err:  # a backend's own transport errors are not all OSErrors
            raise OutputError(
                f"{describe_error(where, err, self.interface)}; the build's copy of the "
                "Parquet payloads is left there: remove that prefix yourself",
                where,
            ) from err

    def open(self, location: str) -> Any:
        """A binary file to write the spill at ``location`` (below :attr:`root`) into.

        Raises:
            OutputError: it cannot be made, naming it.
        """
        if not is_url(location):
            os.makedirs(os.path.dirname(location), exist_ok=True)
            return open(location, "xb")  # noqa: SIM115 (the caller closes it)
        try:
            fs, path = open_url(location, self.storage_options, self.interface)
            return fs.open(path, "wb")
        except Exception as err:
            raise spill_write_error(location, err, self.interface) from err


def spill_write_error(location: str, err: BaseException, interface: Interface = CLI) -> OutputError:
    """The error of a spill object that cannot be written into OUT's store."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        what = f"no room ({err.strerror})"
    else:
        what = describe_error(location, err, interface).removeprefix(f"{location}: ")
    return OutputError(
        f"{location}: cannot write the build's copy of the Parquet payloads into OUT ({what}); "
        f"a Parquet build on a Ray cluster copies them there once: fix the cause, then "
        f"{interface.again()}",
        location,
    )
