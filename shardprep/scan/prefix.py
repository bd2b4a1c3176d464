"""RAW as a folder or as a URL prefix: what is at its top level, and a sorted walk below it.

The scanners and the layout detection see a local folder and an object-store prefix
(``s3://bucket/train``, ``gs://...``) the same way, so one rule set decides and reads both:

- :func:`top_level` is one folder's (or prefix's) direct names: ``os.scandir`` locally, one
  delimited listing (``fs.ls``) for a URL, whose first answer is awaited at most
  ``CONTACT_TIMEOUT_S`` in all (an endpoint that accepts connections and never answers
  fails here instead of after minutes of retries);
- :func:`walk_input` yields every file below a folder or prefix in the order of
  :func:`~shardprep.scan.walk.walk_files` (a folder's files by name, then its sub-folders by
  name; names starting with ``.`` skipped at any depth). For a URL it is one paginated
  listing with sizes (``fs.find(detail=True)``: S3 returns 1,000 objects per request), never
  a request per object.

Object stores have no folders: a "folder" is the common prefix of the keys below it, so an
empty folder does not exist and a prefix with no objects is both empty and missing.
"""

from __future__ import annotations

import os
import posixpath
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from shardprep.format.errors import InputError, ShardprepError
from shardprep.format.interface import CLI, Interface
from shardprep.format.threads import start_thread
from shardprep.scan.walk import FileEntry, Problems, is_skipped_name, walk_files
from shardprep.storage import describe_error, endpoint_hint, is_url, open_url

__all__ = [
    "CONTACT_TIMEOUT_S",
    "DOT_SEGMENTS",
    "TopLevel",
    "dot_segment_refusal",
    "first_files",
    "first_folder",
    "join",
    "top_level",
    "walk_input",
]

CONTACT_TIMEOUT_S = 30.0  # the first listing of a URL RAW, retries included
T = TypeVar("T")


@dataclass(frozen=True)
class TopLevel:
    """What is directly at RAW: one file (object), or a folder's non-hidden names, sorted."""

    is_file: bool
    files: list[tuple[str, int]] = field(default_factory=list)  # (name, size)
    folders: list[str] = field(default_factory=list)

    @property
    def file_names(self) -> list[str]:
        return [name for name, _size in self.files]


DOT_SEGMENTS = (".", "..")  # object-key segments no folder can hold: refused, never hidden


def dot_segment_refusal(url: str | None, prefix: bool = False) -> str:
    """Why an object whose key has a ``.`` or ``..`` segment is refused (``url``: the
    object, or with ``prefix`` the listing's ``.../../`` prefix, at the start of the
    message; None when the caller names it)."""
    what = "the keys of the objects under it have" if prefix else "the object's key has"
    return (
        f"{url + ': ' if url else ''}{what} a '.' or '..' path segment, which no folder can "
        "hold (it is not hidden, and a local copy would lose or move it); rename the "
        f"object{'s' if prefix else ''} or leave {'them' if prefix else 'it'} out of the input"
    )


def join(top: str, *names: str) -> str:
    """``top/name/...`` for a path or a URL (URLs always join with ``/``)."""
    if is_url(top):
        return "/".join([top.rstrip("/"), *names])
    return os.path.join(top, *names)


def top_level(
    raw: str, storage_options: Mapping[str, Any] | None = None, interface: Interface = CLI
) -> TopLevel:
    """The file at ``raw``, or the names directly in the folder or prefix ``raw``.

    Raises:
        InputError: ``raw`` does not exist (a URL prefix with no objects), or its storage
            cannot be reached or listed; the message names ``raw`` and what to check.
    """
    if is_url(raw):
        return _url_top_level(raw, storage_options, interface)
    if not os.path.exists(raw):
        raise InputError(f"{raw}: no such file or folder", raw)
    if os.path.isfile(raw):
        return TopLevel(is_file=True)
    files: list[tuple[str, int]] = []
    folders: list[str] = []
    with os.scandir(raw) as it:
        for entry in it:
            if is_skipped_name(entry.name):
                continue
            if entry.is_dir():
                folders.append(entry.name)
            else:
                files.append((entry.name, 0))  # sizes come from the walk, not needed here
    return TopLevel(False, sorted(files), sorted(folders))


