"""A ``torch.compile``-d module at ZeRO stage 3: refused when the hooks go in.

Stage 3 gathers and releases partitioned parameters in hooks around each
module's forward (:mod:`~.fetch`). A module compiled before
``initialize()`` - ``torch.compile(model)`` (a ``torch._dynamo``
``OptimizedModule``) or ``model.compile()`` - makes dynamo trace those hooks
too, and the first forward died in fake-tensor code with a bare
``IndexError``. ``engine.compile()`` refuses stage 3 for the same reason
(:mod:`dsrun.runtime.compile`); this refuses a compiled module in the tree
the hooks cover, with that reason, when :class:`~.fetch.ParamFetcher`
installs them - not where stage 3 installs none (world size 1 keeps every
parameter whole, as does a model whose parameters are all under
``stage3_param_persistence_threshold``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch

from dsrun.errors import DsrunError

__all__ = ["CompiledModuleError", "refuse_compiled"]


class CompiledModuleError(DsrunError):
    """A module compiled before ``initialize()`` whose forward ZeRO-3 hooks."""


def _compiled_how(module: torch.nn.Module) -> Optional[str]:
    dynamo = getattr(torch, "_dynamo", None)
    optimized = getattr(getattr(dynamo, "eval_frame", None), "OptimizedModule", None)
    if optimized is not None and isinstance(module, optimized):
        return "torch.compile(module), a torch._dynamo OptimizedModule"
    if module.__dict__.get("_compiled_call_impl") is not None:
        return "module.compile()"
    return None


def refuse_compiled(root: torch.nn.Module, hooked: Iterable[torch.nn.Module]) -> None:
    """Raise :class:`CompiledModuleError` if a compiled module of ``root``'s
    tree contains a module of ``hooked`` (the ones ZeRO-3 hooks)."""
    ids = {id(m) for m in hooked}
    for name, module in root.named_modules():
        how = _compiled_how(module)
        if how is None or not any(id(m) in ids for m in module.modules()):
            continue
        where = f"the module '{name}'" if name else "the model"
        inner = (f"{name}._orig_mod" if name else "model._orig_mod") \
            if how.startswith("torch.compile") else "built without module.compile()"
        raise CompiledModuleError(
            f"{where} was compiled before initialize() ({how}), and ZeRO stage 3 partitions "
            "its parameters: stage 3 gathers and releases parameters in hooks around each "
            "module's forward, which torch.compile cannot capture (engine.compile() at ZeRO "
            "stage 3 is not supported for the same reason). Pass the uncompiled module "
            f"({inner}) to initialize(); to compile, call "
            "engine.compile() after initialize() at ZeRO stage 0-2, or train uncompiled "
            "at stage 3")
