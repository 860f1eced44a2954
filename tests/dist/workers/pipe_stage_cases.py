"""Pipeline cases where one stage's state or data differs from another's;
2 ranks (2 stages), one job, each rank writes ``<out>/rank<R>.json`` for
tests/dist/test_pipe_stage_state.py. In this order:

* ``loss_param``: a ``loss_fn`` with a trainable parameter (only the last
  stage's copy trains): 3 steps, save, 3 more; a fresh engine (another
  initial value) loads and trains 3 - losses and the parameter; and
  ``save_16bit_model``'s value of it.
* ``frozen_filtered``: stage 0's layer frozen and ``model_parameters`` only
  the trainable ones: the error at ``initialize``.
* ``written_scale``: fp16, stage 0's ZeRO stage 0: a scale of 8 written
  after the first batch through ``optimizer.cur_scale`` and through
  ``optimizer.loss_scaler.cur_scale`` - each stage's scale and weight change
  in the second batch, per route.
* ``group_generator``: ``model_parameters`` one param-group dict whose
  ``"params"`` is a generator: the optimizer's parameter count and whether
  the weights move.
* ``exhausted``: the first stage's data runs out at micro-batch 1 and the
  script goes on (``except StopIteration``): each stage's error. Last: the
  stages' messages are out of step after it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dsrun
from dsrun.pipe import LayerSpec, PipelineModule

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "Adam", "params": {"lr": 0.1}}}


class UncertaintyLoss(nn.Module):
    """An uncertainty-weighted loss: ``log_var`` trains with the model."""

    def __init__(self, start: float) -> None:
        super().__init__()
        self.log_var = nn.Parameter(torch.full((1,), start))

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, y) * torch.exp(-self.log_var[0]) + self.log_var[0]


def _module(seed: int, start: float = 0.0, trainable_loss: bool = True) -> PipelineModule:
    torch.manual_seed(seed)
    loss_fn = UncertaintyLoss(start) if trainable_loss else F.mse_loss
    return PipelineModule([LayerSpec(nn.Linear, 4, 4), nn.Tanh(), LayerSpec(nn.Linear, 4, 4)],
                          num_stages=2, loss_fn=loss_fn, partition_method="parameters")


def _data(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(2, 4, generator=gen), torch.randn(2, 4, generator=gen))
            for _ in range(count)]


def _train(engine: Any, data: Any, steps: int) -> list[str]:
    return [float(engine.train_batch(data)).hex() for _ in range(steps)]


def loss_param(args: argparse.Namespace) -> dict[str, Any]:
    data = _data(12)
    module = _module(0)
    engine, _, _, _ = dsrun.initialize(model=module, config=CONFIG,
                                       model_parameters=module.parameters())
    it = iter(data)
    first = _train(engine, it, 3)
    engine.save_checkpoint(args.ckpt, tag="t")
    straight = _train(engine, it, 3)
    straight_value = module.loss_fn.log_var.item()
    engine.save_16bit_model(args.out, "model16.bin")
    saved16 = None
    if dist.get_rank() == 0:
        path = os.path.join(args.out, "model16.bin")
        saved16 = torch.load(path, weights_only=True)["loss_fn.log_var"].item()
    other = _module(1, start=0.5)
    engine2, _, _, _ = dsrun.initialize(model=other, config=CONFIG,
                                        model_parameters=other.parameters())
    engine2.load_checkpoint(args.ckpt, tag="t")
    resumed = _train(engine2, iter(data[6:]), 3)
    return {"first": first, "straight": straight, "resumed": resumed,
            "stage": module.stage_id, "straight_value": straight_value,
            "resumed_value": other.loss_fn.log_var.item(), "saved16": saved16}


def frozen_filtered(args: argparse.Namespace) -> dict[str, Any]:
    module = _module(0, trainable_loss=False)
    for name, param in module.named_parameters():
        if name.startswith("0."):
            param.requires_grad_(False)
    try:
        dsrun.initialize(model=module, config=CONFIG,
                         model_parameters=[p for p in module.parameters() if p.requires_grad])
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None}


def _moved(engine: Any, batches: int) -> float:
    """The summed weight change of this stage over ``batches`` batches."""
    before = [p.detach().float().clone() for p in engine.module.parameters()]
    _train(engine, iter(_data(2 * batches)), batches)
    return sum(float((p.detach().float() - w).abs().sum())
               for p, w in zip(engine.module.parameters(), before))


def written_scale(args: argparse.Namespace) -> dict[str, Any]:
    config = {**CONFIG, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "fp16": {"enabled": True, "initial_scale_power": 10, "auto_cast": True}}
    out: dict[str, Any] = {}
    for route in ("loss_scaler.cur_scale", "cur_scale"):
        module = _module(0, trainable_loss=False)
        engine, optimizer, _, _ = dsrun.initialize(model=module, config=config,
                                                   model_parameters=module.parameters())
        _train(engine, iter(_data(2)), 1)
        if route == "cur_scale":
            optimizer.cur_scale = 8.0
        else:
            optimizer.loss_scaler.cur_scale = 8.0
        out[route] = {"moved": _moved(engine, 1), "scale": engine.precision.loss_scale,
                      "published": optimizer.cur_scale}
    return out


def group_generator(args: argparse.Namespace) -> dict[str, Any]:
    module = _module(0, trainable_loss=False)
    groups = [{"params": (p for p in module.parameters()), "weight_decay": 0.0}]
    engine, optimizer, _, _ = dsrun.initialize(model=module, config=CONFIG,
                                               model_parameters=groups)
    held = sum(len(g["params"]) for g in optimizer.param_groups)
    return {"held": held, "owned": len(list(module.parameters())),
            "moved": _moved(engine, 1)}


def exhausted(args: argparse.Namespace) -> dict[str, Any]:
    module = _module(0)
    engine, _, _, _ = dsrun.initialize(model=module, config=CONFIG,
                                       model_parameters=module.parameters())
    errors = []
    for _ in range(2):  # two epochs of 3 micro-batches: the 2nd batch runs out
        it = iter(_data(3))
        while True:
            try:
                engine.train_batch(it)
            except StopIteration as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                break
            except Exception as exc:  # noqa: BLE001 - the test reads it
                errors.append(f"{type(exc).__name__}: {exc}")
                return {"errors": errors}
    return {"errors": errors}


def run(out: dict[str, Any], name: str, fn: Callable[..., dict[str, Any]], *args: Any) -> None:
    try:
        out[name] = {"ok": True, **fn(*args)}
    except Exception:  # noqa: BLE001 - the test reports it
        out[name] = {"ok": False, "error": traceback.format_exc()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    args = parser.parse_args()
    dsrun.init_distributed()
    with contextlib.suppress(Exception):
        torch.set_num_threads(1)
    out: dict[str, Any] = {"world_size": dist.get_world_size()}
    run(out, "loss_param", loss_param, args)
    run(out, "frozen_filtered", frozen_filtered, args)
    run(out, "written_scale", written_scale, args)
    run(out, "group_generator", group_generator, args)
    run(out, "exhausted", exhausted, args)  # last: the stages are out of step after it
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
