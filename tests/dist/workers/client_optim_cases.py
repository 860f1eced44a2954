"""The script's own optimizer object after initialize(), at ZeRO stages 0-3,
all run inside ONE job (dsrun --num_gpus 2); tests/dist/test_client_optimizer.py
judges. Each rank writes ``<out>/rank<R>.json``: {case: {"ok": bool,
"error": traceback, ...facts}}; a case named ``<what>_s<stage>`` ran at
that ZeRO stage, and stage 0 is the reference the others must match.

* ``hand``: a hand-written schedule on the client's optimizer (lr to 0 for
  one group, another group's weight_decay changed, then a new lr for all),
  as nanoGPT-style loops write it; then a checkpoint saved and loaded in
  the same engine, and the client's object still drives the step.
* ``plateau``: a torch ReduceLROnPlateau over the client optimizer, passed
  as ``lr_scheduler=``: engine.step() does not step it; the script steps it
  with a metric (``engine.lr_scheduler.step(metric)`` or ``lr_kwargs``).
* ``warnings``: a torch CosineAnnealingLR over the client optimizer: torch's
  "optimizer.step() overridden" / "lr_scheduler.step() before
  optimizer.step()" warnings must not appear.

Usage: client_optim_cases.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

import dsrun

FEATURES, MICRO = 6, 4
STAGES = (0, 1, 2, 3)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3))


def config(stage: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 20}}


def train_step(engine: Any, step: int, **step_kwargs: Any) -> float:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x = torch.randn(MICRO, FEATURES, generator=gen)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step(**step_kwargs)
    return float(loss)


def full_params(engine: Any) -> list[torch.Tensor]:
    """Every parameter whole (gathered at stage 3)."""
    params = list(engine.module.parameters())
    with dsrun.zero.GatheredParameters(params, enabled=engine.zero_stage == 3):
        return [p.detach().clone().reshape(-1) for p in params]


def flat(tensors: list[torch.Tensor]) -> list[float]:
    return torch.cat(tensors).tolist()


def hand(stage: int, out: str) -> dict[str, Any]:
    model = make_model()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    is_weight = [n.endswith("weight") for n, _ in model.named_parameters()]
    opt = torch.optim.AdamW([{"params": weights, "lr": 0.01, "weight_decay": 0.0},
                             {"params": biases, "lr": 0.003, "weight_decay": 0.1}])
    engine, returned, _, _ = dsrun.initialize(model=model, optimizer=opt, config=config(stage))
    losses, lrs, still = [], [], []
    for step in range(6):
        if step == 2:
            opt.param_groups[0]["lr"] = 0.0
            opt.param_groups[1]["weight_decay"] = 0.5
        if step == 4:
            for group in opt.param_groups:
                group["lr"] = 0.02
        before = full_params(engine)
        losses.append(train_step(engine, step))
        lrs.append(engine.get_lr())
        if step in (2, 3):  # the weights (group 0) must not move at lr 0
            after = full_params(engine)
            still.append(max(float((a - b).abs().max()) for a, b, w in
                             zip(after, before, is_weight) if w))
    inner = engine.optimizer.optimizer if stage else engine.optimizer
    facts = {"losses": losses, "lrs": lrs, "weights_moved_at_lr0": max(still),
             "params": flat(full_params(engine)), "client_steps": inner is opt,
             "client_has_state": len(opt.state) > 0,
             "returned_groups_are_clients": [g is c for g, c in
                                             zip(returned.param_groups, opt.param_groups)]}
    save_dir = os.path.join(out, f"hand_s{stage}")
    engine.save_checkpoint(save_dir, tag="t")
    engine.load_checkpoint(save_dir, tag="t")
    opt.param_groups[0]["lr"] = 0.0
    before = full_params(engine)
    train_step(engine, 6)
    after = full_params(engine)
    facts["after_load_weights_moved_at_lr0"] = max(
        float((a - b).abs().max()) for a, b, w in zip(after, before, is_weight) if w)
    facts["after_load_lr"] = engine.get_lr()
    return facts


def plateau(stage: int, out: str) -> dict[str, Any]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    engine, _, _, returned = dsrun.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                              config=config(stage))
    for step in range(3):
        train_step(engine, step)
    trained = engine.get_lr()
    engine.lr_scheduler.step(1.0)  # the best so far
    engine.lr_scheduler.step(2.0)  # worse, patience 0: the lr halves
    after_metric = engine.get_lr()
    losses = [train_step(engine, step) for step in range(3, 5)]
    train_step(engine, 5, lr_kwargs={"metrics": 3.0})  # worse again: halves after this step
    return {"returned_is_client": returned is sched, "trained_lr": trained,
            "after_metric_lr": after_metric, "after_lr_kwargs_lr": engine.get_lr(),
            "losses": losses, "params": flat(full_params(engine))}


def quiet(stage: int, out: str) -> dict[str, Any]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
        engine, _, _, _ = dsrun.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                           config=config(stage))
        for step in range(3):
            train_step(engine, step)
    texts = [str(w.message) for w in seen]
    return {"scheduler_warnings": [t for t in texts if "lr_scheduler" in t
                                   or "optimizer.step()" in t],
            "lrs": engine.get_lr(), "last_lr": sched.get_last_lr()}


CASES: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "hand": hand, "plateau": plateau, "warnings": quiet}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dsrun.init_distributed()
    results: dict[str, Any] = {"world_size": dist.get_world_size()}
    for name, run in CASES.items():
        for stage in STAGES:
            try:
                results[f"{name}_s{stage}"] = {"ok": True, **run(stage, args.out)}
            except Exception:  # noqa: BLE001 - reported per case; the others still run
                results[f"{name}_s{stage}"] = {"ok": False, "error": traceback.format_exc()}
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w",
              encoding="utf-8") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main()
