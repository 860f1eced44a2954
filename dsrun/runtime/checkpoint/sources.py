"""State sources outside the ZeRO optimizers (:mod:`.fragments` interface).

* :class:`Stage0State` - ZeRO stage 0: the torch optimizer steps the model's
  own parameters (fp32, bf16 autocast) or fp32 masters of them (fp16,
  through the precision's ``optimizer_tensor``). Every data-parallel rank
  holds all of it, so every fragment is ``replicated``: the writer stores
  each element once, split among the ranks.
* :class:`ModuleTensors` - the module's parameters that no other source
  declares (frozen ones at stages 1-2, parameters outside the optimizer),
  whole and equal on every rank, so replicated too; and its persistent
  buffers, saved from the first rank of the replica group only (buffers
  such as BatchNorm statistics may differ between ranks: rank 0's are
  saved, as DeepSpeed does) and loaded into every rank.

:func:`parameter_names` gives the ``id -> name`` map every source takes and
:func:`aliases` the names of tied parameters and shared buffers (a second
name for a tensor already named), which the checkpoint records so that a
consolidated state dict has every key ``module.state_dict()`` has.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional

import torch

from dsrun.runtime.checkpoint.fragments import (
    ExportedState,
    Fragment,
    ImportPlan,
    LoadTarget,
    TensorInfo,
    check_state,
    group_hyperparameters,
    split_state,
    staged_state,
)


def parameter_names(module: torch.nn.Module) -> dict[int, str]:
    """``id(parameter) -> name``; a tied parameter gets its first name."""
    return {id(p): name for name, p in module.named_parameters()}


def persistent_buffers(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of the buffers ``module.state_dict()`` contains
    (each tensor once, under its first name)."""
    seen: set[int] = set()
    for prefix, sub in module.named_modules():
        for name, buf in sub._buffers.items():
            if buf is None or name in sub._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            yield (f"{prefix}.{name}" if prefix else name), buf


def aliases(module: torch.nn.Module) -> dict[str, str]:
    """Second names of tied parameters and shared buffers -> first name."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, buf in sub._buffers.items():
            if buf is None or name in sub._non_persistent_buffers_set:
                continue
            full = f"{prefix}.{name}" if prefix else name
            if id(buf) in first and first[id(buf)] != full:
                out[full] = first[id(buf)]
            else:
                first.setdefault(id(buf), full)
    return out


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1)


class Stage0State:
    """The stage-0 optimizer and the parameters it steps (module docstring)."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 precision: Any, replica: tuple[int, int]) -> None:
        self.module = module
        self.optimizer = optimizer
        self.precision = precision
        self.replica = replica

    def _entries(self, names: Mapping[int, str]
                 ) -> list[tuple[TensorInfo, torch.Tensor, torch.Tensor]]:
        """``(info, model parameter, optimizer tensor)`` per optimized parameter."""
        by_opt = {id(self.precision.optimizer_tensor(p)): p for p in self.module.parameters()}
        out = []
        for g, group in enumerate(self.optimizer.param_groups):
            for tensor in group["params"]:
                param = by_opt.get(id(tensor))
                if param is None or id(param) not in names:
                    raise ValueError(f"param group {g} holds a tensor of shape "
                                     f"{tuple(tensor.shape)} that is no parameter of the module: "
                                     "it cannot be checkpointed by name")
                info = TensorInfo(names[id(param)], tuple(param.shape), param.dtype, "param", g)
                out.append((info, param, tensor))
        return out

    def export_state(self, names: Mapping[int, str]) -> ExportedState:
        fragments = []
        entries = self._entries(names)
        for info, param, tensor in entries:
            if info.numel == 0:
                continue
            elementwise, scalars = split_state(self.optimizer.state.get(tensor, {}),
                                               tuple(tensor.shape), info.name)
            # a frozen fp16 parameter is its own value, not its master's
            value = self.precision.full_value(param)
            fragments.append(Fragment(info.name, 0, info.numel, _flat(value), elementwise,
                                      scalars, replicated=True))
        return ExportedState({i.name: i for i, _, _ in entries}, tuple(fragments),
                             group_hyperparameters(self.optimizer),
                             type(self.optimizer).__name__, self.replica)

    def prepare_import(self, names: Mapping[int, str],
                       state_keys: Optional[Sequence[str]]) -> ImportPlan:
        entries = self._entries(names)
        targets = []
        for info, _, tensor in entries:
            if info.numel == 0:
                continue
            # whole tensors: each key is filled completely or, when the
            # checkpoint lacks it, dropped by the loader
            state = {k: torch.empty(info.numel, dtype=tensor.dtype, device=tensor.device)
                     for k in state_keys or ()}
            targets.append(LoadTarget(info.name, 0, info.numel,
                                      torch.empty(info.numel, dtype=tensor.dtype,
                                                  device=tensor.device), state))
        return ImportPlan({i.name: i for i, _, _ in entries}, targets,
                          type(self.optimizer).__name__, (entries, {}))

    def check_import(self, plan: ImportPlan, groups: Optional[Sequence[Mapping[str, Any]]],
                     optimizer_states: bool) -> None:
        """The optimizer state the load installs, checked against the
        optimizer; nothing changes. A parameter the checkpoint has no
        optimizer state for (frozen when it was saved) gets fresh state."""
        entries, staged = plan.private
        staged.clear()
        if not optimizer_states:
            return
        tensors = {info.name: tensor for info, _, tensor in entries}
        states: dict[int, Optional[dict[str, Any]]] = {}
        for target in plan.targets:
            if target.loaded:
                tensor = tensors[target.name]
                state = {k: v.view(tensor.shape) for k, v in target.state.items()}
                states[id(tensor)] = {**state, **target.scalars} or None
        state_dict = staged_state(self.optimizer, states, groups)
        check_state(self.optimizer, state_dict)
        staged["state_dict"] = state_dict

    @torch.no_grad()
    def finish_import(self, plan: ImportPlan, groups: Optional[Sequence[Mapping[str, Any]]],
                      optimizer_states: bool) -> None:
        entries, staged = plan.private
        if optimizer_states and "state_dict" not in staged:
            self.check_import(plan, groups, optimizer_states)  # before anything changes
        by_name = {info.name: (param, tensor) for info, param, tensor in entries}
        for target in plan.targets:
            if target.loaded:
                param, tensor = by_name[target.name]
                tensor.copy_(target.value.view(tensor.shape))
                self.precision.sync_from_optimizer(param)
        if optimizer_states:
            self.optimizer.load_state_dict(staged.pop("state_dict"))


