"""``zero.GatheredParameters`` and external parameters, with DeepSpeed's
names and arguments (:mod:`~.init` re-exports them).

**GatheredParameters(params, modifier_rank=None, fwd_module=None,
enabled=True).** Gathers the full values on entry (collective; parameters
gathered already are left as they are, pinned so that module hooks do not
release them inside the context). On exit, with ``modifier_rank`` set (a rank
of the parameters' group), that rank's values are broadcast, every rank
refreshes its shard (``ds_tensor``) and, when a :class:`~.stage3.ZeroStage3`
optimizer owns the parameter, its fp32 master; then what the context gathered
is released. Without ``modifier_rank`` modifications are dropped (as in
DeepSpeed), at every world size: the parameters the context gathered are
released, and those that were whole already (kept whole, or gathered by a
running forward) are lent a scratch copy of their data for the context and
get their own back on exit (:mod:`~.whole_edits`; at world size 1, where
every parameter is whole, that copies what the context holds - DeepSpeed
holds a gathered copy next to each shard there too). A context without
``modifier_rank`` nested in another one holding the parameter leaves its
edits to that one (published by a ``modifier_rank`` context, dropped by one
without); a ``modifier_rank`` context publishes even inside one without (as
DeepSpeed). One object is entered once at a time (a nested entry of the same
object is refused); an ``__enter__`` that fails part-way (out of memory in a
scratch copy) undoes what it did. ``fwd_module`` registers the parameters
as external parameters of that module.

Parameters that are not partitioned (stages 0-2) are whole on every rank
already: nothing is gathered. With ``modifier_rank``, those an engine trains
(:mod:`~dsrun.runtime.param_links`) get that rank's values on exit too - a
broadcast over the engine's data-parallel group, then the engine's master
of each (its fp32 copy, or this rank's part of it at stages 1-2) is set
from them, as ``safe_set_full_fp32_param`` does - so the edit holds on every
rank and survives the next step (DeepSpeed leaves them alone: the edit is
lost at its next step, and at stages 1-2 only part of it was kept).

**register_external_parameter(module, parameter).** ``parameter`` (of
another module) is used in ``module``'s forward: stage 3 gathers it with
``module``'s own (forward and backward). A parameter read through a module
attribute during a forward (``x @ self.emb.weight.t()`` in the parent's
forward) needs no registration: the stage-3 hooks gather it at that read and
register it with the innermost hooked module running, as DeepSpeed does
(:mod:`~.fetch`). Register explicitly what is reached another way (a
parameter kept in a list, a closure or a plain attribute).
"""

from __future__ import annotations

import itertools
import types
from typing import Any, Optional

import torch
import torch.distributed as dist

from dsrun import comm as collectives
from dsrun.errors import DsrunError
from dsrun.runtime.param_links import engine_of
from dsrun.runtime.zero.divergence import group_ranks, shared_guard
from dsrun.runtime.zero.partitioned import (
    ZeroParamStatus,
    gather,
    is_zero_param,
    layout_changed,
    param_name,
    refresh_shard,
    release,
)
from dsrun.runtime.zero.whole_edits import end_scratch, lend_scratch


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """``parameter`` is used in ``module``'s forward (module docstring)."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise DsrunError(f"register_external_parameter needs a Parameter, got "
                         f"{type(parameter).__name__}")
    _external_store(module)[id(parameter)] = parameter


def unregister_external_parameter(module: torch.nn.Module,
                                  parameter: torch.nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`: ``module``'s hooks no
    longer gather ``parameter`` (nothing happens if it was not registered)."""
    _external_store(module).pop(id(parameter), None)


