"""Sample-key rules: turn a source name into a key that WebDataset groups correctly.

WebDataset splits a member name at the first dot after the last slash into
``key`` and ``extension``, and treats names starting with ``_`` specially. A
key is therefore restricted to ``[A-Za-z0-9_-]``, must not start with ``_``
and must not be empty. Pure functions; no I/O.
"""

from __future__ import annotations

import re

__all__ = ["KEY_BYTES_TABLE", "is_valid_key", "key_from_stem", "split_name"]

_VALID = re.compile(r"[A-Za-z0-9-][A-Za-z0-9_-]*")
_SAFE_BYTES = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-/")
KEY_BYTES_TABLE = bytes(b if b in _SAFE_BYTES else ord("_") for b in range(256))
"""``bytes.translate`` table: keeps key characters and ``/``, maps every other byte to ``_``.

On ASCII names, translating then replacing ``/`` by ``__`` (and prefixing ``k``
to a leading ``_``) gives exactly :func:`key_from_stem`'s result.
"""
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def is_valid_key(key: str) -> bool:
    """True if ``key`` can be used unchanged as a WebDataset sample key."""
    return _VALID.fullmatch(key) is not None


def key_from_stem(stem: str) -> str:
    """Deterministically map a relative source stem (``cat/img.01``) to a safe key.

    ``/`` becomes ``__``, every other character outside ``[A-Za-z0-9_-]``
    becomes ``_``, and a key that would start with ``_`` gets a ``k`` prefix.
    Different stems can map to the same key; the scan detects that and
    reports both sources (``DuplicateKeyError``).
    """
    if _VALID.fullmatch(stem):
        return stem
    key = _UNSAFE.sub("_", stem.replace("/", "__"))
    if key.startswith("_") or not key:
        key = "k" + key
    return key


def split_name(name: str) -> tuple[str, str]:
    """Split a file name into (stem, extension) at its FIRST dot, as WebDataset does.

    ``0001.seg.png`` → (``0001``, ``seg.png``). A name without a dot, or one
    starting with a dot, has an empty extension.
    """
    dot = name.find(".", 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]