class ModuleTensors:
    """Whole parameters and buffers no other source declares (module docstring)."""

    def __init__(self, module: torch.nn.Module, skip: Sequence[str],
                 replica: tuple[int, int], parameters: bool = True) -> None:
        self.module = module
        self.skip = frozenset(skip)
        self.replica = replica
        self.parameters = parameters

    def _entries(self, names: Mapping[int, str]) -> list[tuple[TensorInfo, torch.Tensor]]:
        out = []
        if self.parameters:
            for name, p in self.module.named_parameters():
                if name not in self.skip:
                    out.append((TensorInfo(name, tuple(p.shape), p.dtype, "param"), p))
        for name, buf in persistent_buffers(self.module):
            out.append((TensorInfo(name, tuple(buf.shape), buf.dtype, "buffer"), buf))
        return out

    def export_state(self, names: Mapping[int, str]) -> ExportedState:
        entries = self._entries(names)
        first = self.replica[0] == 0
        fragments = tuple(Fragment(i.name, 0, i.numel, _flat(t), replicated=i.kind == "param",
                                   volatile=i.kind == "buffer")
                          for i, t in entries if i.numel and (i.kind == "param" or first))
        return ExportedState({i.name: i for i, _ in entries}, fragments, replica=self.replica)

    def prepare_import(self, names: Mapping[int, str],
                       state_keys: Optional[Sequence[str]]) -> ImportPlan:
        entries = self._entries(names)
        targets = [LoadTarget(i.name, 0, i.numel,
                              torch.empty(i.numel, dtype=t.dtype, device=t.device))
                   for i, t in entries if i.numel]
        return ImportPlan({i.name: i for i, _ in entries}, targets, None,
                          {i.name: t for i, t in entries})

    @torch.no_grad()
    def finish_import(self, plan: ImportPlan, groups: Optional[Sequence[Mapping[str, Any]]],
                      optimizer_states: bool) -> None:
        for target in plan.targets:
            if target.loaded:
                tensor = plan.private[target.name]
                tensor.copy_(target.value.view(tensor.shape))
