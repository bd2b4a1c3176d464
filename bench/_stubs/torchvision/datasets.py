"""Stub: ``VisionDataset`` is subclassed by ``streaming.vision`` at import."""

from __future__ import annotations

from typing import Any


class VisionDataset:
    """Placeholder base class; never instantiated by the benchmark."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("torchvision stub: VisionDataset is not available in bench runs")


class CIFAR10(VisionDataset):
    """Placeholder (imported by streaming.vision.convert only)."""
