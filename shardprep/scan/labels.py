"""The one label rule of every input path, and turning labels into class indices.

Every scanner (class-folder names aside: a folder is a class) hands each label value it
finds to :meth:`LabelTable.intern` with where it was found (file and row, or the sample's
key), so one rule decides for all of them (:func:`label_text`):

- an int (not a bool) is a class index: ``>= 0`` and at most :data:`MAX_CLASS_INDEX`;
- a str is a class name, as it is: not empty, no whitespace before or after it (``"cat"``,
  ``" cat"`` and ``"cat "`` are never merged into one class, nor told apart: refused); a
  decimal str (``"3"``, as a CSV or a ``.cls`` file holds them) is an index too;
- an index (an int or a decimal str) and a non-decimal name (``"cat"``, ``"-1"``, ``"+1"``)
  in one input are refused (naming the first place of each): numbering the names would
  silently renumber the indices (``"3"`` and ``"-1"`` would become classes 1 and 0);
- anything else (a float, a bool, None) is refused.

Once the scan is done the table decides the final mapping: if every label is a decimal
integer, that integer IS the class index (so existing WebDataset ``.cls`` values keep their
meaning) and the class names are ``"0" .. str(max)``; otherwise the names are sorted and
numbered from 0, as torchvision's ImageFolder does with folder names. Pure; no I/O.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import numpy.typing as npt

from shardprep.format.errors import InputError
from shardprep.inventory import InventorySink, InventoryView

__all__ = ["MAX_CLASS_INDEX", "LabelTable", "cls_file_text", "label_text"]

MAX_CLASS_INDEX = (1 << 20) - 1  # the manifest names every class from 0 to the largest index


def cls_file_text(data: bytes) -> str:
    """The label a ``.cls`` file or tar member holds: its UTF-8 text without the line end
    that ends a text file (``b"3\\n"`` → ``"3"``); other whitespace is kept for the rule.

    Raises:
        UnicodeDecodeError: not UTF-8 (the caller names the file).
    """
    text = data.decode("utf-8")
    return text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")


def label_text(
    value: Any,
    where: str,
    path: str | None = None,
    what: str = "label {}",
    error: type[InputError] = InputError,
) -> tuple[str, bool]:
    """The class text of one label ``value`` found at ``where`` and whether it was an int.

    ``what`` names the value in messages (``{}`` is replaced by its repr: ``"cls {}"``,
    ``"label {} in column 'y'"``); ``error`` is the class raised (a scanner's own).

    Raises:
        InputError: the value breaks the rule (module doc); the message starts with
            ``where`` and says what to do; ``path`` is the error's path.
    """
    named = what.format(repr(value))
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        index = int(value)
        if index < 0:
            raise error(
                f"{where}: {what.format(index)} is a negative class index; integer labels are "
                "class indices (>= 0): renumber them, or store the labels as strings (class "
                "names, numbered in sorted order)",
                path,
            )
        _check_index(index, where, path, what.format(index), error)
        return str(index), True
    if isinstance(value, str):
        if not value.strip():
            raise error(
                f"{where}: {named} is empty: a class name must not be; label every sample "
                "(or none)",
                path,
            )
        if value != value.strip():
            raise error(
                f"{where}: {named} has whitespace before or after it: class names are taken "
                "as they are (never merged with the name without it): remove the whitespace",
                path,
            )
        if value.isdecimal() and value.isascii():
            _check_index(int(value), where, path, named, error)
        return value, False
    raise error(
        f"{where}: {named} is a {type(value).__name__}, not an integer (a class index) or a "
        "string (a class name)",
        path,
    )


def _check_index(
    index: int, where: str, path: str | None, named: str, error: type[InputError]
) -> None:
    if index > MAX_CLASS_INDEX:
        raise error(
            f"{where}: {named} is a class index above {MAX_CLASS_INDEX:,} (the manifest lists "
            f"every class from 0 to the largest index, so it would need {index + 1:,} class "
            "names): renumber the classes from 0, or store them as non-numeric names",
            path,
        )


def _is_name(text: str) -> bool:
    return not (text.isdecimal() and text.isascii())


class LabelTable:
    """Interns label values (checked by :func:`label_text`), then maps them to class indices.

    Picklable: a scan task's table travels to the process that merges it (:meth:`merge`).
    """

    def __init__(self, error: type[InputError] = InputError) -> None:
        self._error = error  # the class raised: a scanner's own (ParquetInputError)
        self._ids: dict[str, int] = {}
        self._int_at: tuple[str, str | None] | None = None  # first index: (where, path)
        self._name_at: tuple[str, str | None] | None = None  # first non-decimal name
        self._int_kind = ""  # how the first index was given: "integer" or "decimal"

    def intern(
        self, value: Any, where: str, path: str | None = None, what: str = "label {}"
    ) -> int:
        """A provisional id for label ``value`` found at ``where`` (stable within one scan);
        ``what`` names it in messages (:func:`label_text`).

        Raises:
            InputError: the value breaks the label rule, or an index (an int or a decimal
                str) meets a class name.
        """
        text, is_int = label_text(value, where, path, what, self._error)
        name = _is_name(text)
        if not name and self._int_at is None:
            self._int_at, self._int_kind = (where, path), "integer" if is_int else "decimal"
            self._check_kinds()
        elif name and self._name_at is None:
            self._name_at = (where, path)
            self._check_kinds()
        return self._ids.setdefault(text, len(self._ids))

    def merge(self, other: LabelTable) -> npt.NDArray[np.int32]:
        """Take in ``other``'s labels (a scan task's, in input order): its provisional ids →
        this table's.

        Raises:
            InputError: an index (int or decimal str) in one table meets a class name in the
                other.
        """
        if self._int_at is None:
            self._int_at, self._int_kind = other._int_at, other._int_kind
        self._name_at = self._name_at or other._name_at
        self._check_kinds()
        return np.array([self._ids.setdefault(t, len(self._ids)) for t in other._ids], np.int32)

    def _check_kinds(self) -> None:
        if self._int_at is None or self._name_at is None:
            return
        (int_where, path), (name_where, _) = self._int_at, self._name_at
        kind = "an integer label" if self._int_kind == "integer" else "a decimal label"
        raise self._error(
            f"{int_where} has {kind} (a class index) and {name_where} a string class name "
            "(not a decimal number): numbering the names would renumber the indices; give "
            "every sample a class index (0, 1, 2 ...) or every sample a name that is not a "
            "decimal number ('c3' rather than '3')",
            path,
        )

    def __len__(self) -> int:
        return len(self._ids)

    def texts(self) -> list[str]:
        """The interned texts, by provisional id."""
        return list(self._ids)

    def finish(self) -> tuple[tuple[str, ...], npt.NDArray[np.int32]]:
        """Final (class names, provisional id → class index mapping)."""
        texts = list(self._ids)
        mapping = np.zeros(len(texts), dtype=np.int32)
        if texts and not any(_is_name(t) for t in texts):
            values = [int(t) for t in texts]
            names = tuple(str(i) for i in range(max(values) + 1))
            mapping[:] = values
            return names, mapping
        names = tuple(sorted(texts))
        position = {name: i for i, name in enumerate(names)}
        for provisional, text in enumerate(texts):
            mapping[provisional] = position[text]
        return names, mapping

    def freeze(self, builder: InventorySink) -> InventoryView:
        """The scanned inventory with final class indices, or unlabelled if no label was seen."""
        if not len(self):
            return builder.freeze(None)
        names, mapping = self.finish()
        builder.relabel(mapping)
        return builder.freeze(names)
