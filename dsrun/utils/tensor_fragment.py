"""DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*`` (and ``*_local_*``) API.

``deepspeed.utils.safe_get_full_fp32_param(param)`` and friends read and
write one parameter's fp32 master, gradient or per-element optimizer state
(``exp_avg``, ``exp_avg_sq`` of Adam) in a dsrun engine at any ZeRO stage.
Where the state lies is :mod:`dsrun.runtime.zero.param_state`'s business;
this module assembles the full tensor and checks the arguments.

**Collective.** At ZeRO stages 1-3 with more than one data-parallel rank a
full getter sums every rank's part over the data-parallel group: *every
rank must call it, for the same parameters in the same order* (at stage 3
the divergence guard names the first call where ranks differ). Setters
write only what this rank holds and communicate nothing, but every rank
must call them with the same full value, or the ranks' states diverge.
Stage 0 and world size 1 never communicate.

**None** is returned, as in DeepSpeed, for a parameter no optimizer
updates (frozen, or not in the engine's optimizer, or no dsrun engine's),
for a gradient where none exists since the last step, and for optimizer
state before the first step; setters do nothing for such a parameter.
``safe_get_full_grad`` of a parameter no optimizer updates answers its
``param.grad`` where it has one (DeepSpeed's first test), else None.
Setting optimizer state before the first step raises
:class:`~dsrun.errors.DsrunError` naming the parameter.

**When.** Gradients exist between ``engine.backward()`` and
``engine.step()`` (the mean over the data-parallel group of what the
micro-steps so far accumulated; under fp16 still multiplied by the loss
scale, as DeepSpeed's); reading one never reduces early. After the step:
None where the engine released the gradients (stage 0; stages 2-3 and
stage 1 without accumulation at world size > 1), zeros where it keeps
zeroed flat buffers (world size 1, stage 1 with accumulation). Setting the
fp32 value writes the master and the model parameter, so the next forward
and step use it.

Differences from DeepSpeed: at stage 0 dsrun answers the parameter (or its
fp16 master) where DeepSpeed answers None for fp32/fp16 optimizers it has
not linked; full getters return a new tensor (``safe_get_full_grad`` at
stage 0 and for a parameter no optimizer updates: ``param.grad`` itself,
as DeepSpeed); an unknown or non-per-element
optimizer state key raises :class:`~dsrun.errors.DsrunError` instead of a
``KeyError``/assertion; the local API raises it for a parameter that is not
a ZeRO stage 3 one (DeepSpeed asserts).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from dsrun.errors import DsrunError
from dsrun.runtime.param_links import engine_of
from dsrun.runtime.zero.param_state import ParamState, Part, Stage0Param, Stage3Param, param_state

__all__ = [
    "get_full_hp_grad", "get_full_hp_param", "set_full_hp_grad", "set_full_hp_param",
    "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
]


def _assemble(ps: ParamState, part: Optional[Part], what: str) -> Optional[torch.Tensor]:
    """The full fp32 tensor from every rank's part (a collective when sharded);
    None when no rank has one."""
    if not ps.sharded:
        if part is None:
            return None
        assert (part.start, part.end) == (0, ps.numel), (what, part.start, part.end)
        return part.values.detach().to(torch.float32, copy=True).view(ps.shape)
    # two extra elements count, among the ranks that hold some of the
    # parameter's elements, those that have a part (all of them or none) and
    # all of them: a rank whose share of the group is padding alone holds
    # nothing of it, and may have no gradient at all for its empty share
    out = torch.zeros(ps.numel + 2, dtype=torch.float32, device=ps.device)
    holds = ps.holds_elements()
    if part is not None:
        out[part.start:part.end].copy_(part.values)
    if holds:
        out[ps.numel] = float(part is not None)
        out[ps.numel + 1] = 1.0
    ps.all_reduce(out, what)
    have, holders = (int(round(float(v))) for v in out[ps.numel:])
    if have == 0:
        return None
    if have != holders:
        raise DsrunError(f"{what}: only {have} of the {holders} data-parallel ranks that "
                         "hold parts of this parameter have this value: the ranks' "
                         "optimizer states differ")
    return out[:ps.numel].view(ps.shape)


def _full(value: torch.Tensor, ps: ParamState, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: the value must be a tensor, got {type(value).__name__}")
    if value.numel() != ps.numel:
        raise DsrunError(f"{what}: the parameter has {ps.numel} elements {list(ps.shape)}, "
                         f"the value {value.numel()} {list(value.shape)}")
    return value


# ------------------------------------------------------------------ full


def safe_get_full_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The full fp32 master value of ``param`` (collective at stages 1-3)."""
    ps = param_state(param)
    return None if ps is None else _assemble(ps, ps.value(), "safe_get_full_fp32_param")


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``param``'s fp32 master and the model parameter to ``value``
    (the full tensor, the same on every rank)."""
    ps = param_state(param)
    if ps is not None:
        ps.set_value(_full(value, ps, "safe_set_full_fp32_param"))


def safe_get_full_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The full gradient of ``param`` (collective at stages 1-3): after
    ``engine.backward()``, before ``engine.step()``; None when it has none."""
    ps = param_state(param)
    if ps is None or isinstance(ps, Stage0Param):
        return param.grad  # DeepSpeed's answer whenever param.grad exists
    return _assemble(ps, ps.grad(), "safe_get_full_grad")


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace ``param``'s gradient (the full tensor, the same on every rank)
    before ``engine.step()`` uses it."""
    ps = param_state(param)
    if ps is not None:
        ps.set_grad(_full(value, ps, "safe_set_full_grad"))


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str
                                  ) -> Optional[torch.Tensor]:
    """The full per-element optimizer state ``optim_state_key`` (e.g.
    ``"exp_avg"``) of ``param`` in fp32 (collective at stages 1-3); None
    before the optimizer's first step."""
    ps = param_state(param)
    if ps is None:
        return None
    return _assemble(ps, ps.state(optim_state_key),
                     f"safe_get_full_optimizer_state({optim_state_key!r})")


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor,
                                  optim_state_key: str) -> None:
    """Set the per-element optimizer state ``optim_state_key`` of ``param``
    (the full tensor, the same on every rank); the optimizer must have stepped."""
    ps = param_state(param)
    if ps is None:
        return
    full = _full(value, ps, "safe_set_full_optimizer_state")
    if ps.state(optim_state_key) is None:  # this rank's part; no collective
        raise DsrunError(f"safe_set_full_optimizer_state: {_param_name(param)} has no optimizer "
                         f"state {optim_state_key!r} yet: the optimizer has not stepped")
    ps.set_state(optim_state_key, full)


