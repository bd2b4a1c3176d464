"""Benchmark-only stand-in for torchvision (see bench/peers/mds.py).

Only put on ``sys.path`` inside MDS benchmark subprocesses. ``import streaming``
imports ``streaming.vision``, which needs these two names at import time; the
benchmark never calls them (it stores raw bytes columns).
"""

from __future__ import annotations

__version__ = "0.0.0+bench-stub"
