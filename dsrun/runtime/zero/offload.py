"""ZeRO-Offload: optimizer state and parameter shards in host memory.

DeepSpeed's ``offload_optimizer {"device": "cpu"}`` keeps, on GPU ranks,
the fp32 master partitions, their gradient accumulators and the inner
optimizer's state in host memory and runs the optimizer step on the CPU;
``offload_param {"device": "cpu"}`` (stage 3) keeps each parameter's shard
there too. What crosses the bus per optimizer step is then the reduced
gradient partition (device to host, once per reduction bucket) and the
updated partition (host to device, once per group), as in the ZeRO-Offload
paper; with ``offload_param`` every gather first copies the shard to the
device.

:class:`Placement` is the one decision both ZeRO optimizers take from:
where the compute happens (``device``: the parameters' device), where the
masters live (``master_device``) and whether stage-3 shards live in host
memory (``offload_param``). On CPU ranks all three are the CPU and offload changes
nothing; the optimizers still take the same code path (separate master
tensors, explicit copies), which is what the CPU tests exercise.

``pin_memory`` pins the host tensors (page-locked, for faster and
asynchronous copies) when CUDA is available; elsewhere it is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

HOST = torch.device("cpu")


@dataclass(frozen=True)
class Placement:
    """Where one ZeRO optimizer keeps what (module docstring)."""

    device: torch.device
    offload_optimizer: bool = False
    offload_param: bool = False
    pin_memory: bool = False

    @property
    def master_device(self) -> torch.device:
        return HOST if self.offload_optimizer else self.device

    @property
    def offloads(self) -> bool:
        """True when something lives on the host that would otherwise be on
        an accelerator."""
        return (self.offload_optimizer or self.offload_param) and self.device.type != "cpu"


def pinning(pin_memory: bool) -> bool:
    return bool(pin_memory) and torch.cuda.is_available()


def host_copy(tensor: torch.Tensor, pin_memory: bool = False,
              dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A new host tensor with ``tensor``'s values (never a view of it),
    pinned when asked and possible."""
    out = torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device=HOST,
                      pin_memory=pinning(pin_memory))
    out.copy_(tensor)
    return out


def to_device(tensor: torch.Tensor, device: torch.device,
              dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``tensor`` on ``device`` (the same tensor when it is there already);
    a pinned source is copied asynchronously (the stream orders its use)."""
    if tensor.device == device and (dtype is None or tensor.dtype == dtype):
        return tensor
    return tensor.to(device=device, dtype=dtype, non_blocking=tensor.is_pinned())


def offload_settings(zero: Any, *, param: bool) -> dict[str, Any]:
    """``offload_optimizer``/``pin_memory`` (and, with ``param``,
    ``offload_param``) from a ``ZeroConfig``'s offload sections: device
    "cpu" is on; anything else is off (the engine refuses "nvme")."""
    out: dict[str, Any] = {}
    sections = [("offload_optimizer", getattr(zero, "offload_optimizer", None))]
    if param:
        sections.append(("offload_param", getattr(zero, "offload_param", None)))
    for name, section in sections:
        if section is not None and getattr(section, "device", None) == "cpu":
            out[name] = True
            out["pin_memory"] = out.get("pin_memory", False) or bool(section.pin_memory)
    return out
