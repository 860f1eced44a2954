"""Tensor parallelism through a Megatron-style ``mpu`` (TP=2 x DP=2 on 4
gloo ranks): the engine's gradient norm, clipping and non-finite skips over
the model-parallel group, at ZeRO stages 0-3. Each rank writes
``OUT_DIR/rank<R>.json``; tests/dist/test_tp_norms.py judges.

Megatron's rank layout: tensor-parallel groups [0, 1] and [2, 3],
data-parallel groups [0, 2] and [1, 3]. The model is a LayerNorm, a
column-parallel Linear (``w1``, ``b1``) and a row-parallel one (``w2``), all
three marked ``tensor_model_parallel``, then a replicated bias and head,
with Megatron's copy / reduce functions between them: every tensor-parallel
pair computes exactly what the unsplit model (built from the same seed and
trained on the whole batch in this process, with torch's clipping and SGD)
computes.

* **norm** cases (fp32): the engine's ``get_global_grad_norm()`` at each
  step, the unsplit model's norm, the parameters after the last step
  (this rank's slices) and the unsplit model's.
* **skip** cases (fp16, bf16, fp32 at ZeRO): at step 2 the gradient of
  ``w1`` turns inf on tensor-parallel rank 1 only (an overflow inside one
  shard); every rank must skip that step. The ``-replicated`` ones poison
  the replicated ``head`` on rank 1 instead, a gradient that rank leaves
  out of its share of the norm.

Both kinds report the replicated parameters' values, which must be equal
bitwise on the two ranks of a tensor-parallel pair.

Usage: ``dsrun --num_gpus 4 tp_norm_cases.py OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import dsrun

D, H, MICRO, STEPS, CLIP, LR = 4, 8, 4, 3, 0.05, 0.1
POISON_STEP = 2
REPLICATED = ("ln.weight", "ln.bias", "b2", "head")


class Mpu:
    """Megatron's parallel_state for TP=2 x DP=2 (the names DeepSpeed reads)."""

    def __init__(self) -> None:
        rank = dist.get_rank()
        tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
        dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        self.tp_group, self.dp_group = tp[rank // 2], dp[rank % 2]
        self.tp_rank, self.dp_rank = rank % 2, rank // 2

    def get_model_parallel_group(self) -> Any:
        return self.tp_group

    def get_model_parallel_world_size(self) -> int:
        return 2

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return 2

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank


class Copy(torch.autograd.Function):
    """Into the column-parallel region: identity, gradient summed over TP."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        summed = grad.contiguous().float()  # gloo sums float32 on every torch
        dist.all_reduce(summed, group=ctx.group)
        return summed.to(grad.dtype), None


class Reduce(torch.autograd.Function):
    """Out of the row-parallel region: the partial outputs summed over TP."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().float()
        dist.all_reduce(out, group=group)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad, None


class Poison(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad * ctx.factor, None


def whole_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return {"ln.weight": 1 + 0.1 * torch.randn(D, generator=gen),
            "ln.bias": 0.1 * torch.randn(D, generator=gen),
            "w1": torch.randn(H, D, generator=gen), "b1": torch.randn(H, generator=gen),
            "w2": torch.randn(D, H, generator=gen), "b2": torch.randn(D, generator=gen),
            "head": torch.randn(1, D, generator=gen)}


class Net(torch.nn.Module):
    """The unsplit model (``tp_size`` 1), or tensor-parallel rank ``tp_rank``'s part."""

    def __init__(self, tp_rank: int = 0, tp_size: int = 1, group: Any = None) -> None:
        super().__init__()
        full = whole_weights()
        rows = slice(tp_rank * H // tp_size, (tp_rank + 1) * H // tp_size)
        self.ln = torch.nn.LayerNorm(D)
        with torch.no_grad():
            self.ln.weight.copy_(full["ln.weight"])
            self.ln.bias.copy_(full["ln.bias"])
        self.w1 = torch.nn.Parameter(full["w1"][rows].clone())
        self.b1 = torch.nn.Parameter(full["b1"][rows].clone())
        self.w2 = torch.nn.Parameter(full["w2"][:, rows].clone())
        self.b2 = torch.nn.Parameter(full["b2"].clone())
        self.head = torch.nn.Parameter(full["head"].clone())
        for split in (self.w1, self.b1, self.w2):
            split.tensor_model_parallel = True  # type: ignore[attr-defined]
        self.tp_size, self.group = tp_size, group
        self.poison = {"w1": 1.0, "head": 1.0}  # factors on the gradients

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        if self.tp_size > 1:
            h = Copy.apply(h, self.group)
        a = torch.tanh(h @ Poison.apply(self.w1, self.poison["w1"]).t() + self.b1)
        o = a @ self.w2.t()
        if self.tp_size > 1:
            o = Reduce.apply(o, self.group)
        pred = (o + self.b2) @ Poison.apply(self.head, self.poison["head"]).t()
        return ((pred.float() - y) ** 2).mean()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(2 * MICRO, D, generator=gen), torch.randn(2 * MICRO, 1, generator=gen)


def reference() -> tuple[list[float], dict[str, list[float]]]:
    """The unsplit model trained on the whole batch: norms, final weights."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        model(*batch(step)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    return norms, {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}


def config(stage: int, precision: str, offload: bool = False) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    out: dict[str, Any] = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
                           "gradient_clipping": CLIP, "zero_optimization": zero,
                           "optimizer": {"type": "SGD", "params": {"lr": LR}},
                           "zero_allow_untested_optimizer": True}
    if precision == "fp16":
        out["fp16"] = {"enabled": True, "initial_scale_power": 8, "auto_cast": True}
    elif precision == "bf16":
        out["bf16"] = {"enabled": True}
    return out


def values(engine: Any) -> dict[str, list[float]]:
    params = dict(engine.module.named_parameters())
    with dsrun.zero.GatheredParameters(list(params.values()),
                                       enabled=any(hasattr(p, "ds_id") for p in params.values())):
        return {n: p.detach().float().flatten().tolist() for n, p in params.items()}


def run_case(mpu: Mpu, stage: int, precision: str, poison: str = "",
             offload: bool = False) -> dict[str, Any]:
    """``poison``: the parameter whose gradient turns inf on tensor-parallel
    rank 1 at :data:`POISON_STEP` (none when empty)."""
    model = Net(mpu.tp_rank, 2, mpu.tp_group)
    engine, _, _, _ = dsrun.initialize(model=model, config=config(stage, precision, offload),
                                       mpu=mpu)
    norms, applied = [], []
    for step in range(STEPS):
        x, y = batch(step)
        mine = slice(mpu.dp_rank * MICRO, (mpu.dp_rank + 1) * MICRO)
        bad = step == POISON_STEP and mpu.tp_rank == 1
        model.poison = {k: float("inf") if bad and k == poison else 1.0 for k in model.poison}
        engine.backward(engine(x[mine], y[mine]))
        engine.step()
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
        applied.append(bool(engine.was_step_applied()))
    out = {"norms": norms, "applied": applied, "skipped": int(engine.skipped_steps),
           "values": values(engine)}
    engine.destroy()
    return out


def main() -> None:
    out = Path(sys.argv[1])
    dsrun.init_distributed()
    torch.manual_seed(0)
    mpu = Mpu()
    ref_norms, ref_values = reference()
    results: dict[str, Any] = {"tp_rank": mpu.tp_rank, "ref_norms": ref_norms,
                               "ref_values": ref_values, "cases": {}}
    cases = {f"norm-s{s}-fp32": (s, "fp32", "") for s in (0, 1, 2, 3)}
    cases.update({f"skip-s{s}-{p}": (s, p, "w1")
                  for s, p in ((0, "bf16"), (0, "fp16"), (1, "fp16"), (1, "fp32"),
                               (2, "bf16"), (3, "fp16"), (3, "bf16"))})
    cases.update({f"skip-s{s}-{p}-replicated": (s, p, "head")
                  for s, p in ((0, "bf16"), (2, "fp32"), (3, "bf16"))})
    for name, (stage, precision, poison) in cases.items():
        results["cases"][name] = run_case(mpu, stage, precision, poison)
    results["cases"]["norm-s2-fp32-offload"] = run_case(mpu, 2, "fp32", offload=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
