"""What the engine does differently at ZeRO stages: wrap, step, report.

* :func:`wrap_optimizer` rebuilds the engine's (client or config-built)
  optimizer as a :class:`~.sharded.ZeroOptimizer` (stages 1-2) or
  :class:`~.stage3.ZeroStage3` over this rank's partitions, with the
  config's ``zero_optimization`` knobs and gradient buckets in backward
  order (the reverse of ``module.parameters()``), and links the
  precision's loss scaler (fp16) for DeepSpeed's ``cur_scale``.
* :func:`zero_step` is the boundary step: reduce (stage 1), agree on
  overflow across ranks and unscale by backward's scale (fp16), compute the
  global norm from all partitions (and, with a model-parallel mpu, over its
  model-parallel group too) - a non-finite one skips the step in fp32 and
  bf16 (as DeepSpeed's ZeRO optimizers; the norm is the same on every rank),
  checked before clipping, and the skipped round's accumulators are zeroed
  at the next ``zero_grad`` (:meth:`~.masters.MasterGradients.discard_round`) -,
  clip, step, all-gather the updated partitions.
* :func:`memory_lines` is the one-block report of model-state bytes (the
  paper's formula for this config next to what this rank really holds)
  and of the communication per optimizer step (:func:`comm_volume`).
* :func:`offload_notes` checks the ``offload_*`` sections against the stage
  and the device, and names the DeepSpeed keys dsrun does not act on (the
  optimizers read the sections through their settings).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import torch

from dsrun.errors import DsrunConfigError
from dsrun.runtime.loss_scaler import LossScaler, UnitLossScaler
from dsrun.runtime.norms import ModelParallel
from dsrun.runtime.precision import FullPrecision, StepResult, skipped
from dsrun.runtime.zero.comm import CommStrategy, strategy_for
from dsrun.runtime.zero.memory import model_state_bytes, paper_model_state_bytes
from dsrun.runtime.zero.sharded import ZeroOptimizer, ZeroSettings
from dsrun.runtime.zero.stage3 import Stage3Settings, ZeroStage3

MiB = 1024 * 1024
DEEPSPEED_DEFAULT_BUCKET = 500_000_000  # elements
DEFAULT_REDUCE_BUCKET = 25_000_000  # elements: 100 MB of fp32 per bucket
# Stage 3 keeps its buckets (one filling, one in flight) between steps, next
# to gathered parameters: a smaller bucket keeps its peak memory at FSDP2's
# (per-block reductions) and reduces as fast on gloo (bench/collectives.py).
DEFAULT_STAGE3_REDUCE_BUCKET = 6_250_000  # elements: 25 MB of fp32
# DeepSpeed's stage3_prefetch_bucket_size default (5e7 elements) gathers up
# to 200 MB of fp32 ahead; overlap needs the next module or two. dsrun's
# default is about one transformer block of a ~1B model ahead (FSDP2's
# depth), which is also what the end of forward keeps for backward.
DEEPSPEED_DEFAULT_PREFETCH = 50_000_000  # elements
DEFAULT_PREFETCH = 12_500_000  # elements: 50 MB of fp32
SUPER_OFFLOAD_CORES = 0.8  # offload_optimizer.cpuadam_cores_perc's default


def wrap_optimizer(optimizer: Optional[torch.optim.Optimizer], zero_config: Any, stage: int,
                   group: Any, module: torch.nn.Module, accumulation: int = 1,
                   device: Optional[torch.device] = None,
                   loss_scaler: Optional[LossScaler] = None,
                   comm_dtype: Optional[torch.dtype] = None,
                   model_parallel: Optional[ModelParallel] = None
                   ) -> Union[ZeroOptimizer, ZeroStage3]:
    """``accumulation`` 1: stage 1 also reduces during backward (overlapped).
    ``model_parallel``: the mpu's model-parallel group of more than one
    rank, over which the step's norm and overflow flag are reduced too
    (:mod:`~.masters`).
    ``comm_dtype``: the config's ``communication_data_type`` (None: the
    parameters' dtype).
    ``loss_scaler``: the precision's (fp16), which the optimizer's
    ``cur_scale`` / ``loss_scale`` report; None (bf16, fp32): a
    :class:`~dsrun.runtime.loss_scaler.UnitLossScaler`, as DeepSpeed's. ``optimizer`` None (stage 3
    only): partition the module without training it."""
    wrapped = _wrap(optimizer, zero_config, stage, group, module, accumulation, device,
                    comm_dtype)
    # without loss scaling: DeepSpeed's scale-1.0 scaler, for scripts that read it
    wrapped.loss_scaler = loss_scaler if loss_scaler is not None else UnitLossScaler()
    wrapped.model_parallel = model_parallel
    # the narrowest trainable dtype bounds what a sum may hold (an fp32
    # parameter first in a float16 model must not turn the range check off)
    wrapped.grad_dtype = min((p.dtype for p in module.parameters()
                              if p.requires_grad and p.is_floating_point()),
                             key=lambda dtype: dtype.itemsize, default=None)
    return wrapped


def _wrap(optimizer: Optional[torch.optim.Optimizer], zero_config: Any, stage: int, group: Any,
          module: torch.nn.Module, accumulation: int, device: Optional[torch.device],
          comm_dtype: Optional[torch.dtype]) -> Union[ZeroOptimizer, ZeroStage3]:
    overrides: dict[str, Any] = {} if comm_dtype is None else {"comm_dtype": comm_dtype}
    if zero_config.reduce_bucket_size == DEEPSPEED_DEFAULT_BUCKET:
        # DeepSpeed's default makes one bucket of the whole model: no overlap
        # with backward, and a gradient-sized scratch buffer. Treated as unset.
        overrides["reduce_bucket_size"] = DEFAULT_STAGE3_REDUCE_BUCKET if stage == 3 \
            else DEFAULT_REDUCE_BUCKET
    if stage == 3:
        if zero_config.prefetch_bucket_size == DEEPSPEED_DEFAULT_PREFETCH:
            overrides["prefetch_bucket_size"] = DEFAULT_PREFETCH
        settings3 = Stage3Settings.from_config(zero_config, **overrides)
        if optimizer is None:
            return ZeroStage3.without_optimizer(module, group=group, device=device,
                                                settings=settings3,
                                                leaf_module=zero_config.leaf_module)
        return ZeroStage3.from_optimizer(module, optimizer, group=group, device=device,
                                         settings=settings3, leaf_module=zero_config.leaf_module)
    assert optimizer is not None, "stages 1-2 need an optimizer (the engine checks)"
    order = list(reversed([p for p in module.parameters() if p.requires_grad]))
    settings = ZeroSettings.from_config(zero_config, **overrides)
    return ZeroOptimizer.from_optimizer(optimizer, stage=stage, group=group,
                                        settings=settings, backward_order=order,
                                        reduce_in_backward=stage >= 2 or accumulation == 1)


def offload_notes(zero_config: Any, stage: int, device: torch.device, source: str
                  ) -> list[tuple[int, str]]:
    """What the engine logs about the ``offload_*`` sections, as (logging
    level, text) (pure). Sections this stage ignores get a warning, as
    DeepSpeed ignores them, whatever their device; a used one on "nvme" is
    refused (ZeRO-Infinity is not implemented); "cpu" on CPU ranks gets a
    note that it is a no-op (the state is in host memory already); the
    stage-3 keys that change what DeepSpeed does but not dsrun get one
    warning (:func:`unapplied_offload_keys`)."""
    notes = []
    for name, first_stage in (("offload_optimizer", 1), ("offload_param", 3)):
        section = getattr(zero_config, name, None)
        target = getattr(section, "device", None) or "none"
        if target == "none":
            continue
        if stage < first_stage:
            needs = "stage 3" if first_stage == 3 else "ZeRO stage 1, 2 or 3"
            notes.append((logging.WARNING, f"zero_optimization.{name} ({source}) needs "
                                           f"{needs}; at stage {stage} it is ignored"))
            continue
        if target != "cpu":
            raise DsrunConfigError(f"zero_optimization.{name}.device={target!r} ({source}): "
                                   "NVMe offload (ZeRO-Infinity) is not implemented in dsrun; "
                                   'use "cpu" or "none"')
        if device.type == "cpu":
            notes.append((logging.INFO, f"zero_optimization.{name}.device=cpu: these are CPU "
                                        "ranks, so that state already lives in host memory "
                                        "(offload is a no-op)"))
    unapplied = unapplied_offload_keys(zero_config, stage)
    if unapplied:
        notes.append((logging.WARNING,
                      f"zero_optimization.offload_optimizer ({source}): {'; '.join(unapplied)}: "
                      "not acted on - dsrun offloads all of the optimizer state and steps it "
                      "in host memory with the inner torch optimizer (it has no partial "
                      "offload and no SuperOffload)"))
    return notes


def unapplied_offload_keys(zero_config: Any, stage: int) -> list[str]:
    """The used ``offload_optimizer`` keys with which DeepSpeed 0.19.8 would
    place or step the state otherwise (stage 3: ``ratio`` < 1 keeps part of
    it on the GPU; ``super_offload`` is its SuperOffload optimizer, and
    ``cpuadam_cores_perc`` that optimizer's share of the cores) (pure)."""
    section = getattr(zero_config, "offload_optimizer", None)
    if stage != 3 or getattr(section, "device", "none") == "none":
        return []
    keys = []
    if section.ratio < 1.0:
        keys.append(f"ratio={section.ratio:g} (DeepSpeed keeps {1 - section.ratio:.0%} of "
                    "the optimizer state and its step on the GPU)")
    if section.super_offload:
        cores = section.cpuadam_cores_perc
        keys.append("super_offload=true (DeepSpeed's SuperOffload optimizer"
                    + (f", cpuadam_cores_perc={cores:g})" if cores != SUPER_OFFLOAD_CORES
                       else ")"))
    return keys


def zero_step(zero: Union[ZeroOptimizer, ZeroStage3], precision: FullPrecision,
              max_norm: float) -> StepResult:
    zero.reduce_gradients()
    scaler = getattr(precision, "scaler", None)
    if scaler is not None:
        scale = scaler.scale  # backward's; update() may grow it for the next step
        # on the scaled sums, in the model dtype's range: one all_reduce, every rank agrees
        overflow = zero.has_overflow()
        if scaler.update(overflow):
            zero.discard_round()
            # the norm of non-finite gradients, as stage 0 and DeepSpeed's ZeRO report it
            return skipped()
        # by the scale backward used (DeepSpeed's ZeRO divides by the grown one)
        zero.scale_grads_(1.0 / scale)
    # the norm always, as DeepSpeed's ZeRO optimizers: get_global_grad_norm() reports it
    norm: Optional[torch.Tensor] = zero.grad_norm()
    # checked before clipping, as DeepSpeed: a skipped round's gradients stay
    # as backward left them (the skip warning names the first bad parameter)
    if precision.skips_nonfinite and not bool(torch.isfinite(norm)):
        zero.discard_round()
        return skipped()
    zero.clip_to(norm, max_norm)
    zero.apply_step()
    return StepResult(True, norm)


def comm_volume(stage: int, strategy: Optional[CommStrategy], accumulation: int = 1
                ) -> tuple[int, int, str]:
    """Data moved per optimizer step, in multiples of Ψ elements (pure):
    ``(paper, dsrun, how)``. The paper counts an all-reduce as 2Ψ and a
    reduce-scatter or all-gather as Ψ: 2Ψ for data parallelism and stages
    1-2, 3Ψ for stage 3. dsrun's own figure follows the collectives
    ``strategy`` picks (gloo: an all-reduce in place of each reduce-scatter),
    with stages 2-3 reducing every micro-step of an ``accumulation``."""
    if stage == 0:
        return 2, 2, "all-reduce of gradients (at the accumulation boundary)"
    if strategy is None:
        strategy = CommStrategy()
    reduce_cost = 1 if strategy.reduce == "reduce_scatter" else 2
    reduce_name = "reduce-scatter" if reduce_cost == 1 else "all-reduce"
    gather_name = "all-gather" if strategy.gather == "all_gather" else "broadcast from owners"
    rounds = accumulation if stage >= 2 else 1
    reduce_part = reduce_cost * rounds
    if stage in (1, 2):
        how = (f"{reduce_name} of gradients ({reduce_cost}Ψ"
               f"{f' x {rounds} micro-steps' if rounds > 1 else ''}) + {gather_name} of "
               "updated partitions (Ψ)")
        return 2, reduce_part + 1, how
    how = (f"{gather_name} of parameters in forward and backward (2Ψ) + {reduce_name} of "
           f"gradients ({reduce_cost}Ψ{f' x {rounds} micro-steps' if rounds > 1 else ''})")
    return 3, reduce_part + 2 * accumulation, how


def memory_lines(module: torch.nn.Module, optimizer: Any, stage: int, world_size: int,
                 precision: str, accumulation: int = 1) -> list[str]:
    """Model-state bytes per rank (the formula and what this rank holds)
    and the communication per optimizer step."""
    psi = sum(p.numel() for p in module.parameters())
    mixed = precision == "fp16"  # bf16 here keeps fp32 parameters (autocast)
    # K: Adam-like state. fp32 parameters are their own fp32 masters (stage 0
    # steps them; ZeRO masters alias their flat buffers): 8 bytes, two
    # moments. A separate fp32 master (fp16, or offload to host) adds 4: 12.
    offload = getattr(getattr(optimizer, "placement", None), "offload_optimizer", False)
    k = 8 if not mixed and not offload else 12
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
    if world_size > 1:
        strategy = getattr(optimizer, "strategy", None)
        if strategy is None and stage > 0 and torch.distributed.is_initialized():
            device = getattr(getattr(optimizer, "placement", None), "device", None)
            strategy = strategy_for(getattr(optimizer, "group", None), device)
        paper, ours, how = comm_volume(stage, strategy, accumulation)
        dtype = getattr(optimizer, "comm_dtype", None) or next(
            (p.dtype for p in module.parameters()), torch.float32)
        unit = psi * dtype.itemsize / MiB
        lines.append(f"  communication per step: paper {paper}Ψ ({paper * unit:,.1f} MiB "
                     f"of {str(dtype).replace('torch.', '')}); dsrun {ours}Ψ "
                     f"({ours * unit:,.1f} MiB): {how}")
    placement = getattr(optimizer, "placement", None)
    on_device = expected
    if placement is not None and placement.offloads:
        lines.append(f"  offloaded to host memory: {held.host / MiB:,.1f} MiB "
                     f"(offload_optimizer={placement.offload_optimizer}, "
                     f"offload_param={placement.offload_param})")
        on_device = max(expected - held.host, 0)
    device = getattr(placement, "device", None) or next(
        (p.device for p in module.parameters()), None)
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        if free < on_device:
            lines.append(f"  WARNING: only {free / MiB:,.0f} MiB free on this GPU, less "
                         f"than the {on_device / MiB:,.0f} MiB of model state it needs")
    return lines
