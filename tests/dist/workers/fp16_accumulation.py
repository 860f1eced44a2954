"""fp16 gradient accumulation whose micro-step sum leaves float16's range,
at every ZeRO stage, with and without offload, on the ranks of one dsrun job.

Usage: ``dsrun --num_gpus N fp16_accumulation.py OUT_DIR``; each rank writes
``OUT_DIR/rank<R>.json`` with, per case, what :func:`probe` saw. The test
(tests/dist/test_fp16_accumulation.py) judges, and runs the same cases at
world size 1 in its own process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

import dsrun

# 2 micro-steps of 50000 per gradient element (loss x 25000, scale 4, / 2):
# each is finite in float16, their sum 100000 is not (float16's max: 65504)
MICRO_GRAD_FACTOR = 25000.0


def config(stage: int, offload: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-9}}, "gradient_clipping": 0.0,
            "fp16": {"enabled": True, "initial_scale_power": 2, "hysteresis": 1,
                     "min_loss_scale": 1},
            "zero_optimization": zero}


def probe(stage: int, offload: bool, factor: float = MICRO_GRAD_FACTOR) -> dict[str, Any]:
    """One optimizer step of 2 micro-steps whose per-element gradient is
    ``factor * scale / 2``: skipped steps, loss scale after it, norm."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4, bias=False)
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(),
                                  config=config(stage, offload))
    for _ in range(2):
        out = engine(torch.ones(1, 4, dtype=torch.float16))
        engine.backward((out.float() * factor).sum())
        engine.step()
    norm = engine.get_global_grad_norm()
    result = {"skipped": engine.skipped_steps, "scale": engine.optimizer.cur_scale,
              "norm": None if norm is None else float(norm)}
    engine.destroy()
    return result


def cases() -> dict[str, tuple[int, bool]]:
    return {f"s{stage}{'-offload' if offload else ''}": (stage, offload)
            for stage in range(4) for offload in (False, True)}


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    dsrun.init_distributed(dist_backend="gloo")
    results = {name: probe(stage, offload) for name, (stage, offload) in cases().items()}
    rank = torch.distributed.get_rank()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
