"""Stub: ``to_tensor`` is imported (not called) by ``streaming.vision``."""

from __future__ import annotations

from typing import Any


def to_tensor(pic: Any) -> Any:
    """Never called in bench runs."""
    raise RuntimeError("torchvision stub: to_tensor is not available in bench runs")
