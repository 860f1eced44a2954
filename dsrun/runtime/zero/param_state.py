"""One parameter's fp32 master, gradient and optimizer state on this rank.

What ``dsrun.utils.safe_get_full_fp32_param`` and friends
(:mod:`dsrun.utils.tensor_fragment`) read and write, at every ZeRO stage.
:func:`param_state` finds the engine that trains a parameter
(:mod:`dsrun.runtime.param_links`) and answers a :class:`ParamState`
(None for a parameter no engine's optimizer updates: frozen, or outside
the optimizer), which knows where this rank holds the parameter's elements:

* stage 0 (:class:`Stage0Param`): all of them, in the tensor the torch
  optimizer steps (the parameter itself, or its fp32 master under fp16);
* stages 1-2 (:class:`Stage12Param`): flat elements ``[start, end)`` - the
  intersection of the parameter with this rank's partition of its group's
  flat buffer - lying in the group's master from ``master_offset``;
* stage 3 (:class:`Stage3Param`): the real elements of this rank's shard,
  in the group's master at the parameter's slot.

Getters answer a :class:`Part`: this rank's contribution to the full
tensor (elements ``[start, end)``); ``None`` means this rank has no such
value (no gradient since the last step, no optimizer state before the first
step). The caller sums the parts over the data-parallel group.

**Gradients.** Between ``engine.backward()`` and ``engine.step()`` a
gradient lives either in the masters' ``.grad`` (reduced: stage 2, stage 1
without accumulation, stage 3 at world size > 1) or, not yet reduced, in
the parameters' own ``.grad`` - views of a flat gradient buffer that the
step reduces (stage 1 with accumulation, world size 1). The latter's part
is this rank's whole local gradient divided by the world size, so the sum is
the mean the step will use, and nothing of the optimizer's reduction state
changes (a read never reduces early). Under fp16 gradients are loss-scaled
until the step unscales them, as in DeepSpeed.

**Setters** take the full value, equal on every rank, and write this rank's
part: the master (and, for the optimizer state, the inner optimizer's
per-element state of each piece it spans) and the model parameter - whole
at stages 0-2, its shard (and its full data while gathered or kept whole)
at stage 3 - so the next forward and step use the new value without any
communication. The local setters (stage 3) write this rank's slice of
the full data likewise.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from dsrun.errors import DsrunError
from dsrun.runtime.param_links import engine_of
from dsrun.runtime.zero.masters import reduce_on_device
from dsrun.runtime.zero.partitioned import committed, shard_is_view


class Part(NamedTuple):
    """This rank's ``values`` (1-D) of the full tensor's flat elements ``[start, end)``."""

    start: int
    end: int
    values: torch.Tensor


def _name(param: torch.Tensor) -> str:
    """The parameter's name in its engine's module, for messages (stage 3
    keeps it as ``ds_name``; at stages 0-2 it is looked up - only on the way
    to an error)."""
    name = getattr(param, "ds_name", None)
    if name is None:
        module = getattr(engine_of(param), "module", None)
        if isinstance(module, torch.nn.Module):
            name = next((n for n, p in module.named_parameters() if p is param), None)
    return name or f"a parameter of shape {tuple(param.shape)}"


def _elementwise(value: Any, numel: int, key: str, param: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.numel() != numel:
        raise DsrunError(f"optimizer state {key!r} of {_name(param)} is not one value per "
                         "element: only per-element state (e.g. exp_avg, exp_avg_sq) can be "
                         "read or written per parameter")
    return value.detach().view(-1)


def _unknown(key: str, state: dict[str, Any], param: torch.Tensor) -> DsrunError:
    return DsrunError(f"the optimizer keeps no state {key!r} for {_name(param)}; it keeps "
                      f"{', '.join(sorted(map(str, state))) or 'none'}")


class ParamState:
    """Where one trained parameter's state lies on this rank (module docstring)."""

    stage = 0
    world_size = 1
    device: torch.device

    def __init__(self, param: torch.Tensor, engine: Any) -> None:
        self.param = param
        self.engine = engine
        self.shape = torch.Size(getattr(param, "ds_shape", None) or param.shape)
        self.numel = self.shape.numel()

    @property
    def sharded(self) -> bool:
        """True when the parts must be summed over the group (a collective)."""
        return self.world_size > 1

    def all_reduce(self, tensor: torch.Tensor, what: str) -> None:
        """Sum ``tensor`` over the data-parallel group (every rank calls it)."""

    def holds_elements(self) -> bool:
        """True when this rank holds some of the parameter's elements (a
        rank whose share of a small group is padding alone holds none)."""
        return True

    def value(self) -> Part:
        raise NotImplementedError  # pragma: no cover

    def grad(self) -> Optional[Part]:
        raise NotImplementedError  # pragma: no cover

    def state(self, key: str) -> Optional[Part]:
        raise NotImplementedError  # pragma: no cover

    def set_value(self, full: torch.Tensor) -> None:
        raise NotImplementedError  # pragma: no cover

    def set_grad(self, full: torch.Tensor) -> None:
        raise NotImplementedError  # pragma: no cover

    def set_state(self, key: str, full: torch.Tensor) -> None:
        raise NotImplementedError  # pragma: no cover


