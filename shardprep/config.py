"""BuildConfig: every knob of ``shardprep build``, its default, and its validation.

The CLI options mirror these fields one to one (``--zstd-level`` ↔ ``zstd_level``).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from shardprep.format.errors import PlanError
from shardprep.format.interface import PYTHON, Interface
from shardprep.format.storage_options import merge_options
from shardprep.transform import load_map

__all__ = ["BuildConfig", "default_workers"]

COMPRESSIONS = ("none", "zstd")
ENGINES = ("local", "ray")


def default_workers() -> int:
    """CPUs this process may run on (respects taskset/cgroup affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """Options of one build. Fields that change the output bytes are listed in ``output_options``.

    ``workers``, ``engine``, ``ray_address``, ``stall_timeout``, ``overwrite``, ``resume``,
    ``append``, ``progress``, ``interface`` and the storage options change how the build runs,
    never what it writes. ``interface`` is how messages name options (``--shards`` for the CLI,
    ``shards=`` for Python: :mod:`shardprep.format.interface`).
    Storage options are fsspec's, for a RAW or OUT given as a URL (and URLs in a listing):
    ``storage_options`` apply to both, ``raw_storage_options`` to the input only and
    ``out_storage_options`` to OUT only, each on top of ``storage_options`` (one key deep,
    :func:`~shardprep.format.storage_options.merge_options`). With ``--engine ray`` they are
    sent to the tasks, so credentials given as options travel to the cluster's nodes.
    """

    shards: int
    seed: int = 0
    compression: str = "none"
    zstd_level: int = 3
    input_format: str = "auto"
    path_column: str = "path"
    label_column: str | None = None
    key_column: str | None = None  # Parquet input: the column with each row's key
    class_weights: str | None = None
    num_samples: int | None = None
    keep_all: bool = False
    weights_only: bool = False
    allow_zero_weights: bool = False
    workers: int | None = None
    engine: str = "local"
    ray_address: str | None = None
    stall_timeout: float = 1800.0  # seconds without any written sample before the build stops
    overwrite: bool = False
    resume: bool = False
    append: bool = False  # add to the build in OUT as its next version (docs/pipelines.md)
    progress: bool = True
    storage_options: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    raw_storage_options: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    out_storage_options: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    # --map: "MODULE:FUNCTION" or a callable, made a transform.SampleMap (recorded by name)
    map: Any = None
    # how messages name options: --shards (the CLI passes interface.CLI) or shards= (Python)
    interface: Interface = field(default=PYTHON, compare=False, repr=False)

    def __post_init__(self) -> None:
        # PlanError if the map does not import
        object.__setattr__(self, "map", load_map(self.map, self.interface))
        o = self.interface.option  # messages name --shards on the CLI, shards= in Python
        if self.shards < 1:
            raise PlanError(f"{o('shards')} must be at least 1 (got {self.shards})")
        if self.seed < 0:
            raise PlanError(f"{o('seed')} must be a non-negative integer (got {self.seed})")
        if self.compression not in COMPRESSIONS:
            raise PlanError(f"{o('compression')} must be one of {', '.join(COMPRESSIONS)}")
        if not 1 <= self.zstd_level <= 22:
            raise PlanError(f"{o('zstd_level')} must be between 1 and 22 (got {self.zstd_level})")
        if self.workers is not None and self.workers < 1:
            raise PlanError(f"{o('workers')} must be at least 1 (got {self.workers})")
        if self.engine not in ENGINES:
            raise PlanError(
                f"{o('engine')} must be one of {', '.join(ENGINES)} (got {self.engine!r})"
            )
        if self.ray_address is not None and self.engine != "ray":
            raise PlanError(f"{o('ray_address')} needs {self.interface.setting('engine', 'ray')}")
        if not self.stall_timeout > 0:
            raise PlanError(f"{o('stall_timeout')} must be positive (got {self.stall_timeout})")
        if self.num_samples is not None and self.num_samples < 1:
            raise PlanError(f"{o('num_samples')} must be at least 1 (got {self.num_samples})")
        if self.overwrite and self.resume:
            raise PlanError(f"{o('overwrite')} and {o('resume')} exclude each other")
        if self.overwrite and self.append:
            raise PlanError(f"{o('overwrite')} and {o('append')} exclude each other")
        weight_flags = self.num_samples is not None or self.keep_all or self.weights_only
        if weight_flags and self.class_weights is None:
            raise PlanError(
                f"{o('num_samples')}, {o('keep_all')} and {o('weights_only')} need "
                f"{o('class_weights')}"
            )
        if self.keep_all and self.weights_only:
            raise PlanError(f"{o('keep_all')} and {o('weights_only')} exclude each other")
        if self.num_samples is not None and self.weights_only:
            raise PlanError(f"{o('num_samples')} and {o('weights_only')} exclude each other")

    def output_options(self) -> dict[str, Any]:
        """The options recorded in the manifest: exactly those that affect the output bytes."""
        runtime = {
            "workers",
            "engine",
            "ray_address",
            "stall_timeout",
            "overwrite",
            "resume",
            "append",
            "progress",
            "storage_options",
            "raw_storage_options",
            "out_storage_options",
            "interface",
        }
        options = {k: v for k, v in asdict(self).items() if k not in runtime and k != "map"}
        if self.key_column is None:  # absent unless given: manifests of other builds unchanged
            del options["key_column"]
        if self.map is not None:  # absent without --map: manifests of plain builds unchanged
            options["map"] = self.map.name
        return options

    def raw_options(self) -> dict[str, Any] | None:
        """fsspec options for RAW (and URLs it lists): ``storage_options`` then the RAW ones."""
        return _both(self.storage_options, self.raw_storage_options)

    def out_options(self) -> dict[str, Any] | None:
        """fsspec options for OUT: ``storage_options`` then the OUT ones."""
        return _both(self.storage_options, self.out_storage_options)

    def cluster_address(self) -> str | None:
        """The Ray cluster a ``--engine ray`` build joins (``ray_address``, else ``RAY_ADDRESS``);
        None: a local Ray instance on this machine."""
        return self.ray_address or os.environ.get("RAY_ADDRESS") or None

    def num_workers(self) -> int:
        """Worker processes to use: never more than shards."""
        return min(self.workers or default_workers(), self.shards)


def _both(common: dict[str, Any] | None, own: dict[str, Any] | None) -> dict[str, Any] | None:
    if not own:
        return common
    return merge_options(common or {}, own)
