"""ZeRO stage 3 parameters: partitioned storage, logical shape, gather/release.

A managed parameter keeps its identity - the same ``torch.nn.Parameter``
object that its module, autograd and the client's param groups refer to -
and gains DeepSpeed's attributes:

* ``ds_id`` (process-wide counter: equal on all ranks that build the same
  model), ``ds_name`` (for messages), ``ds_shape``, ``ds_numel``;
* ``ds_tensor``: this rank's shard (:class:`~.stage3_plan.ShardSpec`), in
  the parameter's dtype, ``ds_spec.shard_numel`` elements, padding zero; in
  host memory after :func:`offload_shard` (``offload_param``);
* ``ds_device``: where the full data is gathered to (the compute device);
* ``ds_status`` (:class:`ZeroParamStatus`), ``ds_persist``, ``ds_group``
  (the data-parallel group; None = default), ``ds_pins`` (open
  ``GatheredParameters`` contexts holding it).

**Logical shape while released.** As in DeepSpeed, ``param.data`` becomes an
empty tensor while the parameter is released (so its full storage is freed
and autograd, which holds the same tensor object, sees the full values again
once it is re-gathered). Unlike DeepSpeed, the parameter's class is switched
(``__class__`` assignment, every reference stays valid) to
:class:`ZeroParameter`, a ``Parameter`` subclass whose ``shape``,
``size()``, ``dim()``/``ndim`` and ``numel()``/``nelement()`` report the
*logical* values and whose ``repr`` names the shape and the shard. Only these
Python-level accessors change: torch operators read the real (empty) C++
sizes, and ``param.data`` is a plain tensor with its real size - which is how
code (and tests) see whether a full parameter is held.
Python methods that would combine the logical shape with the empty data
(``reshape``, ``view``, ``copy_``...) refuse a released parameter with an
error that says so, and in-place writes (``fill_``, ``normal_``...) refuse
it or, while ``zero.Init`` builds, apply to the whole parameter
(:mod:`~.released`). ``copy.deepcopy`` gives a partitioned copy
(:mod:`~.param_copy`).

Invariants:

* ``AVAILABLE`` <=> ``data`` holds all ``ds_numel`` elements; ``NOT_AVAILABLE``
  and ``INFLIGHT`` <=> ``data`` is empty (``INFLIGHT``: a gather is pending);
* persistent parameters are always ``AVAILABLE`` and still keep their shard
  in ``ds_tensor`` (the optimizer partitions them like any other);
* at world size 1 a persistent parameter's ``ds_tensor`` is a view of
  ``data`` (on a GPU rank with ``offload_param``, a separate host copy);
  while a ``GatheredParameters`` without ``modifier_rank`` lends a
  parameter a scratch copy of its full data, ``_ds_kept`` holds the data
  set aside (:func:`committed`; :mod:`~.whole_edits`), which is what
  steps and publishes write;
  every parameter is persistent there unless its shard lives in host
  memory (``offload_param``: the whole parameter is then the shard, on the
  host, brought to the device for each use);
* only :func:`release` empties ``data``, and it leaves pinned and persistent
  parameters alone.

**Gathering a batch** (:func:`start_gathers`, what the fetcher issues for
a module or a prefetch): where the strategy all-gathers (NCCL) at world
size > 1, the device-resident shards of one group go out as one coalesced
collective - per-parameter outputs, no copy in or out, one launch (FSDP2's
one all-gather per group without its copy-out) - through
``torch.distributed._coalescing_manager``; gloo's strategy broadcasts from
each owner per parameter (the fastest there, ``bench/collectives.py``).

**Gathering a host-resident shard** (``offload_param`` on a GPU rank): the
host -> device copy runs on a side stream (:func:`~.offload.copy_stream`),
so a prefetch overlaps the compute stream. The full buffer is allocated on
that stream; the compute stream waits for the copy's event (and, at world
size > 1, for the all-gather issued on the side stream) in
:func:`finish_gather`, which also ``record_stream``-s the buffer on the
compute stream, so that its memory is not handed out again before the
compute stream is done with it.
"""

from __future__ import annotations

