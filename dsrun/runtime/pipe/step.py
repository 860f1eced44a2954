"""The optimizer step of a pipeline engine: one norm over all stages (and
which ZeRO stages it works with: :func:`check_pipeline_zero`; that every
stage has something to train: :func:`check_stages_train`).

Each rank holds only its stage's gradients, so what a single process would
compute - the global gradient norm for ``gradient_clipping``, and for fp16
whether any gradient overflowed - needs one all-reduce over the whole
world of each rank's share of the squared norm:

* ZeRO stage 0: a replica holds its stage's full (averaged) gradients,
  identical on every replica, so each rank contributes its sum of squares
  divided by the number of replicas;
* ZeRO stages 1-2: each element of a stage's gradient lies in exactly one
  rank's partition, so each rank contributes its partition's sum of squares.

Tied weights held by several stages count once: copies that are not the
primary one are left out (:meth:`~.tied.TiedWeights.duplicates`). A
non-finite norm is an fp16 overflow on every rank at once (inf and NaN
survive the sum; at ZeRO 1-2 a scaled fp32 partition sum that float16
cannot hold counts as inf, as in :mod:`~dsrun.runtime.zero.masters`), so
all stages skip the step together; so is it in bf16
and fp32 where the precision skips those (``skips_nonfinite``). Everything then
proceeds as in one process: the same clip coefficient (torch's rule), the
same update. With ``measure_norm`` (a monitor writes the norm) the norm's
all-reduce runs even when neither clipping nor fp16 needs it.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from dsrun import comm as collectives
from dsrun.runtime.monitor.timers import comm_wait
from dsrun.runtime.norms import CLIP_EPS
from dsrun.runtime.pipe.errors import PipeAssertionError, PipeValueError
from dsrun.runtime.precision import FP16Master, FullPrecision, StepResult, skipped


def _squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        total = total + torch.linalg.vector_norm(grad, dtype=torch.float32).double() ** 2
    return total


def _zero_duplicate_squares(zero: Any, duplicates: set[int], device: torch.device
                            ) -> torch.Tensor:
    """Squares of the duplicate tied parameters' elements in this rank's partitions."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    if not duplicates:
        return total
    for g, layout in enumerate(zero.layouts):
        members = {i for i, p in enumerate(zero.param_groups_full[g]) if id(p) in duplicates}
        grad = zero.masters[g].grad
        if not members or grad is None:
            continue
        start, _ = layout.rank_range(zero.rank)
        for piece in layout.pieces(zero.rank):
            if piece.param in members:
                part = grad.narrow(0, piece.flat_offset - start, piece.length)
                total = total + torch.linalg.vector_norm(part, dtype=torch.float32).double() ** 2
    return total


