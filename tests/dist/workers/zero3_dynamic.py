"""ZeRO models whose ranks do different things, through the engine, in one
2-rank dsrun job; each rank writes ``OUT_DIR/rank<R>.json`` and
tests/dist/test_zero3_dynamic.py judges.

* **moe**: a gate and three experts (each a small MLP); every token runs the
  expert its gate picks, and the ranks' data (positive on rank 0, negative
  on rank 1) make them pick different experts. Trained at stage 0 (the
  DDP-style reference), at stage 3 with the block flagged by
  ``deepspeed.utils.set_z3_leaf_modules``, at stage 3 through the
  ``zero_optimization.leaf_module`` section,
  at stage 3 with every parameter kept whole (the persistence threshold),
  and at stage 3 unflagged, which must stop with dsrun's divergence error.
* **tied**: a parent's forward reads its embedding's weight (a tied output
  projection) with no register_external_parameter: stage 3 equals stage 0.
* **ckpt**: activation checkpointing at stage 3 (every parameter
  partitioned): a block checkpointed by torch's non-reentrant checkpoint
  (``memory_efficient_linear`` on and off), by ``deepspeed.checkpointing``
  and by torch's reentrant one, and the MoE leaf inside a non-reentrant
  checkpoint, each equal to stage 0 and with nothing left gathered; the
  recomputation in backward runs the block's forward again.
* **weight_norm**: a convolution weight-normed inside
  ``GatheredParameters(modifier_rank=0)`` under ``zero.Init`` (Hugging
  Face's speech models): stage 3 equals stage 0.
* **modify**: at stages 0, 1 and 2 (fp32 and fp16: separate fp32 masters),
  ``GatheredParameters(params, modifier_rank=1)`` with an edit on rank 1
  only; with lr 0 every rank's parameters and masters must keep the edit.

Usage: ``dsrun --num_gpus 2 zero3_dynamic.py OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

import dsrun as deepspeed
from dsrun.errors import DsrunError
from dsrun.runtime.zero.partitioned import ZeroParamStatus

STEPS = 4


def config(stage: int, **zero: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "reduce_bucket_size": 50, **zero}}


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 3)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4)) for _ in range(3))
        self.used: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.gate(x).softmax(-1)
        choice = weights.argmax(-1)
        out = torch.zeros_like(x)
        used = []
        for i, expert in enumerate(self.experts):
            mask = choice == i
            if mask.any():
                used.append(i)
                out = out.index_put((mask,), expert(x[mask]) * weights[mask, i:i + 1])
        self.used.append(used)
        return out


class MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.moe = MoE()
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(self.inp(x)))


def moe_batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7 + rank)
    sign = 1.0 if rank == 0 else -1.0
    return [torch.rand(4, 4, generator=g) * sign for _ in range(STEPS)]


def train(model: nn.Module, cfg: dict[str, Any], batches: list[torch.Tensor]) -> dict[str, Any]:
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    losses = []
    for x in batches:
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = {}
    gathered = [name for name, p in engine.module.named_parameters()
                if getattr(p, "ds_status", ZeroParamStatus.NOT_AVAILABLE)
                is not ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist]
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            params[name] = p.detach().flatten().tolist()
    return {"losses": losses, "params": params, "gathered": gathered}


def moe_model() -> MoEModel:
    torch.manual_seed(0)
    return MoEModel()


def moe_cases(rank: int) -> dict[str, Any]:
    batches = moe_batches(rank)
    out: dict[str, Any] = {}
    ref = moe_model()
    out["stage0"] = train(ref, config(0), batches)
    out["used"] = ref.moe.used
    flagged = moe_model()
    out["leaves"] = [type(m).__name__ for m in
                     deepspeed.utils.set_z3_leaf_modules(flagged, [MoE])]
    out["leaf_api"] = train(flagged, config(3), batches)
    out["leaf_parameter"] = {name: deepspeed.utils.z3_leaf_parameter(p)
                             for name, p in flagged.named_parameters()}
    whole = moe_model()  # every parameter kept whole (default threshold): no gathers
    deepspeed.utils.set_z3_leaf_modules(whole, ["MoE"])
    cfg = config(3)
    del cfg["zero_optimization"]["stage3_param_persistence_threshold"]
    out["leaf_persistent"] = train(whole, cfg, batches)
    named = moe_model()
    out["leaf_config"] = train(named, config(3, leaf_module={"names": ["moe"]}), batches)
    try:
        train(moe_model(), config(3), batches)
        out["unflagged"] = "trained"
    except DsrunError as exc:
        out["unflagged"] = str(exc)
    return out


class Tied(nn.Module):
    """An embedding whose weight the parent's forward reads again (a tied
    output projection), without register_external_parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(self.emb(idx))) @ self.emb.weight.t()


