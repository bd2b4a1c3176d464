"""World: which rank and DataLoader worker this copy of the dataset is, as a plain value.

Partitioning takes a World so tests can enumerate every (rank, worker) in one
process. ``resolve_rank()`` reads the real rank when it is needed (when an
epoch starts, or ``len()`` is asked), never when the dataset is built: a
dataset made before ``init_process_group`` (in a LightningModule's
``__init__``, say) still splits by the rank it ends up running on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from loader.errors import WorldMismatchError

__all__ = ["World", "resolve_rank"]


@dataclass(frozen=True, slots=True)
class World:
    """Rank ``rank`` of ``world_size``; DataLoader worker ``worker`` of ``num_workers``.

    ``num_workers`` is at least 1: the main process counts as the one worker
    when the DataLoader has ``num_workers=0``.
    """

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise WorldMismatchError(
                f"rank {self.rank} is not in [0, world_size={self.world_size})"
            )
        if not 0 <= self.worker < self.num_workers:
            raise WorldMismatchError(f"worker {self.worker} is not in [0, {self.num_workers})")


def worker_info() -> tuple[int, int] | None:
    """(worker id, number of workers) of this DataLoader worker; None in the main process."""
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    return None if info is None else (info.id, info.num_workers)


def resolve_rank(
    rank: int | None, world_size: int | None, inherited: tuple[int, int] | None = None
) -> tuple[int, int]:
    """(rank, world_size) now: explicit values, else torch.distributed, else the parent's, else (0, 1).

    ``inherited`` is what the main process had resolved when it handed the
    dataset to a spawned DataLoader worker (which has no process group).

    Raises:
        WorldMismatchError: only one of rank/world_size given, or the process
            was launched as one of several ranks (``WORLD_SIZE`` > 1) but
            ``torch.distributed`` is not initialized yet: guessing rank 0
            would give every rank the same data.
    """
    if (rank is None) != (world_size is None):
        raise WorldMismatchError("pass both rank and world_size, or neither")
    if rank is not None and world_size is not None:
        World(rank, world_size)  # validates
        return rank, world_size
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if inherited is not None:
        return inherited
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1:
        raise WorldMismatchError(
            f"this process was launched as one of WORLD_SIZE={launched} ranks, but "
            "torch.distributed is not initialized yet, so its rank is unknown: iterate (or ask "
            "len()) after init_process_group, or pass rank= and world_size= explicitly"
        )
    return 0, 1
