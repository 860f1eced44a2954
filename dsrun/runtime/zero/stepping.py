"""What the engine does differently at ZeRO stages: wrap, step, report.

* :func:`wrap_optimizer` rebuilds the engine's (client or config-built)
  optimizer as a :class:`~.sharded.ZeroOptimizer` (stages 1-2) or
  :class:`~.stage3.ZeroStage3` over this rank's partitions, with the
  config's ``zero_optimization`` knobs and gradient buckets in backward
  order (the reverse of ``module.parameters()``).
* :func:`zero_step` is the boundary step: reduce (stage 1), unscale and
  agree on overflow across ranks (fp16), clip by the global norm computed
  from all partitions, step, all-gather the updated partitions.
* :func:`memory_lines` is the one-block report of model-state bytes: the
  paper's formula for this config next to what this rank really holds.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from dsrun.runtime.precision import FullPrecision, StepResult
from dsrun.runtime.zero.memory import model_state_bytes, paper_model_state_bytes
from dsrun.runtime.zero.sharded import ZeroOptimizer, ZeroSettings
from dsrun.runtime.zero.stage3 import Stage3Settings, ZeroStage3

MiB = 1024 * 1024
DEEPSPEED_DEFAULT_BUCKET = 500_000_000  # elements
DEFAULT_REDUCE_BUCKET = 25_000_000  # elements: 100 MB of fp32 per bucket


def wrap_optimizer(optimizer: torch.optim.Optimizer, zero_config: Any, stage: int,
                   group: Any, module: torch.nn.Module, accumulation: int = 1,
                   device: Optional[torch.device] = None) -> Union[ZeroOptimizer, ZeroStage3]:
    """``accumulation`` 1: stage 1 also reduces during backward (overlapped)."""
    overrides = {}
    if zero_config.reduce_bucket_size == DEEPSPEED_DEFAULT_BUCKET:
        # DeepSpeed's default makes one bucket of the whole model: no overlap
        # with backward, and a gradient-sized scratch buffer. Treated as unset.
        overrides["reduce_bucket_size"] = DEFAULT_REDUCE_BUCKET
    if stage == 3:
        return ZeroStage3.from_optimizer(
            module, optimizer, group=group, device=device,
            settings=Stage3Settings.from_config(zero_config, **overrides))
    order = list(reversed([p for p in module.parameters() if p.requires_grad]))
    settings = ZeroSettings.from_config(zero_config, **overrides)
    return ZeroOptimizer.from_optimizer(optimizer, stage=stage, group=group,
                                        settings=settings, backward_order=order,
                                        reduce_in_backward=stage >= 2 or accumulation == 1)


def zero_step(zero: Union[ZeroOptimizer, ZeroStage3], precision: FullPrecision,
              max_norm: float) -> StepResult:
    zero.reduce_gradients()
    scaler = getattr(precision, "scaler", None)
    if scaler is not None:
        zero.scale_grads_(1.0 / scaler.scale)
        overflow = zero.has_overflow()  # one all_reduce: every rank agrees
        if scaler.update(overflow):
            return StepResult(False, None, overflow)
    norm: Optional[torch.Tensor] = zero.clip_grad_norm(max_norm) if max_norm > 0 else None
    zero.step()
    return StepResult(True, norm)


def memory_lines(module: torch.nn.Module, optimizer: Any, stage: int, world_size: int,
                 precision: str) -> list[str]:
    """Model-state bytes per rank: the formula and what this rank holds."""
    psi = sum(p.numel() for p in module.parameters())
    mixed = precision == "fp16"  # bf16 here keeps fp32 parameters (autocast)
    # K: Adam-like state. fp32 stage 0 steps the model's own parameters (8
    # bytes: two moments); every other case keeps a fp32 master copy too (12).
    k = 8 if stage == 0 and not mixed else 12
    expected = paper_model_state_bytes(psi, world_size, stage,
                                       precision="mixed" if mixed else "fp32", k=k)
    held = optimizer.state_bytes() if hasattr(optimizer, "state_bytes") else \
        model_state_bytes(list(module.parameters()), optimizer)
    lines = [
        f"model state: Ψ={psi:,} parameters, N={world_size} data-parallel ranks, "
        f"ZeRO stage {stage}, {precision}",
        f"  formula ({'mixed' if mixed else 'fp32'}, K={k}): "
        f"{expected / MiB:,.1f} MiB per rank",
        f"  held by this rank: params {held.params / MiB:,.1f} MiB, grads "
        f"{held.grads / MiB:,.1f} MiB, optimizer {held.optimizer / MiB:,.1f} MiB "
        f"(total {held.model_state / MiB:,.1f} MiB; buffers {held.buffers / MiB:,.1f} MiB)",
    ]
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        if free < expected:
            lines.append(f"  WARNING: only {free / MiB:,.0f} MiB free on this GPU, less "
                         f"than the {expected / MiB:,.0f} MiB of model state needed")
    return lines
