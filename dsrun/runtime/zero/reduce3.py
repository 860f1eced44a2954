"""ZeRO stage 3 gradient reduction: full gradients, as autograd produces
them, reduced into each rank's shard accumulators in buckets.

:meth:`ShardGradReducer.add` is called from a parameter's post-accumulate-
grad hook: it takes ``param.grad`` (the full gradient; ``param.grad`` becomes
None). Two bucket layouts, by the reduction the strategy uses:

* **param-major** (all-reduce: gloo, or ``reduce_scatter: false``): the
  gradient times ``1/N`` (DDP's pre-division) is written at once into the
  open bucket buffer in its own padded layout (``N * S`` elements: rank
  ``r``'s shard at ``r * S``; padding zero) and the full gradient is freed -
  nothing is staged. When the bucket holds ``bucket_numel`` elements (or at
  :meth:`finish`) it is announced to the divergence guard and all-reduced;
  this rank's shard of each parameter is then at ``offset + rank * S``.
* **rank-major** (reduce-scatter: NCCL): gradients are staged until their
  padded sizes reach ``bucket_numel``; then one buffer of ``N * U``
  elements (``U`` = the sum of the bucket's shard sizes) - region ``r``
  holds, back to back, every bucket parameter's ``r``-th shard of
  ``grad * (1/N)`` - is announced and reduce-scattered
  (:func:`~.comm.start_reduce_scatter`, ``premultiplied``), which leaves
  this rank's region, its shard of every parameter's mean gradient,
  contiguous.

On **drain** each shard goes to ``land(param, values)``, which copies it
into its accumulator (an fp32 view into the master's ``.grad``) in a step's
first round and adds it afterwards, so micro-steps accumulate
``sum_micro(mean_ranks(g))`` - through side-stream copies into host memory
under offload (:class:`~.offload.Landing`; a kept buffer waits on the device
for those copies before it is written again: ``before_reuse``).

Buckets follow the order in which gradients arrive; autograd runs the same
graph in the same order on every rank, and the guard checks each bucket's
parameter ids, so a rank whose order differs is reported, not mis-summed.
With ``overlap`` one bucket is in flight while the next fills; without, each
reduction completes before backward goes on. Bucket buffers are kept for
the next bucket and the next backward (at most one per bucket in flight
plus one filling, like stage 2's slots with ``contiguous_gradients``): a
fresh buffer of bucket size each time costs page faults on every write.
World size 1 (reached only with ``offload_param``: otherwise the optimizer
uses flat gradients and no hook): nothing is reduced or staged; each
gradient lands in its accumulator as soon as autograd produced it, and is
dropped on the device.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from dsrun import comm as collectives
from dsrun.runtime.zero.comm import CommStrategy, Pending, start_reduce_scatter, strategy_for
from dsrun.runtime.zero.divergence import DivergenceGuard
from dsrun.runtime.zero.partitioned import param_name
from dsrun.runtime.zero.stage3_plan import ShardSpec


def write_rank_major(rows: torch.Tensor, flat: torch.Tensor, spec: ShardSpec,
                     scale: float) -> None:
    """``rows`` (``N x S``, any strides) <- ``flat * scale`` cut in shards,
    padding zero (``flat`` has ``spec.numel`` elements)."""
    size, full, rem = spec.shard_numel, spec.full_rows, spec.remainder
    if full:
        _scaled(flat[:full * size].view(full, size), scale, rows[:full])
    done = full
    if rem:
        _scaled(flat[full * size:], scale, rows[full, :rem])
        rows[full, rem:].zero_()
        done += 1
    if done < rows.shape[0]:
        rows[done:].zero_()


def _scaled(src: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    if scale == 1.0:
        out.copy_(src)
    elif src.dtype == out.dtype:
        torch.mul(src, scale, out=out)
    else:
        out.copy_(src).mul_(scale)


class _Inflight(NamedTuple):
    """A launched bucket: its collective, ``(param, offset)`` placements,
    the whole buffer (kept for reuse) and its layout."""

    pending: Pending
    placed: list[tuple[torch.Tensor, int]]
    buffer: torch.Tensor
    param_major: bool


class ShardGradReducer:
    """Stage-3 bucketed reduction of gradients (module docstring)."""

    def __init__(self, *, group: Any, world_size: int, bucket_numel: int, overlap: bool,
                 dtype: Optional[torch.dtype], guard: DivergenceGuard,
                 land: Callable[[torch.Tensor, torch.Tensor], None],
                 strategy: Optional[CommStrategy] = None,
                 before_reuse: Callable[[], None] = lambda: None) -> None:
        self.group = group
        self.world_size = world_size
        self.rank = dist.get_rank(group) if world_size > 1 else 0
        self.scale = 1.0 / world_size
        self.bucket_numel = bucket_numel
        self.max_inflight = 1 if overlap else 0
        self.dtype = dtype
        self.guard = guard
        self.land = land
        self.before_reuse = before_reuse
        self.strategy = strategy
        self._staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # rank-major buckets
        self._staged_numel = 0
        self._open: Optional[torch.Tensor] = None  # param-major bucket being filled
        self._open_placed: list[tuple[torch.Tensor, int]] = []
        self._open_used = 0
        self._inflight: list[_Inflight] = []
        self._spare: list[torch.Tensor] = []  # bucket buffers to reuse

    @property
    def pending(self) -> bool:
        return bool(self._staged or self._open_placed or self._inflight)

    def buffers(self) -> list[torch.Tensor]:
        """Staged gradients, buffers being filled, in flight and kept for
        reuse (for memory accounting)."""
        open_ = [self._open] if self._open is not None else []
        return [g for _, g in self._staged] + open_ + \
            [item.buffer for item in self._inflight] + self._spare

    def _param_major(self, device: torch.device) -> bool:
        """All-reduce strategies (gloo's) reduce a bucket in any layout: then
        gradients are written into it as they arrive, in their own padded
        layout, and nothing is staged."""
        strategy = self.strategy or strategy_for(self.group, device)
        return strategy.reduce == "all_reduce"

    def add(self, param: torch.Tensor) -> None:
        """Take ``param.grad`` (full) into the current bucket."""
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        if self.world_size == 1:
            self.land(param, grad.reshape(-1))
            return
        if self._param_major(grad.device):
            self._write(param, grad)
            return
        self._staged.append((param, grad))
        self._staged_numel += param.ds_spec.padded_numel
        if self._staged_numel >= self.bucket_numel:
            self._launch()

    def _write(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """``grad * (1/N)`` into the open param-major bucket (padding zero)."""
        spec: ShardSpec = param.ds_spec
        need = spec.padded_numel
        if self._open is not None and self._open_used + need > self._open.numel():
            self._launch()
        if self._open is None:
            self._open = self._buffer(max(self.bucket_numel, need),
                                      self.dtype or grad.dtype, grad.device)
            self._open_used = 0
        view = self._open.narrow(0, self._open_used, need)
        with torch.no_grad():
            _scaled(grad.reshape(-1), self.scale, view.narrow(0, 0, spec.numel))
            if need > spec.numel:
                view.narrow(0, spec.numel, need - spec.numel).zero_()
        self._open_placed.append((param, self._open_used))
        self._open_used += need
        if self._open_used >= self.bucket_numel:
            self._launch()

    def _announce(self, params: list[torch.Tensor]) -> None:
        name = param_name(params[0]) + (f" and {len(params) - 1} more" if len(params) > 1
                                        else "")
        self.guard.event("reduce", f"gradients of {name}", [p.ds_id for p in params],
                         [p.ds_numel for p in params])

    def _launch(self) -> None:
        if self._open_placed:
            placed, buffer = self._open_placed, self._open
            used = self._open_used
            self._open, self._open_placed, self._open_used = None, [], 0
            self._announce([p for p, _ in placed])
            work = collectives.all_reduce(buffer.narrow(0, 0, used), group=self.group,  # type: ignore
                                   async_op=True)
            self._inflight.append(_Inflight(Pending(buffer, [work]), placed, buffer, True))
        staged, self._staged, self._staged_numel = self._staged, [], 0
        if staged:
            self._launch_rank_major(staged)
        while len(self._inflight) > self.max_inflight:
            self._drain()

    def _launch_rank_major(self, staged: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        params = [p for p, _ in staged]
        width = sum(p.ds_spec.shard_numel for p in params)
        dtype = self.dtype or staged[0][1].dtype
        buffer = self._buffer(self.world_size * width, dtype, staged[0][1].device)
        rows = buffer.view(self.world_size, width)
        placed, offset = [], 0
        for param, grad in staged:
            size = param.ds_spec.shard_numel
            write_rank_major(rows[:, offset:offset + size], grad.reshape(-1), param.ds_spec,
                             self.scale)
            placed.append((param, offset))
            offset += size
        del staged
        self._announce(params)
        pending = start_reduce_scatter(buffer, self.group, strategy=self.strategy,
                                       premultiplied=True)
        self._inflight.append(_Inflight(pending, placed, buffer, False))

    def _buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A bucket buffer of ``numel`` elements: a kept one when one is big
        enough (the largest is kept when a larger one is needed)."""
        for i, spare in enumerate(self._spare):
            if spare.numel() >= numel and (spare.dtype, spare.device) == (dtype, device):
                self.before_reuse()  # copies to the host may still read it
                return self._spare.pop(i).narrow(0, 0, numel)
        if len(self._spare) > self.max_inflight:
            self._spare.pop(0)
        return torch.empty(numel, dtype=dtype, device=device)

    def _keep(self, buffer: torch.Tensor) -> None:
        whole = buffer._base if buffer._base is not None else buffer
        self._spare.append(whole)
        self._spare.sort(key=torch.Tensor.numel)
        del self._spare[:-(self.max_inflight + 1)]

    def _drain(self) -> None:
        item = self._inflight.pop(0)
        reduced = item.pending.wait()
        with torch.no_grad():
            for param, offset in item.placed:
                size = param.ds_spec.shard_numel
                if item.param_major:  # this rank's shard inside the parameter's slot
                    offset += self.rank * size
                self.land(param, reduced[offset:offset + size])
        self._keep(item.buffer)

    def finish(self) -> None:
        """Launch the partial bucket and drain everything (idempotent)."""
        self._launch()
        while self._inflight:
            self._drain()

    def reset(self) -> None:
        """Drop staged gradients; wait for (and discard) reductions in flight."""
        self._staged, self._staged_numel = [], 0
        if self._open is not None:
            self._keep(self._open)
        self._open, self._open_placed, self._open_used = None, [], 0
        for item in self._inflight:
            item.pending.wait()
            self._keep(item.buffer)
        self._inflight = []