class Stage0Param(ParamState):
    """Stage 0: the optimizer steps ``tensor`` (the parameter, or its fp32 master)."""

    def __init__(self, param: torch.Tensor, engine: Any, tensor: torch.Tensor) -> None:
        super().__init__(param, engine)
        self.tensor = tensor
        self.device = tensor.device

    def value(self) -> Part:
        value = self.engine.precision.full_value(self.param)
        return Part(0, self.numel, value.detach().reshape(-1))

    def grad(self) -> Optional[Part]:
        grad = self.param.grad
        return None if grad is None else Part(0, self.numel, grad.reshape(-1))

    def _state(self) -> dict[str, Any]:
        return self.engine.optimizer.state.get(self.tensor, {})

    def state(self, key: str) -> Optional[Part]:
        state = self._state()
        if not state:
            return None  # the optimizer has not stepped yet
        if key not in state:
            raise _unknown(key, state, self.param)
        return Part(0, self.numel, _elementwise(state[key], self.numel, key, self.param))

    @torch.no_grad()
    def set_value(self, full: torch.Tensor) -> None:
        self.tensor.copy_(full.reshape(self.tensor.shape))
        self.engine.precision.sync_from_optimizer(self.param)

    @torch.no_grad()
    def set_grad(self, full: torch.Tensor) -> None:
        if self.param.grad is None:
            self.param.grad = full.detach().to(self.param.device, self.param.dtype) \
                .reshape(self.param.shape).clone()
        else:
            self.param.grad.copy_(full.reshape(self.param.grad.shape))

    @torch.no_grad()
    def set_state(self, key: str, full: torch.Tensor) -> None:
        part = self.state(key)
        if part is None:
            raise DsrunError(f"{_name(self.param)} has no optimizer state {key!r} yet: the "
                             "optimizer has not stepped")
        part.values.copy_(full.reshape(-1))


