"""Parameters put into the optimizer after initialize() with
``optimizer.add_param_group`` (Lightning's BaseFinetuning unfreezing a
backbone), in one 2-rank dsrun job against plain torch on both ranks' data
(what DDP and a torch optimizer compute); each rank writes
``OUT_DIR/rank<R>.json`` and tests/dist/test_added_param_groups.py judges.

* **fp32** (stage 0, ``gradient_clipping`` 0.5, SGD): layers 0 and 4 start
  frozen and out of the optimizer. Before step 1 layer 0 is unfrozen and
  added (lr 0.05); at step 3 layer 4 is unfrozen before the backward and
  added only after it (its gradient is reduced at the step). Each step's
  ``get_global_grad_norm()`` and the final weights against the reference.
* **fp16** (stage 0, loss scale 2^8): the same with fp32 masters; then a
  step whose only non-finite gradient is an added parameter's is skipped.
* **resume** (fp16, Adam): a checkpoint saved after ``add_param_group``
  resumes exactly in an engine that added the same group before loading.
* **zero**: at stages 1-3 ``add_param_group`` is an AttributeError naming
  it (DeepSpeed 0.19.8's error too).

Usage: ``dsrun --num_gpus 2 added_groups.py OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

import dsrun as deepspeed

CLIP = 0.5
STEPS = 5


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4),
                            torch.nn.Tanh(), torch.nn.Linear(4, 3))
    m[0].requires_grad_(False)
    m[4].requires_grad_(False)
    return m


def data(step: int, rank: int) -> torch.Tensor:
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(100 * step + rank))
    return x.half().float()  # the same values in fp16 and fp32


def config(stage: int, fp16: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                           "zero_allow_untested_optimizer": True,
                           "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}}
    if fp16:
        out["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000}
    return out


def train(m: torch.nn.Sequential, opt: Any, step_once: Any) -> list[Optional[float]]:
    """The schedule of the module docstring; ``step_once(s, before_step)``
    runs one step's forward and backward, calls ``before_step`` and steps,
    returning the norm."""
    norms = []
    for s in range(STEPS):
        if s == 1:
            m[0].requires_grad_(True)
            opt.add_param_group({"params": list(m[0].parameters()), "lr": 0.05})
        late = None
        if s == 3:
            m[4].requires_grad_(True)
            late = lambda: opt.add_param_group({"params": list(m[4].parameters()),  # noqa: E731
                                                "lr": 0.2})
        norms.append(step_once(s, late))
    return norms


def reference() -> tuple[torch.nn.Sequential, list[Optional[float]]]:
    """Plain torch over both ranks' batches: the gradient of the mean loss."""
    m = model()
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)

    def step_once(s: int, before_step: Any) -> float:
        loss = sum(m(data(s, r)).pow(2).sum() for r in range(2)) / 2
        loss.backward()
        if before_step:
            before_step()
        norm = torch.nn.utils.clip_grad_norm_(
            [p for p in m.parameters() if p.grad is not None], CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(norm)

    return m, train(m, opt, step_once)


def engine_case(fp16: bool) -> dict[str, Any]:
    m = model()
    engine, opt, *_ = deepspeed.initialize(
        model=m, config=config(0, fp16),
        model_parameters=[p for p in m.parameters() if p.requires_grad])
    dtype = torch.float16 if fp16 else torch.float32

    def step_once(s: int, before_step: Any) -> float:
        engine.backward(engine(data(s, dist.get_rank()).to(dtype)).float().pow(2).sum())
        if before_step:
            before_step()
        engine.step()
        return float(engine.get_global_grad_norm())

    norms = train(m, opt, step_once)
    ref, ref_norms = reference()
    out: dict[str, Any] = {
        "norm_diff": max(abs(a - b) for a, b in zip(norms, ref_norms)),
        "weight_diff": max((p.float() - q).abs().max().item()
                           for p, q in zip(m.parameters(), ref.parameters())),
        "weights": [p.float().flatten().tolist() for p in m.parameters()],
        "skipped": engine.skipped_steps,
    }
    if fp16:
        out["overflow"] = overflow_step(engine, m)
    return out


def overflow_step(engine: Any, m: torch.nn.Sequential) -> dict[str, Any]:
    """A step whose only inf gradient is layer 0's (added after
    initialize()): skipped, nothing moves."""
    before = [p.detach().clone() for p in m.parameters()]
    skipped = engine.skipped_steps
    engine.backward(engine(data(9, dist.get_rank()).half()).float().pow(2).sum())
    with torch.no_grad():
        m[0].weight.grad[0, 0] = float("inf")
    engine.step()
    return {"skipped": engine.skipped_steps - skipped,
            "moved": max((p - b).abs().max().item() for p, b in zip(m.parameters(), before))}


def resume_case(out_dir: Path) -> float:
    """fp16 Adam: a checkpoint saved after add_param_group, loaded into an
    engine whose script added the same group before loading, continues as
    the saving engine does (the optimizer state lies on the masters)."""
    def build() -> tuple[Any, Any, torch.nn.Sequential]:
        m = model()
        cfg = {**config(0, True), "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
        engine, opt, *_ = deepspeed.initialize(
            model=m, config=cfg, model_parameters=[p for p in m.parameters() if p.requires_grad])
        m[0].requires_grad_(True)
        opt.add_param_group({"params": list(m[0].parameters()), "lr": 0.005})
        return engine, opt, m

    def step(engine: Any, s: int) -> None:
        engine.backward(engine(data(s, dist.get_rank()).half()).float().pow(2).sum())
        engine.step()

    engine, _, m = build()
    for s in range(3):
        step(engine, s)
    engine.save_checkpoint(str(out_dir / "resume"))
    step(engine, 3)
    loaded, _, m2 = build()
    loaded.load_checkpoint(str(out_dir / "resume"))
    step(loaded, 3)
    return max((p - q).abs().max().item() for p, q in zip(m.parameters(), m2.parameters()))


def zero_case(stage: int) -> str:
    m = model()
    _, opt, *_ = deepspeed.initialize(
        model=m, config=config(stage, False),
        model_parameters=[p for p in m.parameters() if p.requires_grad])
    try:
        opt.add_param_group({"params": list(m[0].parameters())})
    except AttributeError as error:
        return f"AttributeError: {error}"
    return "accepted"


def guarded(case: Any, *args: Any) -> Any:
    """A case's facts, or the error it raised (each test then fails alone)."""
    try:
        return case(*args)
    except Exception as error:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(error).__name__}: {error}"}


def main() -> None:
    out_dir = Path(sys.argv[1])
    result = {"fp32": guarded(engine_case, False), "fp16": guarded(engine_case, True),
              "resume": guarded(resume_case, out_dir),
              "zero": {str(stage): guarded(zero_case, stage) for stage in (1, 2, 3)}}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
