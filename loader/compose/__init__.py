"""Compose: several builds streamed as one (``mix``: fixed proportions per epoch; ``groups``:
datasets pinned to groups of ranks). No torch. Builds on ``loader.core.ShardStream``.
"""
