"""``dsrun.utils`` on real gloo ranks; each rank writes ``<out>/rank<R>.json``
for tests/dist/test_utils_ranks.py.

* ``save_stage3`` - a stage-3 engine (partitioned weights, persistent
  biases, a tied weight, a frozen parameter, a buffer) trains 2 steps and
  saves ``CKPT``; rank 0 writes the gathered state dict to ``<out>/full.pt``.
* ``access_s<S>`` - for stages 1 (gradient accumulation 2: gradients stay
  unreduced in the parameters until the step), 2 and 3: an engine and a
  plain reference model with ``torch.optim.AdamW`` on the same global
  batches. Before every step the full gradients (also after the first
  micro-step at stage 1) are compared with the reference's, after it the
  fp32 values (with the reference and with the gathered parameters) and
  Adam's state; then the setters change a weight, its ``exp_avg`` and a
  bias gradient in both, and one more step must keep them equal. Stage 3
  also checks the local shards against the full value.
* ``log_dist`` - which messages each rank logs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

import dsrun
import dsrun.utils as utils

LR = 0.01
MICRO = 2


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 10)
        self.mid = torch.nn.Linear(10, 10)
        self.out = torch.nn.Linear(10, 6)
        self.back = torch.nn.Linear(6, 10, bias=False)
        self.back.weight = self.inp.weight  # tied
        self.frozen = torch.nn.Parameter(torch.randn(10) * 0.1, requires_grad=False)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)) + self.frozen
        h = torch.tanh(self.mid(h)) * (1 + self.scale)
        return torch.tanh(self.back(self.out(h))).square().mean()


def build(stage: int, gas: int = 1) -> tuple[Any, Net]:
    """The engine and, built from the same initial values, a plain copy."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 12},
              "steps_per_print": 1000, "gradient_clipping": 0.0}
    engine, *_ = dsrun.initialize(model=model, config=config)
    return engine, reference


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's rows, the global micro-batch) of a micro-step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = torch.randn(MICRO * world, 6, generator=torch.Generator().manual_seed(100 * step
                                                                                 + micro))
    return rows[rank * MICRO:(rank + 1) * MICRO], rows


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    state = engine.optimizer.module_state_dict() if engine.zero_stage == 3 else \
        engine.module.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


def case(out: dict[str, Any], name: str, fn: Callable[..., dict[str, Any]], *args: Any) -> None:
    try:
        out[name] = {"ok": True, **fn(*args)}
    except Exception:  # noqa: BLE001 - the test reads the traceback
        out[name] = {"ok": False, "error": traceback.format_exc()}


def save_stage3(args: argparse.Namespace) -> dict[str, Any]:
    engine, _ = build(3)
    for step in range(2):
        loss = engine(batch(step, 0)[0])
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(args.ckpt)
    full = full_params(engine)
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(args.out, "full.pt"))
    engine.destroy()
    return {}


class Diffs:
    """Largest differences per kind, relative to the largest reference value
    (and None/not-None mismatches)."""

    def __init__(self) -> None:
        self.max: dict[str, float] = {}
        self.problems: list[str] = []

    def add(self, kind: str, got: Optional[torch.Tensor], want: Optional[torch.Tensor],
            where: str) -> None:
        if got is None or want is None:
            if (got is None) != (want is None):
                got_text, want_text = ("None" if t is None else "a tensor" for t in (got, want))
                self.problems.append(f"{kind} {where}: got {got_text}, want {want_text}")
            return
        if tuple(got.shape) != tuple(want.shape):
            self.problems.append(f"{kind} {where}: shape {tuple(got.shape)} vs "
                                 f"{tuple(want.shape)}")
            return
        want = want.detach().float()
        diff = float((got.detach().float().cpu() - want).abs().max()) if want.numel() else 0.0
        scale = max(float(want.abs().max()) if want.numel() else 0.0, 1e-12)
        self.max[kind] = max(self.max.get(kind, 0.0), diff / scale)  # relative


def micro_steps(engine: Any, ref: Net, step: int, gas: int, diffs: Diffs) -> None:
    """Forward and backward of one step in both, up to the boundary's
    ``engine.step()`` (the caller's); checks the partial gradients."""
    named = dict(engine.module.named_parameters())
    for micro in range(gas):
        mine, rows = batch(step, micro)
        engine.backward(engine(mine))
        (ref(rows) / gas).backward()
        if micro + 1 < gas:  # mid-accumulation: the partial mean, and nothing reduced early
            for name, p in ref.named_parameters():
                diffs.add("partial_grad", utils.safe_get_full_grad(named[name]), p.grad, name)
            engine.step()  # not a boundary: counts the micro-step


