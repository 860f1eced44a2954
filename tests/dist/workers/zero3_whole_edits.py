"""Writes to the full data of ZeRO-3 parameters kept whole, through the
engine; run at world size 1 and 2 (the same cases), each rank writes
``OUT_DIR/rank<R>.json`` and tests/dist/test_zero3_whole_edits.py judges.

Every case uses a ``Linear(4, 4)`` (20 elements: kept whole under the
default persistence threshold) and records its bias, with the learning
rate 0 unless said otherwise, so that a step changes nothing but what the
edit rule decides:

* **init**: built under ``zero.Init``, bias zeroed afterwards (what a
  parent's ``reset_parameters`` does to a child), then initialize() and a
  step - per precision and offload setting;
* **outside**: bias set to 1 on every rank after initialize(), outside any
  context, then a step;
* **dropped**: bias set to 1 inside ``GatheredParameters`` without
  ``modifier_rank``, then a step;
* **setters**: ``safe_set_local_fp32_param``, then a step; then
  ``safe_set_full_fp32_param`` inside ``GatheredParameters`` without
  ``modifier_rank``, then a step;
* **nested**: the same edit in a context without ``modifier_rank`` nested
  in one with ``modifier_rank=0``, and the other way round;
* **step_inside**: a step with lr 0.1 inside a context without
  ``modifier_rank``;
* **replanned**: edits after a first step inside a context, after
  ``bias.data`` was replaced, and of the new tensor;
* **replaced_trains**: ``weight.data`` replaced by a new tensor (0.5)
  after initialize(), then two steps with lr 0.1, per precision and
  offload setting: the data must follow the optimizer (at world size 1
  a replaced tensor was once cut off from its shard and stayed 0.5);
* **mha** (world size 2 only): a small transformer with
  ``nn.MultiheadAttention`` built with and without ``zero.Init``, trained
  at stage 3, and at stage 0, per precision: losses per step.

Usage: ``dsrun --num_gpus N zero3_whole_edits.py OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dsrun
from dsrun.utils import (
    safe_get_full_fp32_param,
    safe_get_local_fp32_param,
    safe_set_full_fp32_param,
    safe_set_local_fp32_param,
)

PRECISIONS: dict[str, dict[str, Any]] = {
    "fp32": {}, "fp16": {"fp16": {"enabled": True, "initial_scale_power": 4}},
    "bf16": {"bf16": {"enabled": True}}}
OFFLOADS: dict[str, dict[str, Any]] = {
    "none": {}, "param": {"offload_param": {"device": "cpu"}},
    "optimizer": {"offload_optimizer": {"device": "cpu"}}}
SETTINGS = [(p, o) for p in PRECISIONS for o in OFFLOADS]


def config(precision: str = "fp32", offload: str = "none", lr: float = 0.0,
           stage: int = 3) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "Adam", "params": {"lr": lr, "torch_adam": True}},
            "zero_optimization": {"stage": stage, **OFFLOADS[offload]},
            **PRECISIONS[precision]}


def values(t: torch.Tensor) -> list[float]:
    return [float(v) for v in t.detach().float().reshape(-1)]


def linear(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(4, 4)


def step(engine: Any, lin: nn.Linear) -> float:
    """One training step on a fixed input; the forward's output sum."""
    out = engine(torch.ones(1, 4, dtype=lin.weight.dtype)).float().sum()
    engine.backward(out)
    engine.step()
    return out.item()


def init_case(precision: str, offload: str) -> dict[str, Any]:
    c = config(precision, offload)
    torch.manual_seed(0)
    with dsrun.zero.Init(config_dict_or_path=c):
        lin = nn.Linear(4, 4)
    with torch.no_grad():
        lin.bias.zero_()
    engine, *_ = dsrun.initialize(model=lin, config=c)
    master = values(safe_get_full_fp32_param(lin.bias))
    out = step(engine, lin)
    return {"master": master, "out": out, "after": values(lin.bias.data)}


def outside_case(precision: str, offload: str) -> dict[str, Any]:
    lin = linear()
    engine, *_ = dsrun.initialize(model=lin, config=config(precision, offload))
    original = values(lin.bias.data)
    with torch.no_grad():
        lin.bias.fill_(1.0)
    out = step(engine, lin)
    return {"original": original, "out": out, "after": values(lin.bias.data),
            "master": values(safe_get_full_fp32_param(lin.bias))}


def dropped_case(precision: str, offload: str) -> dict[str, Any]:
    lin = linear()
    engine, *_ = dsrun.initialize(model=lin, config=config(precision, offload))
    original = values(lin.bias.data)
    with dsrun.zero.GatheredParameters([lin.bias]):
        with torch.no_grad():
            lin.bias.fill_(1.0)
        inside = values(lin.bias.data)
    on_exit = values(lin.bias.data)
    out = step(engine, lin)
    return {"original": original, "inside": inside, "on_exit": on_exit, "out": out,
            "after": values(lin.bias.data)}


def setters_case(precision: str, offload: str) -> dict[str, Any]:
    """``safe_set_local_fp32_param`` (bias to 7), a step; then
    ``safe_set_full_fp32_param`` inside a context without ``modifier_rank``
    (bias to 5), a step: the bias and its master after each."""
    lin = linear()
    engine, *_ = dsrun.initialize(model=lin, config=config(precision, offload))
    local = safe_get_local_fp32_param(lin.bias)
    safe_set_local_fp32_param(lin.bias, torch.full_like(local, 7.0))
    step(engine, lin)
    result = {"local": {"after": values(lin.bias.data),
                        "master": values(safe_get_full_fp32_param(lin.bias))}}
    with dsrun.zero.GatheredParameters([lin.bias]):
        safe_set_full_fp32_param(lin.bias, torch.full((4,), 5.0))
    step(engine, lin)
    result["full_in_context"] = {"after": values(lin.bias.data),
                                 "master": values(safe_get_full_fp32_param(lin.bias))}
    return result


