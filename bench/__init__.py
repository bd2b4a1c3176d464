"""Benchmark suite for shardprep against its peers (not part of the tests).

Run ``python -m bench all --quick``; see ``bench/README.md``.
"""
