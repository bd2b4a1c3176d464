"""Deterministic random generators derived from a key tuple, shared by builder and loader.

Every random decision takes its generator from ``derive_rng(seed, purpose,
*numbers)``, so decisions made for different purposes, epochs, ranks or workers
never share a stream, and the same key always gives the same stream on every
machine (numpy's PCG64 and SeedSequence are platform-independent).
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

__all__ = ["derive_rng"]


def derive_rng(seed: int, purpose: str, *numbers: int) -> np.random.Generator:
    """A generator keyed by ``(seed, purpose, *numbers)``; all must be non-negative ints."""
    return np.random.Generator(
        np.random.PCG64(np.random.SeedSequence([seed, _tag(purpose), *numbers]))
    )


@functools.lru_cache(maxsize=64)
def _tag(purpose: str) -> int:
    """The 64-bit number standing for ``purpose`` (a few fixed names: cached)."""
    return int.from_bytes(hashlib.sha256(purpose.encode()).digest()[:8], "little")