def _stage_grads(precision: FullPrecision, duplicates: set[int]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(every gradient to clip, those that count in the norm) at ZeRO stage 0."""
    grads = [(p, g) for p, g in precision.unscaled_grads() if g is not None]
    return [g for _, g in grads], [g for p, g in grads if id(p) not in duplicates]


def pipeline_step(engine: Any, measure_norm: bool = False) -> StepResult:
    """Clip, check and apply one step of a :class:`~.engine.PipelineEngine`
    (module docstring); returns what ``precision.step`` would, with the
    norm also when only ``measure_norm`` asked for it."""
    precision, max_norm = engine.precision, engine.config.gradient_clipping
    scaler = getattr(precision, "scaler", None)
    duplicates = engine.module.tied_weights.duplicates()
    device = engine.device
    zero = engine.optimizer if engine.zero_stage > 0 else None
    out_of_range: Optional[torch.Tensor] = None
    if zero is not None:
        # the data-parallel reduction, for the breakdown's comm_reduce (a
        # wait ZeRO times itself is nested inside and counts once)
        with comm_wait("reduce"):
            zero.reduce_gradients()
        if scaler is not None:
            # a scaled micro-step sum float16 cannot hold is an overflow, as
            # in a float16 accumulation (zero/masters.py): checked before unscaling
            out_of_range = zero.local_overflow()
            zero.scale_grads_(1.0 / scaler.scale)
        to_clip = [m.grad for m in zero.masters if m.grad is not None]
        share = _squares(to_clip, device) - _zero_duplicate_squares(zero, duplicates, device)
    else:
        to_clip, counted = _stage_grads(precision, duplicates)
        share = _squares(counted, device) / engine.dp_world_size
    norm: Optional[torch.Tensor] = None
    checked = scaler is not None or precision.skips_nonfinite
    if out_of_range is not None:
        # inf where a sum is out of range, on the device: every stage's norm is
        # then non-finite and all skip together (no extra host sync)
        share = share + torch.where(out_of_range.to(share.device), math.inf, 0.0)
    if max_norm > 0 or checked or measure_norm:
        if dist.get_world_size() > 1:
            collectives.all_reduce(share)
        norm = share.clamp(min=0).sqrt().float()
    overflow = checked and not bool(torch.isfinite(norm))
    if scaler is not None:
        scaler.update(overflow)
    if overflow:
        return skipped(norm)
    if max_norm > 0:
        assert norm is not None
        coefficient = torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)
        for grad in to_clip:  # offloaded masters' grads are in host memory
            grad.mul_(coefficient.to(device=grad.device, dtype=grad.dtype))
    if zero is not None:
        zero.apply_step()
        return StepResult(True, norm)
    engine.optimizer.step()
    if isinstance(precision, FP16Master):
        precision.copy_back()
    return StepResult(True, norm)


def check_pipeline_zero(config: Any, module: Any) -> None:
    """ZeRO stages a pipeline engine can step with (stage 3 never, stage 2
    without tied weights across stages), else one error saying why."""
    stage = config.zero_optimization.stage
    if stage == 3:
        raise PipeAssertionError(
            f"ZeRO stage 3 ({config.source}) cannot be combined with pipeline parallelism: "
            "each stage already holds only its own layers; use ZeRO stage 1 (or 2) to "
            "partition optimizer state within each stage's data-parallel group")
    if stage == 2 and module.tied_weights:
        keys = sorted({e.key for e in module.tied_weights.entries})
        raise PipeAssertionError(
            f"ZeRO stage 2 ({config.source}) reduces gradients during every backward, "
            f"before the gradients of tied layers {keys} can be summed across the stages "
            "that hold them: use ZeRO stage 1 with TiedLayerSpec layers")


def _given_count(model_parameters: Any) -> Optional[int]:
    """How many parameters ``initialize(model_parameters=...)`` hands the
    optimizer (tensors, or param-group dicts with ``"params"``); None when
    not given (the module's own parameters are used) or not countable
    without reading it: a generator, at the top or as a group's
    ``"params"``, is read once, so it is left for the optimizer."""
    if not isinstance(model_parameters, (list, tuple)):
        return None
    count = 0
    for item in model_parameters:
        params = item.get("params", []) if isinstance(item, dict) else item
        if isinstance(params, torch.Tensor):
            count += 1
        elif isinstance(params, (list, tuple)):
            count += len(params)
        else:
            return None
    return count


def _stages(module: Any, stages: list[int]) -> str:
    parts, names = list(module.parts), module._layer_names
    return "; ".join(f"{s} (layers {parts[s]}-{parts[s + 1] - 1}: "
                     f"{', '.join(dict.fromkeys(names[parts[s]:parts[s + 1]]))})"
                     for s in stages)


def check_stages_train(module: Any, config: Any, optimizer: Any, device: torch.device,
                       model_parameters: Any = None) -> None:
    """An optimizer the engine builds (the config's, or ``initialize()``'s
    callable) needs parameters on every stage (frozen ones count: they go
    into the optimizer and train once unfrozen); otherwise every rank
    raises the same error naming the stages without any and the partition
    (one all-reduce over the world: a rank knows only its own stage's
    parameters). A stage that owns parameters but gets none from
    ``model_parameters`` (a frozen stage, with only the trainable ones
    passed) is named too, instead of torch's "empty parameter list"."""
    builds = not isinstance(optimizer, torch.optim.Optimizer) and \
        (optimizer is not None or config.optimizer is not None)
    stages = module.num_stages
    owns = any(True for _ in module.parameters())
    flags = torch.zeros(2 * stages + 1, dtype=torch.float32, device=device)
    flags[module.stage_id] = float(owns)
    flags[stages + module.stage_id] = float(owns and _given_count(model_parameters) == 0)
    flags[-1] = float(builds)
    collectives.all_reduce(flags, op=dist.ReduceOp.MAX)
    if not flags[-1]:
        return
    empty = [s for s in range(stages) if not flags[s]]
    if empty:
        _raise_no_parameters(module, empty)
    left_out = [s for s in range(stages) if flags[stages + s]]
    if left_out:
        many = len(left_out) > 1
        raise PipeValueError(
            f"pipeline {'stages' if many else 'stage'} {_stages(module, left_out)} "
            f"{'get' if many else 'gets'} no parameters from initialize(model_parameters=...), "
            "so the optimizer would have nothing to train there: each stage's optimizer "
            "takes the parameters of model_parameters that its stage holds, and "
            f"{'these stages hold' if many else 'this stage holds'} only parameters "
            "model_parameters leaves out (frozen ones, requires_grad=False, when it keeps "
            "only trainable ones). Pass model_parameters=model.parameters() (frozen "
            "parameters are not updated), or give every stage a trainable layer")


def _raise_no_parameters(module: Any, empty: list[int]) -> None:
    parts, names = list(module.parts), module._layer_names
    if module.num_stages == 1:
        raise PipeValueError("the PipelineModule has no parameters, so the optimizer "
                             f"would have nothing to train (layers: {', '.join(names)})")
    raise PipeValueError(
        f"pipeline {'stages' if len(empty) > 1 else 'stage'} {_stages(module, empty)} "
        f"{'own' if len(empty) > 1 else 'owns'} no parameters, so the optimizer "
        f"would have nothing to train there: partition_method={module.partition_method!r} "
        f"cut {len(names)} layers into {module.num_stages} stages at {parts}. Give every "
        "stage a layer with parameters: fewer stages (a smaller num_stages), or "
        f"another partition_method (explicit boundaries [0, ..., {len(names)}] cut where you "
        "say)")
