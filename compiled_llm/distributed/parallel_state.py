"""This process's place in its tensor-parallel group.

Every rank of one engine runs the same model code on its slice of the weights; the layers ask
here which slice is theirs. A process that never joins a group is rank 0 of 1, so single-device
code needs nothing from this module.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from compiled_llm.logger import init_logger

logger = init_logger(__name__)

# Long enough for a cold compile of every piece on a busy CPU, where ranks reach their first
# collective minutes apart; a rank that dies is noticed by its process, not by this timeout.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=20)


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler's side of a step: sampling, and the step's output."""
        return self.rank == 0


_group = TensorParallelGroup()


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: torch.device) -> None:
    """Join the group (gloo on CPUs, NCCL on GPUs) as `rank` of `world_size`."""
    global _group
    if world_size == 1:
        _group = TensorParallelGroup()
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    _group = TensorParallelGroup(rank, world_size, dist.group.WORLD)
    logger.info("Tensor parallel rank %d of %d (%s).", rank, world_size, backend)


def tensor_parallel() -> TensorParallelGroup:
    return _group


def destroy_tensor_parallel() -> None:
    global _group
    if _group.group is not None and dist.is_initialized():
        dist.destroy_process_group()
    _group = TensorParallelGroup()