import enum
import itertools
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from dsrun import comm as collectives
from dsrun.errors import DsrunError
from dsrun.runtime.zero.comm import (
    CommStrategy,
    Pending,
    gather_single,
    start_all_gather,
    strategy_for,
)
from dsrun.runtime.zero.offload import HOST, copy_stream, host_copy, to_device
from dsrun.runtime.zero.released import ReleasedChecks
from dsrun.runtime.zero.stage3_plan import ShardSpec

_ids = itertools.count()


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's names for where a partitioned parameter's full data is."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_PARAMETER_NEW = torch.nn.Parameter.__new__.__code__


class ZeroParameter(ReleasedChecks, torch.nn.Parameter):
    """A partitioned parameter reporting its logical shape (module docstring);
    reshaping, viewing or copying into it while it is released raises
    :class:`~.released.ReleasedParameterError`."""

    @property  # type: ignore[override]
    def shape(self) -> torch.Size:
        shape = self.__dict__.get("ds_shape")
        return torch.Tensor.shape.__get__(self) if shape is None else shape  # type: ignore

    def size(self, dim: Optional[int] = None) -> Any:  # type: ignore[override]
        shape = self.shape
        return shape if dim is None else shape[dim]

    def dim(self) -> int:  # type: ignore[override]
        return len(self.shape)

    @property  # type: ignore[override]
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:  # type: ignore[override]
        numel = self.__dict__.get("ds_numel")
        return torch.Tensor.numel(self) if numel is None else numel

    nelement = numel

    def partition_numel(self) -> int:
        """DeepSpeed's: the elements of this rank's shard, padding included
        (Lightning's model summary counts them at ZeRO stage 3)."""
        return self.__dict__["ds_spec"].shard_numel

    def padding_size(self) -> int:
        """DeepSpeed's: the padding elements the shards add to the parameter."""
        spec = self.__dict__["ds_spec"]
        return spec.padded_numel - spec.numel

    def detach(self) -> torch.Tensor:  # type: ignore[override]
        """This data without autograd, a plain tensor - except to
        ``torch.nn.Parameter(p)``, which needs ``detach()`` to keep a
        subclass's type: it gets a ``ZeroParameter`` that ZeRO does not
        manage (no ``ds_*`` state), so ``Parameter(p)`` is a new parameter
        sharing the data, as with DeepSpeed's plain parameters
        (``weight_norm`` and other parametrizations call it on the weight)."""
        detached = torch.Tensor.detach(self)
        if sys._getframe(1).f_code is _PARAMETER_NEW:
            return detached.as_subclass(ZeroParameter)
        return detached

    def __repr__(self) -> str:  # type: ignore[override]
        status = self.__dict__.get("ds_status")
        if status is None or status is ZeroParamStatus.AVAILABLE:
            persist = " (kept whole)" if self.__dict__.get("ds_persist") else ""
            return (f"ZeroParameter of shape {tuple(self.shape)}, gathered{persist}:\n"
                    f"{self.data!r}")
        shard = self.__dict__["ds_tensor"].numel()
        return (f"ZeroParameter(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"status={status.name}: this rank holds a shard of {shard} of "
                f"{self.numel()} elements, requires_grad={self.requires_grad})")

    def __deepcopy__(self, memo: dict[int, Any]) -> ZeroParameter:
        """A partitioned copy with this rank's shard (:mod:`~.param_copy`)."""
        from dsrun.runtime.zero.param_copy import deepcopy_param  # imports this module

        return deepcopy_param(self, memo)  # type: ignore[return-value]


def shard_is_view(param: torch.Tensor, full: Optional[torch.Tensor] = None) -> bool:
    """``ds_tensor`` is a view of ``data`` (world size 1), or of ``full``."""
    full = param.data if full is None else full
    return param.ds_tensor.untyped_storage().data_ptr() == \
        full.untyped_storage().data_ptr() and full.numel() > 0


def committed(param: torch.Tensor) -> torch.Tensor:
    """``param``'s full data as its shard knows it: ``data``, or the tensor
    set aside while a scratch copy stands in for it
    (:func:`~.whole_edits.lend_scratch`)."""
    kept = param.__dict__.get("_ds_kept")
    return param.data if kept is None else kept


def is_zero_param(param: Any) -> bool:
    return isinstance(param, torch.Tensor) and hasattr(param, "ds_id")


