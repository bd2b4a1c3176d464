"""Pieces shared by every peer so that all systems are measured alike."""

from __future__ import annotations

import hashlib
import math
from typing import Any

# Field names that hold the payload in each system's sample dict.
# webdataset/shardprep: the file extension; MDS/LitData: "data" (our column).
PAYLOAD_KEYS = ("data", "bin", "jpg", "json", "npy")


def payload(sample: Any) -> bytes:
    """Return the payload of one sample as ``bytes`` (memoryview -> bytes)."""
    if isinstance(sample, dict):
        for k in PAYLOAD_KEYS:
            if k in sample:
                return bytes(sample[k])
        raise KeyError(f"no payload field in sample keys {sorted(sample)}")
    return bytes(sample)


def collate(samples: list[Any]) -> list[bytes]:
    """The one collate used for every system: each sample -> its payload bytes.

    It runs inside DataLoader workers, so it also turns LitData's memoryviews
    (which cannot be pickled back to the main process) into bytes.
    """
    return [payload(s) for s in samples]


def collate_ident(samples: list[Any]) -> list[tuple[str, bool]]:
    """DDP-check collate: ``(sha1 of payload, is_padded)`` per sample."""
    out = []
    for s in samples:
        padded = bool(isinstance(s, dict) and s.get("__padded__", False))
        out.append((hashlib.sha1(payload(s)).hexdigest(), padded))
    return out


def per_shard(n: int, shards: int) -> int:
    """Samples per shard for count-limited writers (webdataset)."""
    return max(1, math.ceil(n / shards))


def bytes_per_shard(total: int, n: int, shards: int) -> int:
    """Byte limit per shard/chunk for size-limited writers (MDS, LitData).

    Adds ~2% plus a per-sample allowance for headers so the writer produces
    about ``shards`` files, like shardprep's ``--shards N``.
    """
    return int(math.ceil((total + 64 * n) / shards) * 1.02) + 1