def _param_name(param: torch.Tensor) -> str:
    """``param``'s name in its engine's module (stage 3 names its parameters
    ``ds_name``; stages 0-2 do not)."""
    engine = engine_of(param)
    names = () if engine is None else engine.module.named_parameters()
    name = getattr(param, "ds_name", None) or next((n for n, p in names if p is param), None)
    return name or f"a parameter of shape {tuple(param.shape)}"


# --------------------------------------------- DeepSpeed's parameter methods
# DeepSpeed binds these to each parameter (``p.get_full_hp_param()``, with
# ``p._hp_mapping``); dsrun keeps no links on parameters (so that a model
# pickles: dsrun.runtime.param_links), so they are functions of the
# parameter here, as DeepSpeed's module defines them, over the safe_* API.


def get_full_hp_param(param: torch.Tensor, optim_state_key: Optional[str] = None
                      ) -> Optional[torch.Tensor]:
    """``param``'s full fp32 master, or its optimizer state
    ``optim_state_key``: :func:`safe_get_full_fp32_param` /
    :func:`safe_get_full_optimizer_state` (collective at stages 1-3)."""
    if optim_state_key is None:
        return safe_get_full_fp32_param(param)
    return safe_get_full_optimizer_state(param, optim_state_key)


def set_full_hp_param(param: torch.Tensor, value: torch.Tensor,
                      optim_state_key: Optional[str] = None) -> None:
    """Set ``param``'s fp32 master (and the model parameter), or its
    optimizer state ``optim_state_key``, to the full ``value``:
    :func:`safe_set_full_fp32_param` / :func:`safe_set_full_optimizer_state`."""
    if optim_state_key is None:
        safe_set_full_fp32_param(param, value)
    else:
        safe_set_full_optimizer_state(param, value, optim_state_key)


def get_full_hp_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """``param``'s full gradient: :func:`safe_get_full_grad`."""
    return safe_get_full_grad(param)


def set_full_hp_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace ``param``'s gradient with the full ``value``: :func:`safe_set_full_grad`."""
    safe_set_full_grad(param, value)


# ----------------------------------------------------------------- local


def _stage3(param: torch.Tensor, what: str) -> Optional[Stage3Param]:
    engine = engine_of(param)
    if engine is None or engine.zero_stage != 3:
        where = "is no dsrun engine's" if engine is None else \
            f"belongs to an engine at ZeRO stage {engine.zero_stage}"
        raise DsrunError(f"{what} is defined for ZeRO stage 3 parameters only (as in "
                         f"DeepSpeed); this parameter {where}: use the safe_*_full_* functions")
    ps = param_state(param)
    assert ps is None or isinstance(ps, Stage3Param)
    return ps


def _copy(value: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if value is None else value.detach().to(torch.float32, copy=True)


def safe_get_local_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's shard of ``param``'s fp32 master (stage 3; padding included)."""
    ps = _stage3(param, "safe_get_local_fp32_param")
    return None if ps is None else _copy(ps.local_value())


def safe_get_local_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's shard of ``param``'s gradient (stage 3; padding included)."""
    ps = _stage3(param, "safe_get_local_grad")
    return None if ps is None else _copy(ps.local_grad())


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str
                                   ) -> Optional[torch.Tensor]:
    """This rank's shard of ``param``'s optimizer state ``optim_state_key`` (stage 3)."""
    ps = _stage3(param, "safe_get_local_optimizer_state")
    return None if ps is None else ps.local_state(optim_state_key)


def _set_local(param: torch.Tensor, what: str, apply: Callable[[Stage3Param], None]) -> None:
    ps = _stage3(param, what)
    if ps is not None:
        apply(ps)


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's shard of ``param``'s fp32 master and of the parameter
    (stage 3; ``value`` has the shard's padded size). Where the parameter
    is whole on this rank (kept whole, or gathered now) this rank's slice
    of its full data is set too: forward sees it at once, the other ranks'
    slices once they set theirs (or at the next step's refresh), and the
    next step keeps it. A released parameter sees it at its next gather."""
    _set_local(param, "safe_set_local_fp32_param", lambda ps: ps.set_local_value(value))


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's shard of ``param``'s gradient (stage 3) before the step."""
    _set_local(param, "safe_set_local_grad", lambda ps: ps.set_local_grad(value))


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor,
                                   optim_state_key: str) -> None:
    """Set this rank's shard of ``param``'s optimizer state (stage 3)."""
    _set_local(param, "safe_set_local_optimizer_state",
               lambda ps: ps.set_local_state(optim_state_key, value))
