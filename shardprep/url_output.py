"""A build's OUT at a URL, read back for ``inspect`` and ``verify``: its manifest, the sizes of
its objects (one listing) and local copies of a shard and its index (ranged parallel reads).

Every wait is bounded: the first request (the manifest) by ``CONTACT_TIMEOUT_S`` in all,
later ones by the storage's own settings (:mod:`shardprep.storage`). A copy reads at most
the bytes the manifest gives plus one (a larger object is reported, not read whole), in
ranges of ``RANGE_BYTES``, ``RANGES_AT_ONCE`` at a time (async backends such as s3fs send
them concurrently): at most ``RANGE_BYTES * RANGES_AT_ONCE`` bytes in memory per copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardprep.format.errors import ManifestError, ShardprepError
from shardprep.format.manifest import (
    JOURNAL_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    parse_manifest,
    read_manifest,
)
from shardprep.format.shardformat import MANIFEST_NAME
from shardprep.scan.prefix import bounded
from shardprep.storage import describe_error, is_url, open_url

__all__ = ["RANGE_BYTES", "RANGES_AT_ONCE", "RemoteOutput", "read_manifest_at"]

RANGE_BYTES = 8 << 20
RANGES_AT_ONCE = 4


def read_manifest_at(out: str, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """The manifest of the build in ``out``, a folder or a URL.

    Raises:
        ManifestError: missing (saying why: unfinished build, removed manifest, not a build)
            or invalid.
        InputError: the storage of a URL gives no answer in time.
    """
    if not is_url(out):
        return read_manifest(out)
    return RemoteOutput(out, storage_options).manifest()


class RemoteOutput:
    """The objects of a build's OUT at a URL."""

    def __init__(self, out: str, storage_options: Mapping[str, Any] | None) -> None:
        self.out = out.rstrip("/")
        self._fs, path = open_url(self.out, storage_options)
        self._root = path.rstrip("/")

    def url(self, name: str) -> str:
        return f"{self.out}/{name}"

    def manifest(self) -> Manifest:
        """The parsed manifest (see :func:`read_manifest_at`)."""
        url = self.url(MANIFEST_NAME)
        path = f"{self._root}/{MANIFEST_NAME}"
        try:
            data = bounded(
                lambda: self._fs.cat_file(path, start=0, end=MAX_MANIFEST_BYTES + 1), url
            )
        except FileNotFoundError as err:
            if "bucket" in str(err).lower():
                raise ManifestError(describe_error(url, err), url) from err
            raise ManifestError(f"{url}: no manifest; {self._why_no_manifest()}", url) from err
        except ShardprepError:
            raise
        except Exception as err:  # a backend's transport errors are not all OSErrors
            raise ManifestError(describe_error(url, err), url) from err
        return parse_manifest(bytes(data), url)

    def _why_no_manifest(self) -> str:
        """What a prefix without a manifest is, and the advice that works for it."""
        try:
            names = set(self.sizes())
        except Exception as err:  # a backend's transport errors are not all OSErrors
            return f"cannot list {self.out} ({describe_error(self.out, err)})"
        if JOURNAL_NAME in names:
            return "the build did not finish (run the same shardprep build command with --resume)"
        if any(name.startswith("shard-") for name in names):
            return (
                "the build did not finish or its manifest was removed, and no build journal is "
                "left to resume from: rebuild with shardprep build --overwrite"
            )
        return f"{self.out} is not the output of shardprep build (it holds no shards)"

    def read(self, name: str, limit: int) -> bytes:
        """The first ``limit`` bytes of object ``name`` (``versions/...`` included).

        Raises:
            FileNotFoundError: there is no such object.
            OSError: it cannot be read (the message names the URL).
        """
        path = f"{self._root}/{name}"
        try:
            return bytes(
                bounded(lambda: self._fs.cat_file(path, start=0, end=limit), self.url(name))
            )
        except FileNotFoundError:
            raise
        except ShardprepError as err:
            raise OSError(str(err)) from err
        except Exception as err:  # a backend's transport errors are not all OSErrors
            raise OSError(describe_error(self.url(name), err)) from err

    def sizes(self) -> dict[str, int]:
        """The size of every object directly under OUT, by name (one listing)."""
        try:
            entries = self._fs.ls(self._root, detail=True)
        except FileNotFoundError:
            return {}
        return {
            str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
            for e in entries
            if e.get("type") == "file"
        }

    def copy(self, name: str, size: int, dest: str) -> None:
        """Write the first ``size`` bytes of object ``name`` to the local file ``dest``.

        Raises:
            OSError: a read failed or the local write did (the message names the URL).
        """
        path = f"{self._root}/{name}"
        step = RANGE_BYTES * RANGES_AT_ONCE
        with open(dest, "wb") as f:
            for lo in range(0, size, step):
                starts = list(range(lo, min(size, lo + step), RANGE_BYTES))
                ends = [min(start + RANGE_BYTES, size) for start in starts]
                try:
                    data = self._fs.cat_ranges([path] * len(starts), starts, ends)
                except OSError as err:
                    raise OSError(err.errno, describe_error(self.url(name), err)) from err
                except Exception as err:  # a backend's transport errors are not all OSErrors
                    raise OSError(describe_error(self.url(name), err)) from err
                for chunk in data:
                    f.write(chunk)  # a short chunk (the object shrank) shows as a sha256 mismatch
                if sum(map(len, data)) < sum(e - s for s, e in zip(starts, ends, strict=True)):
                    return
