"""Flat buffers: a group's tensors as views of one contiguous tensor.

ZeRO's per-step work is per *group*, not per parameter, when the tensors it
touches are views of one flat buffer:

* :func:`flatten_into` makes parameters (or stage-3 shards) views of one
  flat tensor at given offsets (padding zero), so a collective, a cast or
  an optimizer step is one operation on the whole group.
* :class:`FlatGrads` binds every parameter's ``.grad`` to a view of one
  flat gradient tensor. Autograd's ``AccumulateGrad`` adds a new gradient
  *in place* into an existing ``.grad`` (outside ``create_graph``), so
  backward writes straight into the flat buffer: no hook, no copy, no
  Python per parameter. DDP's ``gradient_as_bucket_view`` relies on the same
  contract.
* :func:`alias_or_copy` gives the fp32 master of a flat range: the range
  itself when it already is fp32 on the master's device (nothing to copy
  before or after a step), else a separate fp32 tensor (pinned on request).

:func:`trim_host_heap` runs once after a re-layout: the tensors the flat
buffers replaced were freed in between live allocations, and glibc keeps
such memory in the process (measured on the 160M bench model at stage 3:
~280 MB per rank, which then raised every later peak RSS) unless asked to
return it (``malloc_trim``).

Invariants of :class:`FlatGrads`:

* between :meth:`FlatGrads.collect` and the next :meth:`FlatGrads.release`,
  every parameter's ``.grad`` *is* its view (the same tensor object);
* anything that replaced a ``.grad`` meanwhile (``model.zero_grad()``
  setting it to None, ``create_graph`` backward, user code) is noticed by
  identity at the next :meth:`FlatGrads.collect`, copied in (None: zeros)
  and re-bound, so the flat buffer always holds every gradient;
* padding elements of the buffer stay zero;
* :attr:`FlatGrads.arrived` (set by :meth:`FlatGrads.collect`) says whether
  any gradient came since the buffer was last zeroed or collected: a
  replaced ``.grad``, or an in-place accumulation into a bound view, which
  bumps the buffer's version counter (views share it) - one integer
  comparison, nothing per element.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Sequence
from typing import Optional

import torch

from dsrun.runtime.zero.offload import pinning


@torch.no_grad()
def flatten_into(tensors: Sequence[torch.Tensor], offsets: Sequence[int],
                 numel: int) -> torch.Tensor:
    """A zeroed flat tensor of ``numel`` elements (dtype and device of the
    first tensor) holding each tensor's values at its offset; each tensor's
    ``.data`` becomes a view of it (shape kept). Elements no tensor covers
    (padding) are zero."""
    first = tensors[0]
    flat = torch.zeros(numel, dtype=first.dtype, device=first.device)
    for tensor, offset in zip(tensors, offsets):
        view = flat.narrow(0, offset, tensor.numel())
        view.copy_(tensor.detach().reshape(-1))
        tensor.data = view.view(tensor.data.shape)
    return flat


def trim_host_heap() -> bool:
    """Return freed heap memory to the OS (glibc's ``malloc_trim``; module
    docstring). False where that is not available (not glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def alias_or_copy(flat: torch.Tensor, start: int, numel: int, device: torch.device,
                  pin_memory: bool) -> tuple[torch.Tensor, bool]:
    """``(master, aliased)``: the fp32 master of ``flat[start:start+numel]``
    (module docstring)."""
    part = flat.narrow(0, start, numel)
    if flat.dtype == torch.float32 and flat.device == device:
        return part, True
    master = torch.empty(numel, dtype=torch.float32, device=device,
                         pin_memory=pinning(pin_memory) and device.type == "cpu")
    master.copy_(part)
    return master, False


class FlatGrads:
    """Gradients of ``params`` as views of one flat tensor (module docstring).

    ``offsets[i]`` is where parameter ``i``'s gradient starts; the buffer has
    ``numel`` elements in the parameters' dtype, on their device.
    """

    def __init__(self, params: Sequence[torch.Tensor], offsets: Sequence[int],
                 numel: int) -> None:
        if len(params) != len(offsets):
            raise ValueError(f"{len(offsets)} offsets for {len(params)} parameters")
        self.params = list(params)
        self.offsets = list(offsets)
        self.numel = numel
        self.buffer: Optional[torch.Tensor] = None
        self._views: list[torch.Tensor] = []
        #: the buffer's version counter when last zeroed or collected
        self._seen = -1
        #: a gradient came before the last collect() (module docstring)
        self.arrived = False

    @property
    def bound(self) -> bool:
        """True while a buffer exists (its views may have been replaced)."""
        return self.buffer is not None

    def _allocate(self) -> None:
        first = self.params[0]
        self.buffer = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
        self._views = [self.buffer.narrow(0, offset, p.numel()).view(p.shape)
                       for p, offset in zip(self.params, self.offsets)]
        self._seen = self.buffer._version

    @torch.no_grad()
    def collect(self) -> torch.Tensor:
        """The flat gradient: every parameter's gradient in its slot (zeros
        where it has none); afterwards each ``.grad`` is its view."""
        if self.buffer is None:
            self._allocate()
        buffer: torch.Tensor = self.buffer  # type: ignore[assignment]
        # backward accumulated in place into a bound view since the last zero
        arrived = buffer._version != self._seen
        for param, view in zip(self.params, self._views):
            grad = param.grad
            if grad is view:
                continue
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
                arrived = True
            param.grad = view
        self.arrived = arrived
        self._seen = buffer._version
        return buffer

    @torch.no_grad()
    def zero(self) -> None:
        """Zero the buffer (one fill for the group); views stay bound."""
        if self.buffer is not None:
            self.buffer.zero_()
            self._seen = self.buffer._version

    def release(self) -> None:
        """Every ``.grad`` to None and the buffer freed."""
        for param in self.params:
            param.grad = None
        self.buffer = None
        self._views = []


def clear_flat_grads(groups: Sequence[Optional[FlatGrads]], set_to_none: bool) -> None:
    """``zero_grad`` for each group's flat gradients: freed with
    ``set_to_none``, else zeroed in place with their views kept bound."""
    for grads in groups:
        if grads is not None:
            if set_to_none:
                grads.release()
            else:
                grads.zero()