class ZeroParam(ParamState):
    """Stages 1-3: this rank's elements ``[start, end)`` of the parameter
    lie in master ``group`` from ``master_offset``."""

    def __init__(self, param: torch.Tensor, engine: Any, group: int, start: int, end: int,
                 master_offset: int) -> None:
        super().__init__(param, engine)
        self.opt = engine.optimizer
        self.stage = engine.zero_stage
        self.world_size = self.opt.world_size
        self.device = self.opt.comm_device
        self.group, self.start, self.end, self.master_offset = group, start, end, master_offset

    # what differs per stage
    def _unreduced(self) -> bool:
        """True while the gradient is in ``param.grad``, not reduced yet."""
        raise NotImplementedError  # pragma: no cover

    def _write_model(self, full: torch.Tensor) -> None:
        raise NotImplementedError  # pragma: no cover

    # shared
    def all_reduce(self, tensor: torch.Tensor, what: str) -> None:
        if self.world_size > 1:
            self._announce(what, tensor.numel())
            reduce_on_device(tensor, dist.ReduceOp.SUM, self.opt.group, self.opt.comm_device)

    def _announce(self, what: str, numel: int) -> None:
        """Stage 3 announces every collective to its divergence guard."""

    def holds_elements(self) -> bool:
        return self.end > self.start

    def _master(self, offset: int, length: int) -> torch.Tensor:
        return self.opt.masters[self.group].detach().narrow(0, offset, length)

    def value(self) -> Part:
        return Part(self.start, self.end, self._master(self.master_offset,
                                                       self.end - self.start))

    def _master_grad(self, offset: int, length: int) -> Optional[torch.Tensor]:
        """The reduced gradient of master elements ``[offset, offset + length)``,
        None when there is none since the last step."""
        self.opt._landing.wait()  # under offload: copies to the host may be in flight
        grad = self.opt.masters[self.group].grad
        if grad is None or (self.opt._fresh[self.group] and not self.opt._reduced):
            return None
        return grad.detach().narrow(0, offset, length)

    def grad(self) -> Optional[Part]:
        if self._unreduced():
            grad = self.param.grad
            if grad is None:
                return None
            local = grad.detach().reshape(-1)
            if self.world_size > 1:  # this rank's share of the mean the step will take
                local = local.float() * (1.0 / self.world_size)
            return Part(0, self.numel, local)
        grad = self._master_grad(self.master_offset, self.end - self.start)
        return None if grad is None else Part(self.start, self.end, grad)

    def _state_slice(self, offset: int, length: int, key: str) -> Optional[torch.Tensor]:
        """``key`` of master elements ``[offset, offset + length)``, gathered
        from the inner optimizer's pieces (a copy); None before the first step."""
        out = torch.empty(length, dtype=torch.float32, device=self.opt.masters[self.group].device)
        stepped = False
        for a, b, piece in self.opt._piece_spans(self.group):
            state = self.opt.optimizer.state.get(piece, {})
            if state:
                stepped = True
                if key not in state:
                    raise _unknown(key, state, self.param)
            lo, hi = max(a, offset), min(b, offset + length)
            if lo < hi:
                if not state:
                    return None
                values = _elementwise(state[key], piece.numel(), key, self.param)
                out[lo - offset:hi - offset].copy_(values[lo - a:hi - a])
        return out if stepped else None

    def _write_state(self, offset: int, values: torch.Tensor, key: str) -> None:
        """Write ``values`` into ``key`` of master elements from ``offset``."""
        length = values.numel()
        for a, b, piece in self.opt._piece_spans(self.group):
            lo, hi = max(a, offset), min(b, offset + length)
            if lo >= hi:
                continue
            state = self.opt.optimizer.state.get(piece, {})
            if key not in state:
                raise DsrunError(f"{_name(self.param)} has no optimizer state {key!r} yet: "
                                 "the optimizer has not stepped")
            target = _elementwise(state[key], piece.numel(), key, self.param)
            target[lo - a:hi - a].copy_(values[lo - offset:hi - offset])

    def state(self, key: str) -> Optional[Part]:
        values = self._state_slice(self.master_offset, self.end - self.start, key)
        return None if values is None else Part(self.start, self.end, values)

    @torch.no_grad()
    def set_value(self, full: torch.Tensor) -> None:
        flat = full.detach().reshape(-1)
        self._master(self.master_offset, self.end - self.start).copy_(
            flat[self.start:self.end])
        self._write_model(flat)

    @torch.no_grad()
    def set_grad(self, full: torch.Tensor) -> None:
        flat = full.detach().reshape(-1)
        if self._unreduced():
            if self.param.grad is None:
                raise DsrunError(f"{_name(self.param)} has no gradient to set: call it after "
                                 "engine.backward()")
            self.param.grad.copy_(flat.view(self.param.grad.shape))  # the step averages it
            return
        grad = self._master_grad(self.master_offset, self.end - self.start)
        if grad is None:
            raise DsrunError(f"{_name(self.param)} has no gradient to set: call it after "
                             "engine.backward() and before engine.step()")
        grad.copy_(flat[self.start:self.end])

    @torch.no_grad()
    def set_state(self, key: str, full: torch.Tensor) -> None:
        flat = full.detach().reshape(-1)
        if self._state_slice(self.master_offset, 0, key) is None:
            raise DsrunError(f"{_name(self.param)} has no optimizer state {key!r} yet: the "
                             "optimizer has not stepped")
        self._write_state(self.master_offset, flat[self.start:self.end], key)


class Stage12Param(ZeroParam):
    """Stages 1-2: the parameter is whole on every rank (a view of its
    group's flat buffer); this rank's master holds part of it."""

    def _unreduced(self) -> bool:
        return self.opt._reducer is None and not self.opt._reduced

    def _write_model(self, full: torch.Tensor) -> None:
        self.param.data.copy_(full.view(self.param.data.shape))


