"""World: which rank and DataLoader worker this copy of the dataset is, as a plain value.

Partitioning takes a World so tests can enumerate every (rank, worker) in one
process. Where the real rank and worker come from (``torch.distributed`` and the
DataLoader) is the torch layer's business (``loader.torch.layer.resolve_rank``).
"""

from __future__ import annotations

from dataclasses import dataclass

from loader.errors import WorldMismatchError

__all__ = ["World"]


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
