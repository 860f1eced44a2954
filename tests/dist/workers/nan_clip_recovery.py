"""ZeRO 1-3 on 2 ranks with ``gradient_clipping`` after one non-finite
gradient (tests/dist/test_nan_clip_recovery.py): each run trains
Linear(6, 1) (7 elements: the last partition is padded) with Adam, takes
one step whose gradient is NaN, then goes on. It records each step's
applied flag, skipped count and norm, the final parameters, and those of a
run of the same clean steps without the NaN one (DeepSpeed skips the step
without touching parameters or Adam's state, so the two are equal). The
``warn_*`` runs poison one parameter's gradient only and record rank 0's
skip warning.

Usage: ``dsrun --num_gpus 2 nan_clip_recovery.py OUT_DIR`` (writes
``OUT_DIR/rank{R}.json``).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

import dsrun

CLEAN_STEPS = 4
NAN_AT = 1  # the step index (of CLEAN_STEPS + 1) whose loss is NaN
# name: (stage, bf16, gradient accumulation)
RUNS: dict[str, tuple[int, bool, int]] = {
    f"s{stage}_{'bf16' if bf16 else 'fp32'}_ga{ga}": (stage, bf16, ga)
    for stage in (1, 2, 3) for bf16 in (False, True) for ga in (1, 2)
}


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def build(stage: int, bf16: bool, ga: int, fp16: bool = False) -> Any:
    torch.manual_seed(0)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ga,
        "gradient_clipping": 1.0, "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage}}
    if bf16:
        config["bf16"] = {"enabled": True}
    if fp16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 4}
    engine, *_ = dsrun.initialize(model=torch.nn.Linear(6, 1), config=config)
    return engine


def full_params(engine: Any) -> list[float]:
    return [v for p in engine.module.parameters()
            for v in dsrun.utils.safe_get_full_fp32_param(p).reshape(-1).tolist()]


def one_step(engine: Any, data: int, poison: Optional[str]) -> float:
    """One optimizer step on the data of clean step ``data``; ``poison``:
    "loss" makes the loss NaN, a parameter name only that gradient."""
    rank = dist.get_rank()
    loss = torch.zeros(())
    for micro in range(engine.gradient_accumulation_steps()):
        gen = torch.Generator().manual_seed(1000 * data + 10 * micro + rank)
        x = torch.randn(2, 6, generator=gen).to(engine.module.weight.dtype)  # fp16: half
        loss = engine(x).float().pow(2).mean()
        if poison == "loss":
            loss = loss * float("nan")
        elif poison is not None:
            loss = loss + getattr(engine.module, poison).sum() * float("nan")
        engine.backward(loss)
        engine.step()
    return float(loss)


def one_step_backward(engine: Any) -> None:
    """A backward on fixed data (no step), for the in-process test."""
    engine.backward(engine(torch.ones(2, 6)).float().pow(2).mean())


def train(stage: int, bf16: bool, ga: int, with_nan: bool) -> dict[str, Any]:
    engine = build(stage, bf16, ga)
    steps = []
    try:
        for step in range(CLEAN_STEPS + with_nan):
            poisoned = with_nan and step == NAN_AT
            before = full_params(engine)
            one_step(engine, step - (with_nan and step > NAN_AT), "loss" if poisoned else None)
            steps.append({"applied": engine.was_step_applied(), "skipped": engine.skipped_steps,
                          "norm": float(engine.get_global_grad_norm()),
                          "moved": full_params(engine) != before})
        return {"steps": steps, "params": full_params(engine)}
    finally:
        engine.destroy()


def kept_after_clear(stage: int, discard: bool) -> bool:
    """Whether a master gradient accumulator still holds a non-zero value
    after the engine's between-steps ``zero_grad(set_to_none=False)``,
    with or without ``discard_round`` (a skipped step) before it."""
    engine = build(stage, False, 1)
    try:
        one_step_backward(engine)
        engine.optimizer.reduce_gradients()
        if discard:
            engine.optimizer.discard_round()
        engine.optimizer.zero_grad(set_to_none=False)
        return any(m.grad is not None and bool(m.grad.any()) for m in engine.optimizer.masters)
    finally:
        engine.destroy()


def warning_for(poison: str, fp16: bool) -> list[str]:
    """Rank 0's skip line at stage 2 when only ``poison``'s gradient is NaN
    (fp16: the overflow line, at INFO)."""
    capture = Capture()
    capture.setLevel(logging.INFO)
    logger = logging.getLogger("dsrun.runtime.engine")
    level, logger.level = logger.level, logging.INFO
    logger.addHandler(capture)
    engine = build(2, False, 1, fp16)
    try:
        one_step(engine, 0, poison)
    finally:
        logger.removeHandler(capture)
        logger.level = level
        engine.destroy()
    return [line for line in capture.lines if "first non-finite gradient" in line]


def main() -> None:
    out_dir = Path(sys.argv[1])
    dsrun.init_distributed(dist_backend="gloo")
    result: dict[str, Any] = {"rank": dist.get_rank(), "runs": {}, "warnings": {}}
    for name, (stage, bf16, ga) in RUNS.items():
        result["runs"][name] = {"nan": train(stage, bf16, ga, True),
                                "clean": train(stage, bf16, ga, False)}
    result["kept"] = {f"s{stage}_{discard}": kept_after_clear(stage, discard)
                      for stage in (1, 2, 3) for discard in (False, True)}
    for poison in ("weight", "bias"):
        for fp16 in (False, True):
            result["warnings"][f"{poison}{'_fp16' if fp16 else ''}"] = warning_for(poison, fp16)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
