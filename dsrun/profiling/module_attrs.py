"""DeepSpeed's per-module profile attributes and the functions that read them.

While DeepSpeed's flops profiler profiles a model (from ``start_profile``
to ``end_profile``) every module of the model carries its figures as
attributes, and scripts read them directly or through
``get_module_flops`` / ``get_module_macs`` / ``get_module_duration``:

* ``__flops__`` / ``__macs__`` - what the module's own forward code ran,
  its children's forwards excluded (``get_module_flops(m)`` sums them over
  ``m.modules()``, so it includes the children's, and a module shared by
  two parents is counted once);
* ``__params__`` - its parameters, its children's included
  (``__expert_params__`` and ``__model_expert_params__`` are 0: dsrun has
  no mixture-of-experts layers);
* ``__duration__`` - seconds spent in its forward, all calls
  (``get_module_duration`` takes the children's sum for a module never
  called itself, such as a ``ModuleList``).

A module of an ``ignore_list`` type keeps zeros, and what it runs counts
toward the module that called it, as in DeepSpeed. ``stop_profile``
leaves the attributes in place; ``end_profile`` removes them.

dsrun's profiler keeps its figures in :class:`~dsrun.profiling.tree.ModuleStats`
and copies a module's onto it when the module's forward returns
(:func:`write`), so the attributes are current after every forward
without touching the module on every operator.
"""

from __future__ import annotations

from typing import Callable

import torch

from dsrun.profiling.tree import ModuleStats

__all__ = ["ATTRS", "get_module_duration", "get_module_flops", "get_module_macs", "remove",
           "reset", "write"]

#: the attributes DeepSpeed 0.19.8's ``reset_profile`` puts on every module
ATTRS = ("__flops__", "__macs__", "__params__", "__expert_params__", "__model_expert_params__",
         "__duration__")


def reset(model: torch.nn.Module, params: Callable[[torch.nn.Module], int]) -> None:
    """Zero every module's figures; ``params(module)`` gives ``__params__``."""
    for module in model.modules():
        module.__flops__ = 0
        module.__macs__ = 0
        module.__params__ = params(module)
        module.__expert_params__ = 0
        module.__model_expert_params__ = 0
        module.__duration__ = 0


def write(module: torch.nn.Module, stats: ModuleStats) -> None:
    """Copy ``stats``'s own counts and forward time onto ``module``."""
    module.__flops__ = stats.own_flops
    module.__macs__ = stats.own_macs
    module.__duration__ = stats.duration


def remove(model: torch.nn.Module) -> None:
    """Delete the attributes from every module that has them."""
    for module in model.modules():
        for name in ATTRS:
            module.__dict__.pop(name, None)


def _own(module: torch.nn.Module, name: str) -> float:
    try:
        return module.__dict__[name]
    except KeyError:
        raise AttributeError(
            f"{type(module).__name__} has no {name}: the flops profiler sets it on each module "
            "from start_profile() until end_profile(); read it in between") from None


def get_module_flops(module: torch.nn.Module) -> int:
    """Floating-point operations of ``module``'s forwards while profiling,
    its submodules' included (DeepSpeed's)."""
    return sum(_own(m, "__flops__") for m in module.modules())


def get_module_macs(module: torch.nn.Module) -> int:
    """Multiply-accumulates of ``module``'s forwards while profiling, its
    submodules' included (DeepSpeed's)."""
    return sum(_own(m, "__macs__") for m in module.modules())


def get_module_duration(module: torch.nn.Module) -> float:
    """Seconds in ``module``'s forwards while profiling; for a module that
    was never called itself, the sum of its children's (DeepSpeed's)."""
    duration = _own(module, "__duration__")
    if duration == 0:
        duration = sum(get_module_duration(child) for child in module.children())
    return duration
