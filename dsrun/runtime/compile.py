"""DeepSpeed's ``engine.compile()``: ``torch.compile`` for the engine's forward.

``engine.compile(backend=get_accelerator().get_compile_backend(),
compile_kwargs={})`` compiles the wrapped module once; the engine's
forward then calls the compiled module, while ``engine.module`` stays the
plain module (its state dict, parameters and hooks are the same objects,
so checkpoints, ZeRO's gradient hooks and ``safe_get_*`` are unchanged).

Refused, with the reason: ZeRO stage 3 (its parameters are gathered and
released in module hooks around every forward, which graph capture cannot
follow), pipeline engines (compile the layers instead), and DeepSpeed's
``schedule=`` (its DeepCompile passes are not part of dsrun). A second
call is a no-op with a warning. The flops profiler's step runs the plain
module, so that its counts see every operator.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from dsrun.errors import DsrunError

log = logging.getLogger("dsrun.runtime.engine")

__all__ = ["compile_module"]


def compile_module(engine: Any, backend: Any = None,
                   compile_kwargs: Optional[dict[str, Any]] = None,
                   schedule: Any = None) -> Optional[Callable[..., Any]]:
    """The compiled forward for ``engine`` (``None``: it was compiled before)."""
    if schedule is not None:
        raise DsrunError("engine.compile(schedule=...) asks for DeepSpeed's DeepCompile "
                         "passes, which dsrun does not have: call engine.compile() without it")
    if engine.zero_stage == 3:
        raise DsrunError("engine.compile() at ZeRO stage 3 is not supported: stage 3 gathers "
                         "and releases parameters in hooks around each module's forward, "
                         "which torch.compile cannot capture; use ZeRO stage 0-2, or train "
                         "uncompiled")
    if engine.is_pipe_parallel:
        raise DsrunError("engine.compile() is not supported on a pipeline engine: compile "
                         "its layers with engine.module.compile() (DeepSpeed's "
                         "PipelineModule.compile), or torch.compile each layer before "
                         "building the PipelineModule")
    if engine.is_compiled:
        log.warning("engine.compile(): the module is compiled already; nothing to do")
        return None
    if compile_kwargs is not None and not isinstance(compile_kwargs, dict):
        raise DsrunError(f"engine.compile(compile_kwargs=...) must be a dict, got "
                         f"{type(compile_kwargs).__name__}")
    if backend is None:
        from dsrun.accelerator import get_accelerator

        backend = get_accelerator().get_compile_backend()
    return torch.compile(engine.module, backend=backend, **(compile_kwargs or {}))
