"""One rank's view of its tensor-parallel group: its rank, the group's size, and the two collectives the
model needs (the sum after a row-parallel layer, the vocabulary shards of the logits)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
# How long a collective may wait for the other ranks. Generous: a rank that died is caught by the engine
# process watching the workers, not by this timeout; it only bounds a rank stuck with live peers.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


def backend_for(device: torch.device) -> str:
    return BACKENDS[torch.device(device).type]


@dataclass(frozen=True, slots=True, eq=False)
class TensorParallelGroup:
    rank: int
    size: int
    group: dist.ProcessGroup | None = None  # None = the default (world) group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; every rank ends with the same bits. -> x."""
        dist.all_reduce(x, group=self.group)
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (each rank calls it with its own)."""
        device = "cuda" if dist.get_backend(self.group) == BACKENDS["cuda"] else "cpu"
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's (..., n) -> (..., size * n), rank 0's columns first, on every rank."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def init_tensor_parallel(rank: int, size: int, device: torch.device, init_method: str) -> TensorParallelGroup:
    """Join the group of `size` ranks that meet at `init_method` (e.g. a file:// rendezvous)."""
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    return TensorParallelGroup(rank, size)