def nested_case(outer_rank: Any, inner_rank: Any) -> dict[str, Any]:
    lin = linear()
    engine, *_ = dsrun.initialize(model=lin, config=config())
    original = values(lin.bias.data)
    with dsrun.zero.GatheredParameters([lin.bias], modifier_rank=outer_rank):
        with dsrun.zero.GatheredParameters([lin.bias], modifier_rank=inner_rank):
            with torch.no_grad():
                lin.bias.fill_(1.0)
    on_exit = values(lin.bias.data)
    step(engine, lin)
    return {"original": original, "on_exit": on_exit, "after": values(lin.bias.data),
            "master": values(safe_get_full_fp32_param(lin.bias))}


def step_inside_case() -> dict[str, Any]:
    lin = linear()
    engine, *_ = dsrun.initialize(model=lin, config=config(lr=0.1))
    original = values(lin.bias.data)
    with dsrun.zero.GatheredParameters([lin.bias]):
        step(engine, lin)
    return {"original": original, "after": values(lin.bias.data),
            "master": values(safe_get_full_fp32_param(lin.bias))}


def replanned_case() -> dict[str, Any]:
    """The copies of edits are planned once and again when what decides
    them changes: a first step inside a context without ``modifier_rank``
    (the bias, pinned, is left out), then an edit (3) outside and a step;
    then ``bias.data`` replaced by a new tensor (2) and a step, and an edit
    of that tensor (4) and a step."""
    lin = linear()
    engine, *_ = dsrun.initialize(model=lin, config=config())
    result: dict[str, Any] = {}
    with dsrun.zero.GatheredParameters([lin.bias]):
        step(engine, lin)
    for key, value in (("unpinned", 3.0), ("replaced", 2.0), ("edited", 4.0)):
        with torch.no_grad():
            if key == "replaced":
                lin.bias.data = torch.full((4,), value)
            else:
                lin.bias.fill_(value)
        step(engine, lin)
        result[key] = {"after": values(lin.bias.data),
                       "master": values(safe_get_full_fp32_param(lin.bias))}
    # non-contiguous data (a transposed tensor, as channels_last gives): its
    # slice is read each step, never a copy flattened once
    strided = torch.arange(16.0).reshape(4, 4).t()
    for key in ("strided", "strided_edited"):
        with torch.no_grad():
            if key == "strided":
                lin.weight.data = strided
            else:
                lin.weight.mul_(2)
        step(engine, lin)
        result[key] = {"contiguous": lin.weight.data.is_contiguous(),
                       "after": values(lin.weight.data),
                       "master": values(safe_get_full_fp32_param(lin.weight))}
    return result


def replaced_trains_case(precision: str, offload: str) -> dict[str, Any]:
    lin = linear()
    engine, *_ = dsrun.initialize(model=lin, config=config(precision, offload, lr=0.1))
    lin.weight.data = torch.full_like(lin.weight.data, 0.5)
    outs = [step(engine, lin) for _ in range(2)]
    return {"outs": outs, "after": values(lin.weight.data),
            "master": values(safe_get_full_fp32_param(lin.weight))}


class Block(nn.Module):
    """Pre-norm attention and MLP: MultiheadAttention zeroes its
    ``out_proj.bias`` after building ``out_proj`` (partitioned by then
    under zero.Init)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.att = nn.MultiheadAttention(width, 2, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.att(h, h, h, need_weights=False)[0]
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class Tiny(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mha_losses(precision: str, stage: int, under_init: bool) -> list[float]:
    c = config(precision, lr=1e-2, stage=stage)
    c["train_micro_batch_size_per_gpu"] = 2
    torch.manual_seed(0)
    if under_init:
        with dsrun.zero.Init(config_dict_or_path=c):
            model = Tiny()
    else:
        model = Tiny()
    engine, *_ = dsrun.initialize(model=model, config=c)
    data = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(4):
        idx = torch.randint(0, 32, (2, 8), generator=data)
        logits = engine(idx).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32),
                                                 idx.roll(-1, 1).reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def main(out_dir: Path) -> None:
    dsrun.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, Any] = {"rank": rank, "world": world}
    for precision, offload in SETTINGS:
        key = f"{precision}-{offload}"
        result.setdefault("init", {})[key] = init_case(precision, offload)
        result.setdefault("outside", {})[key] = outside_case(precision, offload)
        result.setdefault("dropped", {})[key] = dropped_case(precision, offload)
        result.setdefault("setters", {})[key] = setters_case(precision, offload)
        if offload != "param":
            result.setdefault("replaced_trains", {})[key] = replaced_trains_case(
                precision, offload)
    result["nested"] = {"outer0-inner_none": nested_case(0, None),
                        "outer_none-inner0": nested_case(None, 0)}
    result["step_inside"] = step_inside_case()
    result["replanned"] = replanned_case()
    if world > 1:
        result["mha"] = {precision: {"init": mha_losses(precision, 3, True),
                                     "plain": mha_losses(precision, 3, False),
                                     "stage0": mha_losses(precision, 0, False)}
                         for precision in ("fp32", "fp16")}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