class Stage3Param(ZeroParam):
    """Stage 3: this rank's shard; the full data only while gathered."""

    @property
    def shard_numel(self) -> int:
        return self.param.ds_spec.shard_numel

    def _unreduced(self) -> bool:
        return self.opt._local and not self.opt._reduced

    def _announce(self, what: str, numel: int) -> None:
        self.opt.guard.event("utils", what, [self.param.ds_id], [numel])

    def _write_model(self, full: torch.Tensor) -> None:
        shard = self.param.ds_tensor.view(-1)
        shard.narrow(0, 0, self.end - self.start).copy_(full[self.start:self.end])
        self._write_whole(0, full)

    def _write_whole(self, start: int, values: torch.Tensor) -> None:
        """Write flat elements ``[start, start + len(values))`` into the full
        data where the parameter is whole here (gathered or persistent) and
        its shard is a separate copy: forward sees the value now, and the
        next step's taking of edits to whole parameters
        (:mod:`~.whole_edits`) finds data and shard agreeing instead of
        copying the old data back. The data a ``GatheredParameters``
        scratch copy stands in for is the one written (it is what the
        parameter gets back on exit)."""
        full = committed(self.param)
        if full.numel() != self.numel or shard_is_view(self.param, full):
            return  # released, or the shard (written already) is a view of it
        full.view(-1).narrow(0, start, values.numel()).copy_(values)

    # the local (padded shard) API, DeepSpeed's safe_*_local_*
    def local_value(self) -> torch.Tensor:
        return self._master(self.master_offset, self.shard_numel)

    def local_grad(self) -> Optional[torch.Tensor]:
        if self._unreduced():  # world size 1: the whole parameter is the shard
            grad = self.param.grad
            if grad is None:
                return None
            out = torch.zeros(self.shard_numel, dtype=torch.float32, device=grad.device)
            out[:self.numel].copy_(grad.reshape(-1))
            return out
        return self._master_grad(self.master_offset, self.shard_numel)

    def local_state(self, key: str) -> Optional[torch.Tensor]:
        return self._state_slice(self.master_offset, self.shard_numel, key)

    def _check_local(self, value: torch.Tensor) -> torch.Tensor:
        flat = value.detach().reshape(-1)
        if flat.numel() != self.shard_numel:
            raise DsrunError(f"{_name(self.param)}: the local shard has {self.shard_numel} "
                             f"elements (padding included), got a value of {flat.numel()}")
        return flat

    @torch.no_grad()
    def set_local_value(self, value: torch.Tensor) -> None:
        flat = self._check_local(value)
        self.local_value().copy_(flat)
        shard = self.param.ds_tensor.view(-1)
        n = min(shard.numel(), flat.numel())
        shard[:n].copy_(flat[:n])
        self._write_whole(self.start, flat[:self.end - self.start])

    @torch.no_grad()
    def set_local_grad(self, value: torch.Tensor) -> None:
        flat = self._check_local(value)
        if self._unreduced():
            if self.param.grad is None:
                raise DsrunError(f"{_name(self.param)} has no gradient to set: call it after "
                                 "engine.backward()")
            self.param.grad.copy_(flat[:self.numel].view(self.param.grad.shape))
            return
        grad = self._master_grad(self.master_offset, self.shard_numel)
        if grad is None:
            raise DsrunError(f"{_name(self.param)} has no gradient to set: call it after "
                             "engine.backward() and before engine.step()")
        grad.copy_(flat)

    @torch.no_grad()
    def set_local_state(self, key: str, value: torch.Tensor) -> None:
        flat = self._check_local(value)
        if self._state_slice(self.master_offset, 0, key) is None:
            raise DsrunError(f"{_name(self.param)} has no optimizer state {key!r} yet: the "
                             "optimizer has not stepped")
        self._write_state(self.master_offset, flat, key)


def _stage0(param: torch.Tensor, engine: Any) -> Optional[ParamState]:
    # A parameter frozen at initialize() is handed to the optimizer at stage
    # 0 (it trains once unfrozen), but until then it has no trained state:
    # None while it is still frozen, the rule of stages 1-3. One frozen
    # later keeps its trained master and state and answers, as there.
    if engine.optimizer is None:
        return None
    if not param.requires_grad and id(param) not in engine.precision.trainable_at_start:
        return None
    tensor = engine.precision.optimizer_tensor(param)
    stepped = any(t is tensor for g in engine.optimizer.param_groups for t in g["params"])
    return Stage0Param(param, engine, tensor) if stepped else None


def _stage12(param: torch.Tensor, engine: Any) -> Optional[ParamState]:
    opt = engine.optimizer
    for g, (layout, params) in enumerate(zip(opt.layouts, opt.param_groups_full)):
        for i, candidate in enumerate(params):
            if candidate is not param:
                continue
            offset = layout.offsets[i]
            if offset is None:
                return None  # frozen: no master
            first, last = layout.rank_range(opt.rank)
            lo, hi = max(offset, first), min(offset + layout.numels[i], last)
            if hi <= lo:  # this rank's partition holds none of it
                return Stage12Param(param, engine, g, 0, 0, 0)
            return Stage12Param(param, engine, g, lo - offset, hi - offset, lo - first)
    return None


def _stage3(param: torch.Tensor, engine: Any) -> Optional[ParamState]:
    opt = engine.optimizer
    slot = opt._slot.get(getattr(param, "ds_id", None))
    if slot is None:
        return None  # frozen (or not managed): no master
    spec = param.ds_spec
    start = opt.rank * spec.shard_numel
    return Stage3Param(param, engine, slot[0], start, start + spec.valid(opt.rank), slot[1])


_LOCATE = {0: _stage0, 1: _stage12, 2: _stage12, 3: _stage3}


def param_state(param: torch.Tensor) -> Optional[ParamState]:
    """Where ``param``'s trained state lies on this rank; None when no
    engine's optimizer updates it (module docstring)."""
    engine = engine_of(param)
    if engine is None:
        return None
    return _LOCATE[engine.zero_stage](param, engine)