def param_name(param: torch.Tensor) -> str:
    return getattr(param, "ds_name", None) or f"parameter #{getattr(param, 'ds_id', '?')}"


def _empty(param: torch.Tensor) -> torch.Tensor:
    """The empty ``data`` of a released parameter, on its compute device."""
    return torch.empty(0, dtype=param.ds_tensor.dtype, device=param.ds_device)


# ------------------------------------------------------------ partitioning


def partition_param(param: torch.nn.Parameter, *, group: Any, persist: bool,
                    alignment: int = 1, name: Optional[str] = None) -> ZeroParameter:
    """Make ``param`` (full, equal on every rank) a partitioned parameter of
    ``group``: keep this rank's shard, release the rest unless ``persist``
    (see :func:`~.stage3_plan.is_persistent`). Returns the same object."""
    if is_zero_param(param):
        raise DsrunError(f"{param_name(param)} is partitioned already")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    spec = ShardSpec(param.numel(), world, alignment)
    flat = param.data.reshape(-1)
    if world == 1 and persist and spec.padded_numel == spec.numel:
        shard = param.data.view(-1) if param.data.is_contiguous() else flat
    else:
        shard = torch.zeros(spec.shard_numel, dtype=param.dtype, device=param.device)
        valid = spec.valid(rank)
        if valid:
            shard[:valid].copy_(flat[rank * spec.shard_numel: rank * spec.shard_numel + valid])
    param.__class__ = ZeroParameter
    param.__dict__.update(
        ds_id=next(_ids), ds_name=name, ds_shape=param.data.shape, ds_numel=spec.numel,
        ds_spec=spec, ds_tensor=shard, ds_device=param.device,
        ds_status=ZeroParamStatus.AVAILABLE,
        ds_persist=bool(persist), ds_group=group, ds_pins=0, _ds_pending=None)
    if not param.ds_persist:
        release(param)
    return param  # type: ignore[return-value]


_layout = [0]  # bumped by every change :func:`layout_epoch` tracks


def layout_epoch() -> int:
    """A number that changes whenever a parameter is pinned or unpinned by
    ``GatheredParameters``, made kept whole or not, or moved
    (:func:`layout_changed`): what decides the copies
    :class:`~.whole_edits.EditTaker` plans."""
    return _layout[0]


def layout_changed() -> None:
    """Say that what :func:`layout_epoch` tracks changed."""
    _layout[0] += 1


def set_persistence(params: Iterable[torch.Tensor], persist: bool,
                    strategy: Optional[CommStrategy] = None) -> None:
    """Change whether ``params`` are kept whole (collective when gathering)."""
    todo = [p for p in params if p.ds_persist != persist]
    layout_changed()
    if persist:
        gather(todo, strategy=strategy)
    for p in todo:
        p.ds_persist = persist
        if not persist:
            if shard_is_view(p):  # world size 1: the shard must outlive the data
                p.ds_tensor = p.ds_tensor.clone()
            release(p)


def broadcast_full(params: Sequence[torch.Tensor], group: Any) -> None:
    """Give every rank group rank 0's full values of ``params`` (in place)."""
    if dist.get_world_size(group) == 1 or not params:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        works = [collectives.broadcast(p.data, src=src, group=group, async_op=True)
                 for p in params if p.numel() > 0]
        for work in works:
            work.wait()


def move_param(param: torch.Tensor, device: torch.device, keep_host_shard: bool = False
               ) -> None:
    """Put a partitioned parameter's shard (and full data, if held) on
    ``device``, which becomes its compute device (not during a gather).
    ``keep_host_shard``: a shard in host memory stays there (offload_param)."""
    host_shard = keep_host_shard and param.ds_tensor.device == HOST
    if (host_shard or param.ds_tensor.device == device) and param.ds_device == device:
        return
    if param.ds_status is ZeroParamStatus.INFLIGHT:
        raise DsrunError(f"cannot move {param_name(param)} while its gather is in flight")
    aliased = shard_is_view(param)
    layout_changed()
    with torch.no_grad():
        param.data = param.data.to(device)
        if aliased:
            param.ds_tensor = param.data.view(-1)
        elif not host_shard:
            param.ds_tensor = param.ds_tensor.to(device)
    param.ds_device = device


