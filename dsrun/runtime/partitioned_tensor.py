"""DeepSpeed's ``deepspeed.runtime.utils.PartitionedTensor``: one tensor
split into equal flat parts across a process group, each rank keeping its
part, and gathered back whole on demand.

``PartitionedTensor(tensor, group)`` keeps this rank's part (the
boundaries of ``partition_uniform(numel, group size)``: the first
``numel % size`` parts one element longer); ``full()`` gathers the whole
tensor on every rank (collective); ``to_meta()`` encodes shape and
boundaries as a long tensor, from which ``PartitionedTensor.from_meta(meta,
local_part, group)`` rebuilds the object on a rank that received the part
- as DeepSpeed's pipeline engine sends partitioned activations.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from dsrun import comm


class PartitionedTensor:
    """A tensor split across ``group`` (module docstring)."""

    def __init__(self, tensor: torch.Tensor, group: Any,
                 partition_meta: Optional[torch.Tensor] = None) -> None:
        self.group = group
        self.num_parts = comm.get_world_size(group=group)
        self.rank = comm.get_rank(group=group)
        self.orig_size = list(tensor.size())
        self.orig_device: Any = tensor.device
        self.local_data, self.partition = self._partition_tensor(tensor)
        self.even_split = tensor.numel() % self.num_parts == 0

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group: Any,
                  device: Any = None) -> PartitionedTensor:
        """The partitioned tensor that ``meta`` (:meth:`to_meta` of the sender)
        describes, with ``local_part`` as this rank's part; ``full()``
        gathers onto ``device`` (default: the accelerator's)."""
        if meta.dtype != torch.long:
            raise TypeError(f"PartitionedTensor.from_meta: meta must be a torch.long tensor "
                            f"(to_meta()), got {meta.dtype}")
        values = meta.tolist()
        dims = values[0]
        orig_size, rest = values[1:1 + dims], values[1 + dims:]
        num_parts, rank, partition = rest[0], rest[1], rest[2:]
        size, here = comm.get_world_size(group=group), comm.get_rank(group=group)
        if (num_parts, rank) != (size, here) or len(partition) != num_parts + 1:
            raise ValueError(f"PartitionedTensor.from_meta: meta is for part {rank} of "
                             f"{num_parts}, this is rank {here} of a group of {size}")
        part = cls.__new__(cls)
        part.group, part.num_parts, part.rank = group, num_parts, rank
        part.orig_size = orig_size
        if device is None:
            from dsrun.accelerator import get_accelerator

            device = get_accelerator().device_name()
        part.orig_device = device
        part.local_data = local_part.detach()
        part.partition = partition
        part.even_split = math.prod(orig_size) % num_parts == 0
        return part

    def _partition_tensor(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        from dsrun.runtime.pipe.partition import uniform_bounds  # the pipe package imports us

        partition = list(uniform_bounds(tensor.numel(), self.num_parts))
        start = partition[self.rank]
        length = partition[self.rank + 1] - start
        part = tensor.detach().contiguous().view(-1).narrow(0, start, length).clone()
        return part, partition

    def full(self, device: Any = None) -> torch.Tensor:
        """The whole tensor, gathered from every rank's part (collective: every
        rank of the group calls it), on ``device`` (default: the original's)."""
        device = self.orig_device if device is None else device
        flat = torch.zeros([math.prod(self.full_size())], dtype=self.local_data.dtype,
                           device=device)
        if self.even_split:
            comm.all_gather_into_tensor(flat, self.local_data.to(device), group=self.group)
        else:  # unequal parts: each owner broadcasts its own
            for part_id in range(self.num_parts):
                start = self.partition[part_id]
                buf = flat.narrow(0, start, self.partition[part_id + 1] - start)
                if part_id == self.rank:
                    buf.copy_(self.local_data)
                comm.broadcast(buf, comm.get_global_rank(self.group, part_id), self.group)
        return flat.view(self.full_size())  # a fresh tensor: no copy needed

    def to_meta(self) -> torch.Tensor:
        """Shape, part count, this rank and the boundaries as a long tensor:
        ``[dims, *shape, num_parts, rank, *boundaries]`` (DeepSpeed's layout)."""
        meta = [len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition]
        return torch.tensor(meta, dtype=torch.long, device=self.orig_device)

    def data(self) -> torch.Tensor:
        """This rank's part (flat)."""
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full_size(self) -> list[int]:
        return self.orig_size
