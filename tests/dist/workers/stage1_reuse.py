"""ZeRO stage 1 without gradient accumulation over parameters that get
several gradients in one backward through reentrant activation checkpoints
(the models of reentrant_reuse.py with one micro-batch a step), against
plain torch (tests/dist/test_stage1_reuse.py). Also records each step's
loss, and the losses of a stage-0 run of the same case.

Usage: ``dsrun --num_gpus 2 stage1_reuse.py OUT_DIR`` (writes
``OUT_DIR/rank{R}.json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

import dsrun
from dsrun.errors import DsrunError

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script by dsrun
import reentrant_reuse as models  # noqa: E402

models.GA = 1  # every micro-batch a boundary: stage 1 reduces during backward

SMALL = {"reduce_bucket_size": models.D}  # one parameter a bucket: sent before its reuse
RUNS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "s1_shared": ("shared", 1, {}),
    "s1_shared_small_buckets": ("shared", 1, SMALL),
    "s1_tied_small_buckets": ("tied", 1, SMALL),
    "s1_inout_small_buckets": ("inout", 1, SMALL),
    "s1_varying_small_buckets": ("varying", 1, SMALL),
    "s1_shared_overlap": ("shared", 1, {**SMALL, "overlap_comm": True}),
    "s0_shared_small_buckets": ("shared", 0, SMALL),
}


def train(case: str, stage: int, zero: dict[str, Any]) -> dict[str, Any]:
    """Final full parameters and each step's loss."""
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": models.LR}},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage, **zero}, "steps_per_print": 10**9}
    engine, *_ = dsrun.initialize(model=models.build(case, models.reentrant), config=config)
    rank = dist.get_rank()
    losses = []
    try:
        for step in range(models.STEPS):
            loss = engine(*models.batch(case, rank, step, 0))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        params = {n: p.detach().reshape(-1).tolist() for n, p in engine.module.named_parameters()}
    except DsrunError as err:
        return {"error": str(err)}
    finally:
        engine.destroy()
    return {"params": params, "losses": losses}


def main() -> None:
    out_dir = Path(sys.argv[1])
    dsrun.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    cases = sorted({case for case, *_ in RUNS.values()})
    result = {"rank": dist.get_rank(),
              "reference": {case: models.reference(case, world) for case in cases},
              "runs": {name: train(*run) for name, run in RUNS.items()}}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