def offload_shard(param: torch.Tensor, pin_memory: bool = False) -> None:
    """Keep ``param``'s shard in host memory (``offload_param``); gathers
    copy it to the compute device first. A persistent parameter keeps its
    full data on the device and a separate host shard (refreshed into the
    data after each step), at world size 1 too."""
    if param.ds_tensor.device == HOST:
        return
    if param.ds_status is ZeroParamStatus.INFLIGHT:
        raise DsrunError(f"cannot offload {param_name(param)} while its gather is in flight")
    layout_changed()
    param.ds_tensor = host_copy(param.ds_tensor, pin_memory)


# ------------------------------------------------------------ gather/release


def start_gather(param: torch.Tensor, strategy: Optional[CommStrategy] = None) -> None:
    """Begin gathering a released parameter (``NOT_AVAILABLE`` -> ``INFLIGHT``)."""
    if param.ds_status is not ZeroParamStatus.NOT_AVAILABLE:
        return
    spec: ShardSpec = param.ds_spec
    shard, device = param.ds_tensor, param.ds_device
    if shard.device != device and device.type == "cuda":
        param._ds_pending = _start_host_gather(param, shard, device, strategy)
    else:
        out = torch.empty(spec.padded_numel, dtype=shard.dtype, device=device)
        shard = to_device(shard, device)  # a host shard on a CPU rank: no copy
        param._ds_pending = start_all_gather(shard, out, param.ds_group, strategy=strategy)
    param.ds_status = ZeroParamStatus.INFLIGHT