def compare(engine: Any, ref: Net, opt: torch.optim.Optimizer, diffs: Diffs, what: str) -> None:
    named = dict(engine.module.named_parameters())
    gathered = full_params(engine)
    for name, p in ref.named_parameters():
        value = utils.safe_get_full_fp32_param(named[name])
        diffs.add(f"{what}_value", value, p if p.requires_grad else None, name)
        if value is not None:
            diffs.add(f"{what}_vs_gathered", value, gathered[name], name)
        for key in ("exp_avg", "exp_avg_sq"):
            want = opt.state[p][key] if p in opt.state else None
            diffs.add(f"{what}_{key}", utils.safe_get_full_optimizer_state(named[name], key),
                      want, name)


def access(stage: int) -> dict[str, Any]:
    gas = 2 if stage == 1 else 1
    engine, ref = build(stage, gas)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR,
                            weight_decay=0.0)
    named = dict(engine.module.named_parameters())
    diffs = Diffs()
    before_step = [utils.safe_get_full_optimizer_state(named["mid.weight"], "exp_avg")]
    for step in range(2):
        micro_steps(engine, ref, step, gas, diffs)
        for name, p in ref.named_parameters():
            diffs.add("grad", utils.safe_get_full_grad(named[name]), p.grad, name)
        engine.step()
        opt.step()
        opt.zero_grad()
        compare(engine, ref, opt, diffs, "stepped")
    after_step_grad = utils.safe_get_full_grad(named["mid.weight"])

    # the setters, in both: a weight and its exp_avg now, a bias gradient after backward
    new_weight = ref.mid.weight.detach() * 0.5 + 0.25
    utils.safe_set_full_fp32_param(named["mid.weight"], new_weight)
    set_value = utils.safe_get_full_fp32_param(named["mid.weight"])
    set_model = full_params(engine)["mid.weight"]
    ref.mid.weight.data.copy_(new_weight)
    doubled = opt.state[ref.mid.weight]["exp_avg"] * 2
    utils.safe_set_full_optimizer_state(named["mid.weight"], doubled, "exp_avg")
    opt.state[ref.mid.weight]["exp_avg"].copy_(doubled)
    micro_steps(engine, ref, 2, gas, diffs)
    new_grad = ref.out.bias.grad * 3 + 1
    utils.safe_set_full_grad(named["out.bias"], new_grad)
    ref.out.bias.grad.copy_(new_grad)
    diffs.add("set_grad", utils.safe_get_full_grad(named["out.bias"]), new_grad, "out.bias")
    engine.step()
    opt.step()
    compare(engine, ref, opt, diffs, "after_set")
    result = {"max": diffs.max, "problems": diffs.problems,
              "state_before_step_is_none": before_step[0] is None,
              "grad_after_step_is_none": after_step_grad is None,
              "set_value_exact": bool(torch.equal(set_value.cpu(), new_weight)),
              "set_model_exact": bool(torch.equal(set_model.cpu(), new_weight))}
    if stage == 3:
        result.update(local_shards(engine))
    engine.destroy()
    return result


def local_shards(engine: Any) -> dict[str, Any]:
    """The local shards, gathered, are the full values; a local set shows."""
    world = dist.get_world_size()
    out: dict[str, Any] = {}
    for name in ("mid.weight", "out.bias"):  # partitioned, persistent
        p = dict(engine.module.named_parameters())[name]
        full = utils.safe_get_full_fp32_param(p).reshape(-1)
        for kind, local, want in (
                ("value", utils.safe_get_local_fp32_param(p), full),
                ("exp_avg", utils.safe_get_local_optimizer_state(p, "exp_avg"),
                 utils.safe_get_full_optimizer_state(p, "exp_avg").reshape(-1))):
            shards = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(shards, local)
            out[f"local_{kind}_{name}"] = bool(torch.equal(torch.cat(shards)[:full.numel()],
                                                           want))
    p = dict(engine.module.named_parameters())["mid.weight"]
    before = utils.safe_get_full_fp32_param(p).clone()
    utils.safe_set_local_fp32_param(p, utils.safe_get_local_fp32_param(p) + 1)
    gathered = full_params(engine)["mid.weight"]
    out["local_set_full"] = bool(torch.equal(utils.safe_get_full_fp32_param(p), before + 1))
    out["local_set_gathered"] = bool(torch.equal(gathered, before + 1))
    return out


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def log_dist_case() -> dict[str, Any]:
    records = Records()
    utils.logger.addHandler(records)
    try:
        utils.log_dist("all", ranks=[-1])
        utils.log_dist("zero", ranks=[0])
        utils.log_dist("one", ranks=[1])
        utils.log_dist("both", ranks=[0, 1])
        utils.log_dist("unnamed")
        utils.log_dist("warn", ranks=[1], level=logging.WARNING)
    finally:
        utils.logger.removeHandler(records)
    return {"messages": records.messages}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    args = parser.parse_args()
    if not dist.is_initialized():
        dsrun.init_distributed()
    with contextlib.suppress(Exception):
        torch.set_num_threads(1)
    out: dict[str, Any] = {"world_size": dist.get_world_size()}
    case(out, "save_stage3", save_stage3, args)
    for stage in (1, 2, 3):
        case(out, f"access_s{stage}", access, stage)
    case(out, "log_dist", log_dist_case)
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
