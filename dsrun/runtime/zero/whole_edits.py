"""Writes to the full data of ZeRO stage-3 parameters kept whole: one rule at
every world size.

A parameter of at most ``stage3_param_persistence_threshold`` elements (at
world size 1 without ``offload_param``, every parameter) keeps its full
``data`` on every rank, next to its shard (``ds_tensor``), which is what the
optimizer updates and what each step's refresh rebuilds ``data`` from. At
world size 1 the shard is a view of ``data``, so a write to ``data`` is a
write to the shard; at world size > 1 (or with the shard in host memory)
the shard is a separate copy, and a write to ``data`` alone would be used
by forward and then overwritten by the next step's refresh - on some world
sizes and not others. So, at every world size:

* **at initialize()** (:func:`adopt_full`, called by the stage-3
  optimizer): the full data of a parameter ``zero.Init`` partitioned and
  kept whole is its value - group rank 0's data goes to every rank and the
  shards are rebuilt from it, as ``GatheredParameters(modifier_rank=0)``
  does. A parent's ``__init__`` that writes into a child built (and
  partitioned) before it - ``nn.MultiheadAttention`` zeroing
  ``out_proj.bias`` - therefore builds the same model as without
  ``zero.Init``;
* **inside ``GatheredParameters`` without ``modifier_rank``** (:func:`lend_scratch`,
  :func:`end_scratch`): the parameters that were whole when the context
  opened get a private copy of their data for the context, and their own
  data back on exit, so every edit made inside is dropped, as the
  parameters the context gathered are (and as DeepSpeed drops both). Only
  the first context to hold a parameter lends it a copy: one nested in
  another context leaves its edits to that one (published by a
  ``modifier_rank`` context, dropped by one without). Values committed
  while the copy stands in - a step, a setter such as
  ``safe_set_full_fp32_param``, a nested ``modifier_rank`` context's
  publish - go to the data set aside, so they are kept;
* **outside every context, after initialize()** (:class:`EditTaker`,
  before each step): this rank's slice of ``data`` goes into the shard. The
  edit is thus kept where the shard is the parameter's value (fp32 and
  bf16 training, frozen parameters) and overwritten by the step where the
  optimizer keeps separate fp32 masters (fp16, ``offload_optimizer``
  without ``offload_param``) - as at world size 1 and as at ZeRO stage 0.
  Each rank's slice comes from its own ``data``: ranks that edit
  differently end up with a mixture (use ``modifier_rank``). Only the
  former are copied (the step overwrites the others' shards anyway), with
  copies planned once and again when pins, persistence, placement or a
  parameter's ``data`` tensor change. The ``safe_set_*`` setters write the
  full data too, so a value set there is not taken back from stale data.
  At world size 1 (no ``offload_param``), ``data`` is a view of the shard
  and in-place edits need no copy; a replaced ``data`` (``param.data =
  new``) is taken by the same rule and made a view of the shard again
  (:class:`LocalRebind`).

A parameter that is **not** kept whole has full data only while gathered.
An in-place write to it then - ``nn.Embedding(max_norm=...)`` renormalises
the rows it looks up in its forward, on the gathered weight - would be
freed with that data at release. So when the fetcher releases a parameter
it gathered (:func:`take_gathered_edit`; a ``GatheredParameters`` context
keeps its own rule above) whose version counter moved since the gather
(``param._version``: every in-place operation on the parameter bumps it,
``.data`` writes - dsrun's own refreshes - do not), this rank's slice of the
data goes into the shard first: by the rule above, kept where the shard is
the optimizer's master and overwritten by the next step where it is a
separate fp32 copy, as at stage 0. One integer comparison per release;
a detected write costs a copy of this rank's slice (from the device to the
host under ``offload_param``, blocking) and zeroing the shard's padding.
Each rank keeps its slice of its own write: with different writes per rank
(``max_norm`` over different batches) the shards hold a mixture, element by
element, of what each owner wrote.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dsrun.errors import DsrunError
from dsrun.runtime.zero.partitioned import (
    ZeroParamStatus,
    broadcast_full,
    committed,
    layout_epoch,
    param_name,
    refresh_shard,
    shard_is_view,
)


def take_gathered_edit(param: torch.Tensor) -> None:
    """Before the fetcher releases ``param`` (gathered, not kept whole):
    its data's slice into the shard if the parameter was written in place
    since its gather (module docstring)."""
    gathered = param.__dict__.get("_ds_gathered_version")
    if (gathered is not None and param._version != gathered and not param.ds_persist
            and not param.ds_pins and param.ds_status is ZeroParamStatus.AVAILABLE):
        refresh_shard(param)
        param._ds_gathered_version = param._version


def separate_whole(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The whole (``AVAILABLE``, persistent) parameters of ``params`` whose
    shard is a separate copy of part of ``data`` (world size > 1, or a shard
    in host memory): a write to their ``data`` does not reach the shard."""
    return [p for p in params if p.ds_persist and p.ds_status is ZeroParamStatus.AVAILABLE
            and not shard_is_view(p, committed(p))]