def start_gathers(params: Sequence[torch.Tensor],
                  strategy: Optional[CommStrategy] = None) -> None:
    """:func:`start_gather` for every released parameter of ``params``;
    device-resident shards of one group coalesced where the strategy
    all-gathers (module docstring)."""
    batches: dict[tuple[Any, torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        if p.ds_status is not ZeroParamStatus.NOT_AVAILABLE:
            continue
        if _coalescible(p, strategy):
            batches.setdefault((p.ds_group, p.ds_tensor.dtype, p.ds_device), []).append(p)
        else:
            start_gather(p, strategy)
    for (group, dtype, device), batch in batches.items():
        if len(batch) == 1:
            start_gather(batch[0], strategy)
            continue
        outs = [torch.empty(p.ds_spec.padded_numel, dtype=dtype, device=device)
                for p in batch]
        with dist._coalescing_manager(group, async_ops=True) as manager:  # fast path
            for p, out in zip(batch, outs):
                gather_single(out, p.ds_tensor, group=group)
        shared = Pending(outs[0], [manager])  # one wait completes the whole batch
        for p, out in zip(batch, outs):
            p._ds_pending = Pending(out, [shared])
            p.ds_status = ZeroParamStatus.INFLIGHT


def _coalescible(param: torch.Tensor, strategy: Optional[CommStrategy]) -> bool:
    if param.ds_spec.world_size == 1 or param.ds_tensor.device != param.ds_device:
        return False
    chosen = strategy or strategy_for(param.ds_group, param.ds_device)
    return chosen.gather == "all_gather"


def _start_host_gather(param: torch.Tensor, shard: torch.Tensor, device: torch.device,
                       strategy: Optional[CommStrategy]) -> Pending:
    """A host-resident shard to the GPU on the copy stream (module docstring)."""
    stream = copy_stream(device)
    with torch.cuda.stream(stream):
        out = torch.empty(param.ds_spec.padded_numel, dtype=shard.dtype, device=device)
        if param.ds_spec.world_size == 1:
            out.copy_(shard, non_blocking=True)
            pending = Pending(out)
        else:
            on_device = shard.to(device, non_blocking=True)
            pending = start_all_gather(on_device, out, param.ds_group, strategy=strategy)
        event = torch.cuda.Event()
        event.record(stream)

    def finish() -> None:
        compute = torch.cuda.current_stream(device)
        compute.wait_event(event)
        out.record_stream(compute)

    return Pending(out, [pending], finish)


def finish_gather(param: torch.Tensor) -> None:
    """Wait for an ``INFLIGHT`` gather and install the full data."""
    if param.ds_status is not ZeroParamStatus.INFLIGHT:
        return
    pending: Pending = param._ds_pending
    param._ds_pending = None
    full = pending.wait()
    param.data = full.narrow(0, 0, param.ds_numel).view(param.ds_shape)
    param.ds_status = ZeroParamStatus.AVAILABLE
    # in-place writes to the parameter from here on bump it (``.data`` writes
    # do not): :func:`~.whole_edits.take_gathered_edit` compares
    param._ds_gathered_version = param._version


def gather(params: Iterable[torch.Tensor], strategy: Optional[CommStrategy] = None) -> None:
    """Make ``params`` ``AVAILABLE`` now (all gathers in flight together)."""
    params = list(params)
    for p in params:
        start_gather(p, strategy)
    for p in params:
        finish_gather(p)


def release(param: torch.Tensor) -> bool:
    """Free the full data of a non-persistent, unpinned parameter (waits for
    a gather in flight first). Returns True when it was released."""
    if param.ds_persist or param.ds_pins > 0:
        return False
    if param.ds_status is ZeroParamStatus.INFLIGHT:
        finish_gather(param)
    if param.ds_status is ZeroParamStatus.AVAILABLE:
        param.data = _empty(param)
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    return True


@torch.no_grad()
def refresh_shard(param: torch.Tensor) -> None:
    """Copy this rank's slice of the full ``data`` into ``ds_tensor`` (after
    the full values changed), and the full values into the data a scratch
    copy stands in for (:func:`~.whole_edits.lend_scratch`); padding stays zero."""
    if shard_is_view(param):
        return
    spec: ShardSpec = param.ds_spec
    rank = dist.get_rank(param.ds_group)
    valid = spec.valid(rank)
    flat = param.data.reshape(-1)
    if valid < spec.shard_numel:  # only the padding: the rest is overwritten next
        param.ds_tensor[valid:].zero_()
    if valid:
        start = rank * spec.shard_numel
        param.ds_tensor[:valid].copy_(flat[start:start + valid])
    kept = param.__dict__.get("_ds_kept")
    if kept is not None:
        kept.copy_(param.data)


def refresh_full(params: Iterable[torch.Tensor], strategy: Optional[CommStrategy] = None
                 ) -> None:
    """Rebuild, in place, the full data of ``AVAILABLE`` parameters from the
    shards (after the optimizer updated ``ds_tensor``); others are left
    released. Coalesced: one all-gather per (group, dtype, device) of every
    shard back to back, however many (small, persistent) parameters. A
    parameter lent a scratch copy has the data it set aside rebuilt."""
    todo = [p for p in params  # a zero-size parameter has nothing to rebuild
            if p.ds_numel and p.ds_status is ZeroParamStatus.AVAILABLE
            and not shard_is_view(p, committed(p))]
    batches: dict[tuple[Any, torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in todo:
        batches.setdefault((p.ds_group, p.ds_tensor.dtype, p.ds_device), []).append(p)
    pending = []
    for (group, _, device), batch in batches.items():
        send = torch.cat([to_device(p.ds_tensor, device) for p in batch])
        pending.append((batch, send.numel(), start_all_gather(send, None, group,
                                                              strategy=strategy)))
    with torch.no_grad():
        for batch, width, work in pending:
            rows = work.wait().view(-1, width)
            offset = 0
            for p in batch:
                size = p.ds_spec.shard_numel
                full = rows[:, offset:offset + size].reshape(-1)
                committed(p).copy_(full[:p.ds_numel].view(p.ds_shape))
                offset += size


@torch.no_grad()
def zero_full_grad(param: torch.Tensor) -> None:
    """Give ``param`` a zero gradient of its full (logical) shape, gathered
    or not, without communication: the ``grad`` setter checks the size
    against ``data``, so a released parameter briefly holds an uninitialised
    full-size ``data`` (its status is unchanged)."""
    held = param.data
    if held.shape != param.ds_shape:
        param.data = torch.empty(param.ds_shape, dtype=held.dtype, device=param.ds_device)
    try:
        param.grad = torch.zeros(param.ds_shape, dtype=held.dtype, device=param.ds_device)
    finally:
        param.data = held


def full_numel_held(params: Iterable[torch.Tensor]) -> int:
    """Elements of full data currently held by partitioned, non-persistent
    ``params`` (0 outside forward/backward and gather contexts)."""
    return sum(p.data.numel() for p in params if is_zero_param(p) and not p.ds_persist)
