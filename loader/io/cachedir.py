"""Cache folder: where the remote-shard cache lives under ``cache_dir``, the names it owns
there, and the checks made before it writes anything (``loader.io.cache`` does the I/O).

The cache owns one folder, ``cache_dir/shardprep-cache/``, marked by a
``CACHEDIR.TAG`` that names the layout, and nothing else under ``cache_dir``::

    cache_dir/shardprep-cache/
        CACHEDIR.TAG                    marker (layout 1)
        .evict.lock                     held while room is made or a file renamed
        <16 hex: URL + manifest>/       one folder per output (a rebuilt output gets a new one)
            shard-00007.tar             a cached file, under its manifest name
            shard-00007.tar.ok          its stamp: sha256 and file identity when verified
            shard-00007.tar.lock        flock: one download at a time
            .shard-00007.tar.<pid>.<n>.part   a download in progress

Only names of that form, as plain files (never through a symlink) inside
output folders of that form, are ever counted or deleted. A ``cache_dir``
that is empty or a file, a ``shardprep-cache`` that is not a cache of this
layout, a folder of the cache that is a symlink or belongs to another user:
each is refused with a ``ValueError`` naming it.
"""

from __future__ import annotations

import itertools
import os
import re
import stat
from collections.abc import Iterator

__all__ = [
    "CACHE_FOLDER",
    "EVICT_LOCK",
    "LOCK",
    "MARKER",
    "MARKER_TEXT",
    "PART",
    "STAMP",
    "cache_bytes",
    "check_cache_dir",
    "check_folder",
    "check_home",
    "file_size",
    "own_entries",
    "own_parts",
]

CACHE_FOLDER = "shardprep-cache"
MARKER = "CACHEDIR.TAG"
LAYOUT = 1
MARKER_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    f"# shardprep cache, layout {LAYOUT}: remote shards kept by shardprep's loader.\n"
    "# Delete this folder to empty the cache (no job may be reading through it).\n"
)
PART = ".part"
LOCK = ".lock"
STAMP = ".ok"
EVICT_LOCK = ".evict.lock"
_OUTPUT_FOLDER = re.compile(r"[0-9a-f]{16}")
_NAME = r"shard-\d{5,}\.(?:tar|tar\.zst|idx)"  # shardformat.shard_name / index_name
_ENTRY = re.compile(_NAME)
_PART = re.compile(rf"\.({_NAME})\.\d+\.\d+\.part")


def check_cache_dir(cache_dir: object) -> None:
    """Refuse a ``cache_dir`` the cache cannot own safely; touches nothing.

    Raises:
        ValueError: ``cache_dir`` is not a str, is empty, is a file, or its
            ``shardprep-cache`` entry is a file, a folder of files that is not a
            shardprep cache, or a cache of another layout (the message says what to do).
    """
    if isinstance(cache_dir, os.PathLike):
        cache_dir = os.fspath(cache_dir)
    if not isinstance(cache_dir, str):
        raise ValueError(f"RemoteOptions.cache_dir must be a folder path (str), not {cache_dir!r}")
    if not cache_dir.strip():
        raise ValueError(
            f"RemoteOptions.cache_dir={cache_dir!r} is empty: give the folder to keep cached "
            "shards in (e.g. '/tmp/shardprep'), or None to read without a cache"
        )
    if "\0" in cache_dir:
        raise ValueError(f"RemoteOptions.cache_dir={cache_dir!r} holds a NUL character")
    if os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
        raise ValueError(
            f"RemoteOptions.cache_dir={cache_dir!r} is a file, not a folder: give a folder "
            f"(the cache keeps its files in {os.path.join(cache_dir, CACHE_FOLDER)!r})"
        )
    check_home(os.path.join(cache_dir, CACHE_FOLDER))


def check_home(home: str) -> None:
    """``home`` is absent, empty (being made), or a shardprep cache of this layout."""
    if not os.path.lexists(home):
        return
    if os.path.islink(home) and not os.path.isdir(home):
        raise ValueError(f"{home}: a broken symlink; remove it or choose another cache_dir")
    if not os.path.isdir(home):
        raise ValueError(
            f"{home}: a file is in the way of the cache folder; move it or choose another cache_dir"
        )
    _check_owner(home)
    try:
        with open(os.path.join(home, MARKER), "rb") as f:
            text = f.read(len(MARKER_TEXT) + 1).decode("utf-8", "replace")
    except FileNotFoundError:
        if os.listdir(home):
            raise ValueError(
                f"{home}: holds files but is not a shardprep cache (no {MARKER}); the cache "
                "never deletes files it did not make: move them away or choose another "
                "cache_dir"
            ) from None
        return
    if not MARKER_TEXT.startswith(text):  # a prefix: another process is writing it right now
        raise ValueError(
            f"{home}: {MARKER} is not the one of a shardprep cache of layout {LAYOUT} (made by "
            "another tool or shardprep version?); delete that folder or choose another cache_dir"
        )


def check_folder(folder: str) -> None:
    """``folder`` (an output's folder in the cache) is a real folder, not a link to one: the
    cache deletes and replaces files named like shards in it."""
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode):
        what = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a folder"
        raise ValueError(
            f"{folder}: {what} where the cache keeps an output's files; the cache never "
            "writes or deletes through links: remove it (the cache makes the folder again)"
        )
    _check_owner(folder)


def _check_owner(folder: str) -> None:
    """``folder`` belongs to this user: in a folder another user owns (a shared ``/tmp``),
    that user could swap files or links under the cache between its checks and its uses."""
    owner = os.lstat(folder).st_uid
    if owner != os.geteuid():
        raise ValueError(
            f"{folder}: owned by another user (uid {owner}), who could change what the cache "
            "reads and deletes there; choose a cache_dir of your own"
        )


def cache_bytes(cache_dir: str | os.PathLike[str]) -> int:
    """Bytes of the cache in ``cache_dir``: cached files and downloads in progress (not stamps,
    locks or anything that is not the cache's)."""
    home = os.path.join(cache_dir, CACHE_FOLDER)
    return sum(file_size(p) for p in itertools.chain(own_entries(home), own_parts(home)))


def _own_files(home: str, pattern: re.Pattern[str]) -> Iterator[str]:
    """Plain files (not symlinks) named like ``pattern`` in the output folders of ``home``."""
    try:
        outputs = list(os.scandir(home))
    except (FileNotFoundError, NotADirectoryError):
        return
    for output in outputs:
        if not (_OUTPUT_FOLDER.fullmatch(output.name) and output.is_dir(follow_symlinks=False)):
            continue
        try:
            files = list(os.scandir(output.path))
        except FileNotFoundError:
            continue
        for f in files:
            if pattern.fullmatch(f.name) and f.is_file(follow_symlinks=False):
                yield f.path


def own_entries(home: str) -> Iterator[str]:
    return _own_files(home, _ENTRY)


def own_parts(home: str) -> Iterator[str]:
    return _own_files(home, _PART)


def file_size(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0