def tied_cases(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3 + rank)
    batches = [torch.randint(0, 10, (4,), generator=g) for _ in range(STEPS)]
    out: dict[str, Any] = {}
    for name, stage in (("stage0", 0), ("stage3", 3)):
        torch.manual_seed(0)
        model = Tied()
        out[name] = train(model, config(stage), batches)
        out[f"{name}_external"] = [type(p).__name__ for _, p in
                                   getattr(model, "ds_external_parameters", dict)()]
    return out


class Normed(nn.Module):
    """A weight-normed convolution made as Hugging Face's speech models make
    theirs: ``weight_norm`` inside ``GatheredParameters(modifier_rank=0)``
    (under ``zero.Init`` at stage 3), which calls ``nn.Parameter(weight)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 3, padding=1)
        with deepspeed.zero.GatheredParameters(self.conv.weight, modifier_rank=0):
            self.conv = nn.utils.parametrizations.weight_norm(self.conv, name="weight", dim=2)
        self.out = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.conv(x)).mean(-1))


def weight_norm_cases(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(5 + rank)
    batches = [torch.randn(4, 2, 5, generator=g) for _ in range(STEPS)]
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    out["stage0"] = train(Normed(), config(0), batches)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config(3)):
        model = Normed()
    out["stage3"] = train(model, config(3), batches)
    return out


def checkpointed(how: str, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if how == "reentrant":
        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
    if how == "deepspeed":
        return deepspeed.checkpointing.checkpoint(block, x)
    if how == "torch":
        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    return block(x)


class Checkpointed(nn.Module):
    """Linear -> checkpoint(Linear, Tanh, Linear) -> Linear."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.inp = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(checkpointed(self.how, self.block, self.inp(x)))


class CheckpointedMoE(MoEModel):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(checkpointed("torch", self.moe, self.inp(x)))


def ckpt_cases(rank: int) -> dict[str, Any]:
    batches = moe_batches(rank)
    out: dict[str, Any] = {}
    runs = [("stage0", "none", 0, {}), ("torch", "torch", 3, {}),
            ("torch_plain_linear", "torch", 3, {"memory_efficient_linear": False}),
            ("deepspeed", "deepspeed", 3, {}), ("reentrant", "reentrant", 3, {})]
    for name, how, stage, zero in runs:
        torch.manual_seed(0)
        cfg = config(stage, **zero)
        out[name] = _guarded(lambda how=how, cfg=cfg: train(Checkpointed(how), cfg, batches))
    torch.manual_seed(0)
    leaf = CheckpointedMoE()
    deepspeed.utils.set_z3_leaf_modules(leaf, [MoE])
    out["leaf"] = _guarded(lambda: train(leaf, config(3), batches))
    return out


