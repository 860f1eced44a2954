"""dsrun's side of make.py: resume imported DeepSpeed fixtures and continue training.

Started by tests/dist/test_from_deepspeed.py on gloo ranks (``dsrun --cpu
--num_gpus N resume_dsrun.py --out OUT --run NAME:STAGE:DIR ...``). For each
``--run``: a dsrun engine at ZeRO stage ``STAGE`` over :class:`model.Tiny`
with the fixture's precision, param groups, optimizer and schedule (as
make.py configured DeepSpeed) loads ``DIR`` - the fixture imported by
``dsrun checkpoint from-deepspeed`` - and trains ``CONTINUE`` steps on the
same global batches DeepSpeed trained on after its own resume. Rank 0
writes ``OUT/rank0.json``: per run the global mean loss and the loss scale
of each step, and what the load restored.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import model as spec  # noqa: E402 - the directory is put on the path first

import dsrun  # noqa: E402


def resume(name: str, stage: int, ckpt: str) -> dict[str, Any]:
    saved_stage, precision = spec.FIXTURES[name]
    world = dist.get_world_size()
    config = spec.config(saved_stage, precision, world)
    config["zero_optimization"] = {"stage": stage}
    module = spec.build()
    engine, *_ = dsrun.initialize(model=module,
                                  model_parameters=spec.param_groups(module, saved_stage),
                                  config=config)
    _, client = engine.load_checkpoint(ckpt)
    scaler = getattr(engine.precision, "scaler", None)
    facts: dict[str, Any] = {
        "ok": True, "start": engine.global_steps, "skipped": engine.skipped_steps,
        "samples": engine.global_samples, "lr": [g["lr"] for g in engine.optimizer.param_groups],
        "loaded_dp_world_size": engine.loaded_checkpoint_dp_world_size,
        "client": {k: (v.tolist() if isinstance(v, torch.Tensor) else v)
                   for k, v in (client or {}).items()},
        "scaler": scaler.state_dict() if scaler is not None else None,
        "losses": [], "loss_scale": []}
    for _ in range(spec.CONTINUE):
        x, y = spec.batch(engine.global_steps, dist.get_rank(), world, precision)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        value = loss.detach().float().clone()
        dist.all_reduce(value)
        facts["losses"].append(float(value) / world)
        facts["loss_scale"].append(float(scaler.scale) if scaler is not None else 1.0)
    engine.destroy()
    return facts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--run", action="append", default=[], help="NAME:STAGE:DIR")
    args = parser.parse_args()
    dsrun.init_distributed()
    results = {}
    for run in args.run:
        name, stage, ckpt = run.split(":", 2)
        try:
            results[f"{name}@{stage}"] = resume(name, int(stage), ckpt)
        except Exception:  # noqa: BLE001 - reported to the test, which fails naming it
            results[f"{name}@{stage}"] = {"ok": False, "error": traceback.format_exc()}
    if dist.get_rank() == 0:
        Path(args.out, "rank0.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
