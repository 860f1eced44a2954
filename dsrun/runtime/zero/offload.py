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

**Copies across the bus** (:class:`Landing`, :class:`HostFence`), on a GPU
rank with host-resident accumulators and masters:

* device -> host (gradients): issued on a side stream that first waits for
  the compute stream (so the source is ready), ``non_blocking`` into pinned
  memory; the source is ``record_stream``-ed on the side stream (the caching
  allocator does not hand its memory out again before the copy is done),
  and one event per copy is what :meth:`Landing.wait` synchronises the host
  on before anything on the host reads the result. A copy that must be
  *added* to the accumulator lands in a pinned staging tensor first; the
  add runs on the host in :meth:`Landing.wait`. Backward keeps running on
  the compute stream meanwhile.
* host -> device (updated parameters): ``non_blocking`` from pinned memory
  on the compute stream (the next forward is ordered after it), followed by
  an event; :meth:`HostFence.wait` synchronises on it before the host writes
  those pinned tensors again (the next optimizer step).

On CPU ranks both are plain synchronous copies/adds (same device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

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


def copy_stream(device: torch.device, direction: str = "h2d") -> Any:
    """The side stream for copies in ``direction`` ("h2d": host to device,
    "d2h") on CUDA ``device``: one per direction, so the two directions run
    on the GPU's separate copy engines at once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get((index, direction))
    if stream is None:
        stream = _STREAMS[(index, direction)] = torch.cuda.Stream(index)
    return stream


_STREAMS: dict[tuple[int, str], Any] = {}


class _InFlight(NamedTuple):
    """A device -> host copy issued and not yet waited for."""

    event: Any                          # torch.cuda.Event recorded after the copy
    device: torch.device                # the copy's source device
    target: Optional[torch.Tensor]      # add ``staged`` into it on wait (None: copied in place)
    staged: Optional[torch.Tensor]


class Landing:
    """Gradient data into fp32 accumulators (module docstring, "device ->
    host"): :meth:`put` copies or adds ``src`` into ``dst``; :meth:`wait`
    makes every put complete on the host."""

    def __init__(self) -> None:
        self._inflight: list[_InFlight] = []

    @torch.no_grad()
    def put(self, dst: torch.Tensor, src: torch.Tensor, add: bool) -> None:
        """``dst += src`` (``add``) or ``dst = src``; shapes equal, dtypes may differ."""
        if src.device == dst.device or src.device.type != "cuda":
            if add:
                dst.add_(src)
            else:
                dst.copy_(src)
            return
        stream = copy_stream(src.device, "d2h")
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            staged = None
            if add:
                staged = torch.empty(dst.shape, dtype=dst.dtype, pin_memory=True)
                staged.copy_(src, non_blocking=True)
            else:
                dst.copy_(src, non_blocking=True)
            src.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        self._inflight.append(_InFlight(event, src.device, dst if add else None, staged))

    @property
    def pending(self) -> bool:
        return bool(self._inflight)

    def before_reuse(self) -> None:
        """Make the compute stream wait (on the device: the host goes on)
        for the copies issued so far: call before the compute stream writes
        memory they read (a reused bucket buffer)."""
        if self._inflight:
            last = self._inflight[-1]  # the side stream runs them in order
            torch.cuda.current_stream(last.device).wait_event(last.event)

    @torch.no_grad()
    def wait(self) -> None:
        """Block until every copy is done; run the deferred adds."""
        inflight, self._inflight = self._inflight, []
        for item in inflight:
            item.event.synchronize()
            if item.target is not None:
                item.target.add_(item.staged)


class HostFence:
    """Pinned host tensors read by ``non_blocking`` host -> device copies
    must not be written before the copies are done (module docstring)."""

    def __init__(self) -> None:
        self._event: Any = None

    def after_copies(self, device: torch.device) -> None:
        """Mark the end of the host -> device copies just issued on ``device``."""
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))

    def wait(self) -> None:
        """Before the host writes the source tensors again."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