def _url_top_level(
    url: str, storage_options: Mapping[str, Any] | None, interface: Interface = CLI
) -> TopLevel:
    fs, path = open_url(url, storage_options, interface)
    path = path.rstrip("/")
    try:
        entries = bounded(lambda: fs.ls(path, detail=True), url, interface=interface)
    except FileNotFoundError as err:
        if "bucket" in str(err).lower():
            raise InputError(describe_error(url, err, interface), url) from err
        raise InputError(
            f"{url}: no objects under this prefix (it is empty or does not exist); "
            "point RAW at the dataset",
            url,
        ) from err
    except ShardprepError:
        raise
    except Exception as err:  # a backend's transport errors are not all OSErrors
        raise InputError(describe_error(url, err, interface), url) from err
    files: list[tuple[str, int]] = []
    folders: list[str] = []
    for entry in entries:
        name = str(entry["name"]).rstrip("/")
        if name == path and entry.get("type") != "directory":
            return TopLevel(is_file=True)
        base = name.rsplit("/", 1)[-1]
        if base in DOT_SEGMENTS:
            folder = "/" if entry.get("type") == "directory" else ""
            where = f"{url.rstrip('/')}/{base}{folder}"
            raise InputError(dot_segment_refusal(where, bool(folder)), where)
        if not base or is_skipped_name(base) or name == path:
            continue
        if entry.get("type") == "directory":
            folders.append(base)
        else:
            files.append((base, int(entry.get("size") or 0)))
    return TopLevel(False, sorted(files), sorted(set(folders)))


def bounded(
    call: Callable[[], T], url: str, timeout: float | None = None, interface: Interface = CLI
) -> T:
    """``call()``, awaited at most ``timeout`` (default ``CONTACT_TIMEOUT_S``) seconds in all
    (``interface``: how the refusal names the storage options and the way to run again).

    On timeout the request is left to finish in a daemon thread (it only reads).

    Raises:
        InputError: no answer in time, naming ``url`` and what to check.
    """
    result: list[Any] = []

    def run() -> None:
        try:
            result.append((True, call()))
        except BaseException as err:  # handed to the caller's thread as it is
            result.append((False, err))

    thread = threading.Thread(target=run, name="shardprep-list", daemon=True)
    start_thread(thread)
    limit = CONTACT_TIMEOUT_S if timeout is None else timeout
    thread.join(limit)
    if not result:
        raise InputError(
            f"{url}: no answer from the storage within {limit:g} s; check the endpoint "
            f"({endpoint_hint(interface)}), the network and the credentials, then "
            f"{interface.again()}",
            url,
        )
    ok, value = result[0]
    if not ok:
        raise value
    answer: T = value
    return answer


def first_files(
    raw: str,
    storage_options: Mapping[str, Any] | None = None,
    top: TopLevel | None = None,
    interface: Interface = CLI,
) -> list[str] | None:
    """The file names of the first folder below ``raw`` that holds files, or None if none does.

    "First" in a sorted, top-down walk (a folder before its sub-folders, sub-folders by name),
    the order the scanners read in. Lists only as many folders as it takes (``top``: the top
    level of ``raw``, if the caller has it already).
    """
    found = first_folder(raw, storage_options, top, interface)
    return None if found is None else found[1]


def first_folder(
    raw: str,
    storage_options: Mapping[str, Any] | None = None,
    top: TopLevel | None = None,
    interface: Interface = CLI,
) -> tuple[str, list[str]] | None:
    """(its path, its file names) of the folder :func:`first_files` finds, or None."""
    top = top or top_level(raw, storage_options, interface)
    if top.files:
        return raw, top.file_names
    for folder in top.folders:
        found = first_folder(join(raw, folder), storage_options, None, interface)
        if found is not None:
            return found
    return None


def walk_input(
    top: str,
    problems: Problems,
    storage_options: Mapping[str, Any] | None = None,
    interface: Interface = CLI,
) -> Iterator[FileEntry]:
    """Every non-hidden file below the folder or URL prefix ``top``, in walk_files' order.

    A URL prefix that cannot be listed is recorded in ``problems``, as an unlistable folder is.
    """
    if not is_url(top):
        yield from walk_files(top, problems)
        return
    fs, path = open_url(top, storage_options, interface)
    path = path.rstrip("/")
    try:
        found = fs.find(path, detail=True)
    except Exception as err:  # a backend's transport errors are not all OSErrors
        problems.add(top, f"cannot list the prefix ({describe_error(top, err, interface)})")
        return
    tree = _Folder()
    for name, info in found.items():
        if info.get("type") != "file" or not name.startswith(path + "/"):
            continue
        rel = name[len(path) + 1 :]
        names = rel.split("/")
        if any(n in DOT_SEGMENTS for n in names):
            problems.add(f"{top.rstrip('/')}/{rel}", dot_segment_refusal(None))
            continue
        if any(not n or is_skipped_name(n) for n in names):
            continue  # hidden or OS junk (as in a local walk), or a "folder/" marker object
        folder = tree
        for n in names[:-1]:
            folder = folder.folders.setdefault(n, _Folder())
        folder.files[names[-1]] = int(info.get("size") or 0)
    yield from tree.walk("")


@dataclass
class _Folder:
    """A prefix's listing as a tree of names."""

    files: dict[str, int] = field(default_factory=dict)
    folders: dict[str, _Folder] = field(default_factory=dict)

    def walk(self, rel_dir: str) -> Iterator[FileEntry]:
        for name in sorted(self.files):
            yield FileEntry(rel_dir, name, self.files[name])
        for name in sorted(self.folders):
            yield from self.folders[name].walk(posixpath.join(rel_dir, name) if rel_dir else name)