def _external_store(module: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    """``module._external_params`` ({id: parameter}, registration order),
    made on first use with DeepSpeed's two methods over it:
    ``module.ds_external_parameters()`` (its items) and
    ``module.all_parameters()`` (the module's own, then the external ones)."""
    store = module.__dict__.get("_external_params")
    if store is None:  # bound methods: a deep copy of the module rebinds them
        store = module.__dict__["_external_params"] = {}
        module.__dict__["ds_external_parameters"] = types.MethodType(_external_items, module)
        module.__dict__["all_parameters"] = types.MethodType(_all_parameters, module)
    return store


def _external_items(module: torch.nn.Module) -> Any:
    return module.__dict__["_external_params"].items()


def _all_parameters(module: torch.nn.Module) -> Any:
    return itertools.chain(module.named_parameters(recurse=False), _external_items(module))


def _describe(params: list[torch.Tensor]) -> str:
    more = f" and {len(params) - 1} more" if len(params) > 1 else ""
    return param_name(params[0]) + more


class GatheredParameters:
    """DeepSpeed's ``zero.GatheredParameters`` (module docstring)."""

    def __init__(self, params: Any, modifier_rank: Optional[int] = None,
                 fwd_module: Optional[torch.nn.Module] = None, enabled: bool = True) -> None:
        items = [params] if isinstance(params, torch.Tensor) else list(params or ())
        self.params = [p for p in dict.fromkeys(items) if is_zero_param(p)]
        self.modifier_rank = modifier_rank
        # whole parameters an engine trains: published on exit too (module docstring)
        self.whole = [p for p in dict.fromkeys(items) if not is_zero_param(p)
                      and engine_of(p) is not None] if enabled and modifier_rank is not None \
            else []
        self.enabled = bool(enabled) and bool(self.params)
        # this entry's state: what it gathered, lent a scratch copy, pinned
        self._gathered: list[torch.Tensor] = []
        self._scratch: list[torch.Tensor] = []
        self._pinned = self._open = False
        if self.enabled:
            ranks = {group_ranks(p.ds_group) for p in self.params}
            if len(ranks) > 1:
                raise DsrunError("GatheredParameters got parameters of different groups: "
                                 f"{sorted(ranks)}")
            self.group = self.params[0].ds_group
            if fwd_module is not None:
                for p in self.params:
                    register_external_parameter(fwd_module, p)

    def __enter__(self) -> None:
        if not self.enabled:
            return
        if self._open:  # a second entry would lose the first one's scratch copies
            raise DsrunError(f"GatheredParameters over {_describe(self.params)} is open "
                             "already: nest a new GatheredParameters object, not the same one")
        need = [p for p in self.params if p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
        if need and dist.get_world_size(self.group) > 1:
            shared_guard(self.group).event("gather", _describe(need), [p.ds_id for p in need],
                                           [p.ds_numel for p in need])
        self._gathered = need
        try:
            gather(self.params)  # also completes gathers that module hooks left in flight
            self._pinned = True
            layout_changed()
            for p in self.params:
                p.ds_pins += 1
            if self.modifier_rank is None:  # edits of whole parameters are dropped on exit too
                gathered_here = {id(p) for p in need}
                for p in self.params:
                    if p.ds_pins == 1 and id(p) not in gathered_here:
                        lend_scratch(p)
                        self._scratch.append(p)
        except BaseException:  # out of memory in a clone, Ctrl-C: undo, as __exit__ would
            self._close()
            raise
        self._open = True

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self.whole and exc_type is None:
            publish_whole(self.whole, self.modifier_rank)  # type: ignore[arg-type]
        if not self.enabled:
            return
        try:
            if self.modifier_rank is not None and exc_type is None:
                self._publish()
        finally:
            self._close()

    def _close(self) -> None:
        """Unpin, give the scratch copies' parameters their data back, and
        release what this entry gathered (``__exit__``, or a failed ``__enter__``)."""
        try:
            for p in self._scratch:
                end_scratch(p)
            if self._pinned:
                layout_changed()
                for p in self.params:
                    p.ds_pins -= 1
            for p in self._gathered:
                release(p)
        finally:
            self._gathered, self._scratch = [], []
            self._pinned = self._open = False

    def _publish(self) -> None:
        """Broadcast ``modifier_rank``'s values; refresh shards and masters."""
        world = dist.get_world_size(self.group)
        if not 0 <= self.modifier_rank < world:  # type: ignore[operator]
            raise DsrunError(f"modifier_rank {self.modifier_rank} outside the parameters' "
                             f"group of {world} ranks")
        if world > 1:
            shared_guard(self.group).event(
                "modify", f"{_describe(self.params)} from rank {self.modifier_rank}",
                [p.ds_id for p in self.params], [p.ds_numel for p in self.params])
            src = (dist.get_global_rank(self.group, self.modifier_rank)
                   if self.group is not None else self.modifier_rank)
            with torch.no_grad():
                works = [collectives.broadcast(p.data, src=src, group=self.group, async_op=True)
                         for p in self.params if p.ds_numel]
                for work in works:
                    work.wait()
        for p in self.params:
            refresh_shard(p)
            callback = p.__dict__.get("_ds_on_modified")
            method = callback() if callback is not None else None
            if method is not None:
                method(p)


def publish_whole(params: list[torch.Tensor], modifier_rank: int) -> None:
    """Whole (stage 0-2) parameters an engine trains: ``modifier_rank``'s
    values to every rank of the engine's data-parallel group, then into the
    engine's masters (module docstring)."""
    from dsrun.runtime.zero.param_state import param_state

    by_engine: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for p in params:
        engine = engine_of(p)
        by_engine.setdefault(id(engine), (engine, []))[1].append(p)
    for engine, owned in by_engine.values():
        group = engine.dp_group
        world = dist.get_world_size(group)
        if not 0 <= modifier_rank < world:
            raise DsrunError(f"modifier_rank {modifier_rank} outside the engine's "
                             f"data-parallel group of {world} ranks")
        if world > 1:
            src = dist.get_global_rank(group, modifier_rank) if group is not None \
                else modifier_rank
            with torch.no_grad():
                works = [collectives.broadcast(p.data, src=src, group=group, async_op=True)
                         for p in owned if p.numel()]
                for work in works:
                    work.wait()
        for p in owned:
            state = param_state(p)
            if state is not None:  # frozen parameters have no master
                state.set_value(p.data)
