"""Build-time transforms (``--map MODULE:FUNCTION``, ``shardprep.build(..., map=fn)``).

A map is a function from one sample to the sample to write, run inside the write tasks (the
local worker processes or Ray tasks) just before the sample's members become tar records.

What the function receives: a new ``dict`` per sample, webdataset style, in write order::

    {"__key__": "000123",          # the sample key (str)
     "png": b"...",                # every data member, by extension, as bytes
     "json": b"...",               # the metadata (``meta.json`` if the sample has a .json part)
     "cls": b"3",                  # labelled inputs: the class index, ASCII, as written
     "weight": b"1.5"}             # with --weights-only: the weight, as written

What it must return: a dict with the same ``"__key__"`` and the same ``"cls"`` and ``"weight"``
values (present exactly when they were given); every other entry is a member to write, its
extension → bytes (``bytes``, ``bytearray`` or ``memoryview``). Members are written in the
returned dict's order, then ``cls``, then ``weight``. Anything else (another key, another
class, a payload that is not bytes, no member, an extension that is empty, starts with ``.``
or ``__`` or holds ``/`` or a control character) is refused with a :class:`MapError` naming
the sample and shard; so is an exception the function raises, ``SystemExit`` (``sys.exit``)
included (``KeyboardInterrupt`` is Ctrl-C: the build stops as interrupted), even one whose
``str()`` itself raises (it is named by its type). The build then stops; the shards already
finished are kept, and ``--resume`` (``resume=True``) with the same map name (the function
fixed in place) finishes the build: the builder ends the message with that advice
(:func:`shardprep.builder.map_error_advice`), saying how many finished shards are kept.
A map that ends its process itself (``os._exit``) cannot be caught: with one worker
(``--workers 1``, ``workers=1``) the build's own process ends there, exit status and all.

The manifest records the map as ``"map": "module:qualname"``; ``--resume`` compares that
name, not the function's code.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from typing import Any

from shardprep.format.errors import PlanError, WriteError
from shardprep.format.interface import PYTHON, Interface
from shardprep.format.shardformat import MAX_EXTENSIONS

__all__ = ["MapError", "SampleMap", "apply_map", "describe_exception", "load_map"]

KEY = "__key__"
KEPT = ("cls", "weight")  # shardprep's own members: a map must return them unchanged

Sample = dict[str, Any]


class MapError(WriteError):
    """A ``--map`` function raised, or returned a sample that cannot be written."""

    def __reduce__(self) -> tuple[object, ...]:
        return (MapError, (str(self), self.shard_index))


class SampleMap:
    """A map function and its name (``module:qualname``), picklable for spawned workers and Ray.

    It pickles by name when the name imports back to the same function, else by value through
    cloudpickle (a lambda or closure); a function that neither can carry is refused when pickled,
    the refusal naming ``--workers 1`` or ``workers=1`` as ``interface`` says.
    """

    __slots__ = ("fn", "interface", "name")

    def __init__(
        self, name: str, fn: Callable[[Sample], Any], interface: Interface = PYTHON
    ) -> None:
        self.name = name
        self.fn = fn
        self.interface = interface

    def __call__(self, sample: Sample) -> Any:
        return self.fn(sample)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SampleMap) and (self.name, self.fn) == (other.name, other.fn)

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"SampleMap({self.name!r})"

    def __deepcopy__(self, _memo: dict[int, Any]) -> SampleMap:
        return self  # immutable as far as shardprep is concerned (dataclasses.asdict copies)

    def __reduce__(self) -> tuple[object, ...]:
        if _importable(self.name, self.fn):
            return (_by_name, (self.name, self.interface))
        one_worker = self.interface.setting("workers", 1)
        pickler = _cloudpickle()
        if pickler is None:
            raise PlanError(
                f"map {self.name}: a lambda, closure or function defined in __main__ cannot be "
                "sent to worker processes without cloudpickle (pip install cloudpickle); define "
                f"it at the top level of an importable module, or use {one_worker}"
            )
        try:
            blob = pickler.dumps(self.fn)
        except Exception as err:
            raise PlanError(
                f"map {self.name}: cannot be sent to worker processes ({err}); define it at the "
                f"top level of an importable module, or use {one_worker}"
            ) from err
        return (_by_value, (self.name, blob, self.interface))


def _by_name(name: str, interface: Interface) -> SampleMap:
    return SampleMap(name, _lookup(name), interface)


def _by_value(name: str, blob: bytes, interface: Interface) -> SampleMap:
    # cloudpickle's output loads with pickle
    return SampleMap(name, pickle.loads(blob), interface)


def _cloudpickle() -> Any:
    try:
        import cloudpickle

        return cloudpickle
    except ImportError:
        try:
            from ray import cloudpickle as ray_cloudpickle

            return ray_cloudpickle
        except ImportError:
            return None


def _lookup(name: str) -> Any:
    """The object ``module:qual.name`` names (ImportError / AttributeError if none)."""
    module_name, _, qualname = name.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _importable(name: str, fn: object) -> bool:
    if "<" in name or name.startswith("__main__:"):  # <lambda>, f.<locals>.g, a script's own
        return False
    try:
        return _lookup(name) is fn
    except Exception:  # noqa: BLE001 - any failure to import it back means "not by name"
        return False


def load_map(
    spec: str | Callable[[Sample], Any] | SampleMap | None, interface: Interface = PYTHON
) -> SampleMap | None:
    """The :class:`SampleMap` for ``--map MODULE:FUNCTION`` or a callable (None for none).

    ``MODULE`` is imported as ``python -m`` would, with the current folder on ``sys.path``.
    ``interface``: messages name ``--map`` (the CLI) or ``map=`` (Python).

    Raises:
        PlanError: ``spec`` is not ``MODULE:FUNCTION``, does not import, or is not callable.
    """
    if spec is None or isinstance(spec, SampleMap):
        return spec
    if isinstance(spec, str):
        given = interface.setting("map", spec)
        module_name, colon, qualname = spec.partition(":")
        if not (colon and module_name and qualname):
            raise PlanError(f"{given}: give MODULE:FUNCTION, e.g. mypackage.prep:resize")
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            fn = _lookup(spec)
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # a module that calls sys.exit() as it is imported too
            raise PlanError(
                f"{given}: cannot import it ({describe_exception(err)}); MODULE must be "
                "importable from the current folder or the Python path, FUNCTION defined in it"
            ) from err
        if not callable(fn):
            raise PlanError(f"{given}: {type(fn).__name__} is not callable")
        return SampleMap(spec, fn, interface)
    if not callable(spec):
        raise PlanError(f"{interface.setting('map', spec)}: need a callable or 'MODULE:FUNCTION'")
    module = getattr(spec, "__module__", None) or type(spec).__module__
    qualname = getattr(spec, "__qualname__", None) or type(spec).__qualname__
    return SampleMap(f"{module}:{qualname}", spec, interface)


def apply_map(
    sample_map: SampleMap,
    key: str,
    members: list[tuple[str, bytes]],
    shard: int,
    source: str,
) -> list[tuple[str, bytes]]:
    """``members`` of sample ``key`` after ``sample_map``, checked (see the module doc).

    Raises:
        MapError: the function raised, or returned what cannot be written; names the sample
            and what went wrong (what to do is the builder's to add: it knows what is kept).
    """
    sample: Sample = {KEY: key}
    sample.update(members)
    kept = {ext: sample[ext] for ext in KEPT if ext in sample}
    where = f"shard {shard}: map {sample_map.name} on sample {key!r} (from {source!r})"
    try:
        result = sample_map(sample)
    except KeyboardInterrupt:
        raise  # Ctrl-C (or a map that raises it): the build's own interrupt handling
    except BaseException as err:  # SystemExit (sys.exit) too: it must not end the build quietly
        raise MapError(f"{where} raised {describe_exception(err)}{_place(err)}", shard) from err
    return _checked(result, key, kept, where, shard)


def describe_exception(err: BaseException) -> str:
    """``Type: message`` of ``err``; an exception whose ``str()`` raises is named by its type
    and what that raised, never by a second traceback."""
    try:
        text = str(err)
    except Exception as inner:  # noqa: BLE001 - a broken __str__ must not hide the error itself
        return f"{type(err).__name__} (its message cannot be shown: str() raised {type(inner).__name__})"
    return f"{type(err).__name__}: {text}"


def _place(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _checked(
    result: Any, key: str, kept: dict[str, bytes], where: str, shard: int
) -> list[tuple[str, bytes]]:
    def refuse(problem: str) -> MapError:
        return MapError(f"{where}: {problem}", shard)

    if not isinstance(result, dict):
        raise refuse(f"returned {type(result).__name__}, not a sample dict")
    if result.get(KEY) != key:
        raise refuse(f"changed the key {key!r} to {result.get(KEY)!r} (a map must keep {KEY})")
    count = sum(1 for ext in result if ext != KEY and ext not in KEPT)
    if count > MAX_EXTENSIONS:
        raise refuse(
            f"returned {count:,} members; a sample holds at most {MAX_EXTENSIONS:,} (a shard "
            "numbers its member extensions in 16 bits): put per-item data inside one member "
            "(an .npz, a .json, a .tar) instead of one member per item"
        )
    for ext in KEPT:
        if result.get(ext) != kept.get(ext):
            what = "class" if ext == "cls" else "weight"
            raise refuse(
                f"changed the {what} member {ext!r} from {kept.get(ext)!r} to "
                f"{result.get(ext)!r} (a map must return it unchanged)"
            )
    members: list[tuple[str, bytes]] = []
    for ext, value in result.items():
        if ext == KEY or ext in KEPT:
            continue
        if not isinstance(ext, str) or not ext or ext.startswith((".", "__")) or "/" in ext:
            raise refuse(
                f"returned the member name {ext!r} (need an extension such as 'jpg': not "
                "empty, no '/', not starting with '.' or '__')"
            )
        if any(ord(c) < 0x20 or c == "\x7f" for c in ext):
            raise refuse(
                f"returned the member name {ext!r}, which holds a control character (a tab, a "
                "newline, NUL...): name members with printable characters"
            )
        if not isinstance(value, bytes | bytearray | memoryview):
            hint = " (encode it, e.g. value.encode())" if isinstance(value, str) else ""
            raise refuse(f"returned {type(value).__name__} for member {ext!r}, not bytes{hint}")
        members.append((ext, bytes(value)))
    if not members:
        raise refuse("returned no member to write")
    members.extend((ext, kept[ext]) for ext in KEPT if ext in kept)
    return members
