"""Turning label values found in the input into class indices and names.

Scanners intern each distinct label text as it appears; once the scan is done
the table decides the final mapping. Pure; no I/O.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from shardprep.inventory import InventorySink, InventoryView

__all__ = ["LabelTable"]


class LabelTable:
    """Interns label texts, then maps them to class indices.

    If every label is a non-negative decimal integer, that integer IS the class
    index (so existing WebDataset ``.cls`` values keep their meaning) and the
    class names are ``"0" .. str(max)``. Otherwise the names are sorted and
    numbered from 0, as torchvision's ImageFolder does with folder names.
    """

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def intern(self, text: str) -> int:
        """A provisional id for ``text`` (stable within one scan)."""
        return self._ids.setdefault(text.strip(), len(self._ids))

    def __len__(self) -> int:
        return len(self._ids)

    def texts(self) -> list[str]:
        """The interned texts, by provisional id."""
        return list(self._ids)

    def finish(self) -> tuple[tuple[str, ...], npt.NDArray[np.int32]]:
        """Final (class names, provisional id → class index mapping)."""
        texts = list(self._ids)
        mapping = np.zeros(len(texts), dtype=np.int32)
        if texts and all(t.isdecimal() and t.isascii() for t in texts):
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