def _guarded(run: Any) -> dict[str, Any]:
    """A failing case is reported, not fatal to the job's other cases."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(exc).__name__}: {exc}"}


def modify_case(stage: int, precision: str) -> dict[str, Any]:
    """One step, then rank 1 alone sets every parameter to 0.5 inside
    GatheredParameters(modifier_rank=1); two more steps with lr 0."""
    cfg = config(stage)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.0}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3), nn.Tanh(), nn.Linear(3, 1))
    model[0].requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[
        p for p in model.parameters() if p.requires_grad], config=cfg)
    dtype = next(engine.module.parameters()).dtype

    def step() -> None:
        loss = engine(torch.ones(2, 4, dtype=dtype)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()

    step()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=1):
        if dist.get_rank() == 1:
            for p in params:
                p.data.fill_(0.5)
    step()
    step()
    masters = [deepspeed.utils.safe_get_full_fp32_param(p) for p in params]
    return {"params": [v for p in params for v in p.detach().float().flatten().tolist()],
            "masters": [v for m in masters if m is not None for v in m.flatten().tolist()],
            "masters_of": sum(m is not None for m in masters)}


def modify_cases() -> dict[str, Any]:
    return {f"stage{stage}-{precision}": modify_case(stage, precision)
            for stage in (0, 1, 2) for precision in ("fp32", "fp16")}


class TwoBranches(nn.Module):
    """A trunk and two heads; ``pick`` chooses the head each forward."""

    def __init__(self, pick: Any) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)
        self.c = nn.Linear(4, 1)
        self.pick = pick
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head = self.b if self.pick(self.calls) == "b" else self.c
        self.calls += 1
        return head(torch.tanh(self.trunk(x)))


def branch_run(stage: int, pick: Any, accumulation: int, rank: int) -> dict[str, Any]:
    """Losses, gradient norms and parameters over STEPS steps, clipping at 0.1."""
    torch.manual_seed(0)
    cfg = {**config(stage), "gradient_clipping": 0.1,
           "gradient_accumulation_steps": accumulation}
    engine, *_ = deepspeed.initialize(model=TwoBranches(pick), config=cfg)
    g = torch.Generator().manual_seed(11 + rank)
    norms = []
    for micro in range(STEPS * accumulation):
        engine.backward(engine(torch.randn(4, 4, generator=g)).pow(2).mean())
        engine.step()
        if (micro + 1) % accumulation == 0:
            norms.append(float(engine.get_global_grad_norm()))
    params = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            params[name] = p.detach().flatten().tolist()
    return {"norms": norms, "params": params}


def branch_cases(rank: int) -> dict[str, Any]:
    """Heads used on alternate steps (or micro-steps), at stages 0-3, and
    heads that differ between ranks, at stages 0-2."""
    by_step = lambda calls: "bc"[calls % 2]  # noqa: E731
    by_rank = lambda calls: "bc"[rank]  # noqa: E731
    out: dict[str, Any] = {}
    for stage in (0, 1, 2, 3):
        out[f"alternate-s{stage}"] = branch_run(stage, by_step, 1, rank)
        out[f"alternate-gas2-s{stage}"] = branch_run(stage, by_step, 2, rank)
    for stage in (0, 1, 2):
        out[f"by_rank-s{stage}"] = branch_run(stage, by_rank, 1, rank)
    return out


def outside_forward_case() -> dict[str, Any]:
    """An L2 term on a partitioned weight, computed in the training loop."""
    engine, *_ = deepspeed.initialize(model=moe_model(), config=config(3))
    loss = engine(torch.ones(4, 4)).pow(2).mean() + engine.module.out.weight.pow(2).sum()
    try:
        engine.backward(loss)
    except DsrunError as err:
        return {"error": str(err), "cause": type(err.__cause__).__name__}
    return {"error": None}


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank = dist.get_rank()
    result: dict[str, Any] = {"rank": rank, "moe": moe_cases(rank), "tied": tied_cases(rank),
                              "ckpt": ckpt_cases(rank), "weight_norm": weight_norm_cases(rank),
                              "modify": modify_cases(), "branches": branch_cases(rank),
                              "outside": outside_forward_case()}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
