"""World: which rank and DataLoader worker this copy of the dataset is, as a plain value.

Partitioning takes a World so tests can enumerate every (rank, worker) in one
process; ``detect_rank()`` and ``World.for_worker()`` read the real values from
``torch.distributed`` and ``torch.utils.data.get_worker_info()``.
"""

from __future__ import annotations

from dataclasses import dataclass

from loader.errors import WorldMismatchError

__all__ = ["World", "detect_rank"]


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

    @classmethod
    def for_worker(cls, rank: int, world_size: int) -> World:
        """This process's World: the given rank plus the DataLoader worker, if any."""
        import torch.utils.data

        info = torch.utils.data.get_worker_info()
        if info is None:
            return cls(rank, world_size, 0, 1)
        return cls(rank, world_size, info.id, info.num_workers)


def detect_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): explicit values win, else torch.distributed, else (0, 1).

    Raises:
        WorldMismatchError: only one of the two is given, or they disagree.
    """
    if (rank is None) != (world_size is None):
        raise WorldMismatchError("pass both rank and world_size, or neither")
    if rank is not None and world_size is not None:
        World(rank, world_size)  # validates
        return rank, world_size
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