@torch.no_grad()
def adopt_full(params: Sequence[torch.Tensor], group: Any) -> None:
    """Take the full data of :func:`separate_whole` parameters as their value
    (collective over ``group``, every rank passing the same parameters):
    group rank 0's data to every rank, then each rank's shard from it."""
    broadcast_full(params, group)
    for p in params:
        refresh_shard(p)


@torch.no_grad()
def lend_scratch(param: torch.Tensor) -> None:
    """Give a gathered ``param`` a private copy of its full data until
    :func:`end_scratch` (module docstring); the data set aside is what
    :func:`~.partitioned.committed` returns meanwhile."""
    if param.ds_status is not ZeroParamStatus.AVAILABLE or "_ds_kept" in param.__dict__:
        raise DsrunError(f"{param_name(param)}: a scratch copy needs a gathered parameter "
                         f"that has none, got status {param.ds_status.name}")
    param._ds_kept = param.data
    param.data = param.data.clone()


def end_scratch(param: torch.Tensor) -> None:
    """Drop the scratch copy: the data :func:`lend_scratch` set aside is the
    parameter's again."""
    param.data = param.__dict__.pop("_ds_kept")


class EditTaker:
    """Before each step, for the parameters given (those whose shard is their
    value: frozen ones, and those whose master is their shard): this
    rank's slice of the full data of each :func:`separate_whole` one that
    no ``GatheredParameters`` holds goes into its shard (module docstring).
    The shard of a parameter with a separate master is overwritten from it
    by the step, so the stage-3 optimizer leaves those out.

    The copies are planned once - views of each slice and shard, batched per
    (source, destination) device pair - and planned again when what
    decides them may have changed: a parameter pinned or unpinned by a
    context, kept whole or no longer, moved
    (:func:`~.partitioned.layout_epoch`), or the data of a planned one
    replaced (``param.data = ...``: checked each step, one pointer each).
    Local copies only; padding stays zero."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self._epoch = -1
        # (parameter, data pointer, strides): a view's layout is its address and strides
        self._planned: list[tuple[torch.Tensor, int, tuple[int, ...]]] = []
        self._batches: list[tuple[bool, list[torch.Tensor], list[torch.Tensor]]] = []
        # non-contiguous data (channels_last, a transposed tensor): flattening it
        # copies, so its slice is read each step - (parameter, offset, count, shard)
        self._loose: list[tuple[torch.Tensor, int, int, torch.Tensor]] = []

    def _stale(self) -> bool:
        return self._epoch != layout_epoch() or any(
            p.data.data_ptr() != ptr or p.data.stride() != strides
            for p, ptr, strides in self._planned)

    def _plan(self) -> None:
        self._epoch = layout_epoch()
        ranks: dict[int, int] = {}
        pairs: dict[tuple[torch.device, torch.device],
                    tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._planned, self._loose = [], []
        for p in separate_whole(self.params):
            if p.ds_pins:
                continue  # the context holding it decides
            if id(p.ds_group) not in ranks:
                ranks[id(p.ds_group)] = dist.get_rank(p.ds_group)
            rank = ranks[id(p.ds_group)]
            valid = p.ds_spec.valid(rank)
            self._planned.append((p, p.data.data_ptr(), p.data.stride()))
            if not valid:
                continue
            dst = p.ds_tensor.narrow(0, 0, valid)
            if not p.data.is_contiguous():
                self._loose.append((p, rank * p.ds_spec.shard_numel, valid, dst))
            else:
                src = p.data.view(-1).narrow(0, rank * p.ds_spec.shard_numel, valid)
                srcs, dsts = pairs.setdefault((src.device, dst.device), ([], []))
                srcs.append(src)
                dsts.append(dst)
        self._batches = [(src_device != dst_device, srcs, dsts)
                         for (src_device, dst_device), (srcs, dsts) in pairs.items()]

    @torch.no_grad()
    def __call__(self) -> None:
        if self._stale():
            self._plan()
        for cross, srcs, dsts in self._batches:
            if cross:  # shards in host memory (offload_param): one copy out
                device = dsts[0].device
                srcs = list(torch.cat(srcs).to(device).split([d.numel() for d in dsts]))
            torch._foreach_copy_(dsts, srcs)
        for p, offset, count, dst in self._loose:
            dst.copy_(p.data.reshape(-1).narrow(0, offset, count))


class LocalRebind:
    """World size 1 without ``offload_param``: every parameter's ``data`` is
    a view of its shard, so edits in place reach the optimizer with no copy.
    A parameter whose ``data`` was replaced (``param.data = new``) is cut off
    from its shard: the step would update the shard and forward would go on
    reading ``new``, frozen at its value. Before each step, each such
    parameter gets a view of its shard back, with the new values copied in
    where the shard is the parameter's value (``take``: frozen ones and
    those whose master is the shard) and dropped where a separate master
    overwrites the shard - what :class:`EditTaker` does at world size > 1.

    Each step compares every parameter's data pointer with its shard's,
    read once and again when :func:`~.partitioned.layout_epoch` moves (a
    ``GatheredParameters`` context, a move): one ``data_ptr()`` call per
    parameter (~0.2 us on CPU). Only a parameter that differs - replaced
    data, or one lent a scratch copy by a context - is looked at further."""

    def __init__(self, params: Sequence[torch.Tensor], take: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self._take = {p.ds_id for p in take}
        self._epoch = -1
        self._shard_ptrs: list[tuple[torch.Tensor, int]] = []

    @torch.no_grad()
    def __call__(self) -> None:
        if self._epoch != layout_epoch():
            self._epoch = layout_epoch()
            self._shard_ptrs = [(p, p.ds_tensor.data_ptr()) for p in self.params]
        for p, ptr in self._shard_ptrs:
            if p.data_ptr() != ptr:
                self._rebind(p)

    def _rebind(self, p: torch.Tensor) -> None:
        """``p``'s data (or what a context set aside) a view of its shard again."""
        data = committed(p)
        if data.data_ptr() == p.ds_tensor.data_ptr() or p.ds_pins \
                or p.ds_status is not ZeroParamStatus.AVAILABLE:
            return
        if data.numel() != p.ds_numel:
            raise DsrunError(
                f"{param_name(p)}: its data was replaced by a tensor of "
                f"{data.numel()} elements (shape {tuple(data.shape)}); the parameter "
                f"has {p.ds_numel} {tuple(p.ds_shape)} - ZeRO stage 3 keeps each "
                "parameter's size from initialize(); assign a tensor of that size")
        shard = p.ds_tensor.narrow(0, 0, p.ds_numel)
        if p.ds_id in self._take:
            shard.copy_(data.reshape(-1))
        view = shard.view(p.ds_shape)
        if "_ds_kept" in p.__dict__:
            p._ds_kept = view
        else:
            p.data = view
