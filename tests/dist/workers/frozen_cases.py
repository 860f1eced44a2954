"""Frozen, unlisted and missing parameters and optimizers through the engine,
in one 2-rank dsrun job; each rank writes ``OUT_DIR/rank<R>.json`` and
tests/dist/test_frozen_params.py judges.

* **noopt**: stage 3 without an optimizer (DeepSpeed-Chat's reference and
  EMA engines): the forward under ``no_grad`` equals the unpartitioned
  model's, parameters stay partitioned, GatheredParameters and the 16-bit
  state dict give the full values, backward and step are refused; stages
  1 and 2 without an optimizer are refused at initialize().
* **refreeze**: a parameter frozen after initialize() must not move under
  plain SGD (no momentum), at stages 0-3; at stages 1-2 a step with no
  backward since the last one moves nothing either.
* **stage0**: a parameter frozen after initialize() has no gradient after
  backward; one frozen at initialize() but passed in model_parameters
  trains once unfrozen, alike on both ranks (with fp16 masters too: not
  moved while frozen); under fp16 a value written into a frozen weight
  after initialize() survives steps and checkpoints, and the weight trains
  from it once unfrozen (the fp32 master made at initialize() is stale).
* **unlisted**: at stage 3 a trainable parameter in no param group is
  accepted, used in forward and backward, and not trained.
* **empty_group**: a param group without parameters is dropped; a client
  LR scheduler built over the client optimizer with one is refused.
* **saved**: checkpoints of those states save, load back into an engine
  built alike, and consolidate (``exclude_frozen_parameters``) without the
  parameters frozen when saved; an AdamW checkpoint loads into a stage-3
  engine without an optimizer (each loading engine is offset first, so
  equal weights after the load mean the load restored them).

Usage: ``dsrun --num_gpus 2 frozen_cases.py OUT_DIR``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import dsrun as deepspeed
from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.runtime.zero import ZeroParamStatus


def config(stage: int, optimizer: str | None = "SGD", **zero: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                           "zero_optimization": {"stage": stage,
                                                 "stage3_param_persistence_threshold": 0,
                                                 **zero}}
    if optimizer == "SGD":
        out["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
        out["zero_allow_untested_optimizer"] = True
    elif optimizer == "AdamW":
        out["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}
    return out


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def data(step: int) -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))


def full(engine: Any, param: torch.nn.Parameter) -> torch.Tensor:
    with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
        return param.detach().clone()


def refused(call: Any) -> str:
    try:
        call()
    except (DsrunError, DsrunConfigError) as error:
        return str(error)
    return ""


def noopt_case(out_dir: Path) -> dict[str, Any]:
    reference = model()
    engine, *_ = deepspeed.initialize(model=copy.deepcopy(reference), config=config(
        3, optimizer=None, stage3_gather_16bit_weights_on_model_save=True))
    engine.eval()
    x = data(0)
    with torch.no_grad():
        got, want = engine(x), reference(x)
    weight = engine.module[0].weight
    state = engine._zero3_consolidated_16bit_state_dict()
    engine.save_16bit_model(str(out_dir / "noopt"))
    saved = torch.load(out_dir / "noopt" / "pytorch_model.bin") if dist.get_rank() == 0 else {}
    engine.train()
    loss = engine(x).sum()
    return {
        "forward_diff": (got - want).abs().max().item(),
        "partitioned": weight.ds_tensor.numel() < weight.ds_numel
        and weight.ds_status is ZeroParamStatus.NOT_AVAILABLE,
        "gathered_diff": (full(engine, weight) - reference[0].weight).abs().max().item(),
        "state_dict_diff": _diff(state, reference) if dist.get_rank() == 0 else 0.0,
        "saved_diff": _diff(saved, reference) if dist.get_rank() == 0 else 0.0,
        "saved_keys": sorted(saved),
        "backward": refused(lambda: engine.backward(loss)),
        "step": refused(engine.step),
        "get_lr": engine.get_lr(),
        "stage1": refused(lambda: deepspeed.initialize(model=model(), config=config(1, None))),
        "stage2": refused(lambda: deepspeed.initialize(model=model(), config=config(2, None))),
    }


def _diff(state: Any, reference: torch.nn.Module) -> float:
    return max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())


def refreeze_case(stage: int) -> dict[str, Any]:
    m = model()
    engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                      config=config(stage))
    weight = engine.module[0].weight
    before = None
    for s in range(5):
        if s == 2:
            weight.requires_grad_(False)
            before = full(engine, weight)
        loss = engine(data(s)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    moved = (full(engine, weight) - before).abs().max().item()
    out: dict[str, Any] = {"frozen_moved": moved}
    if stage in (1, 2):
        other = engine.module[2].weight
        last = full(engine, other)
        engine.step()  # no backward since the last step: nothing to apply
        out["no_backward_moved"] = (full(engine, other) - last).abs().max().item()
    return out


def stage0_case() -> dict[str, Any]:
    m = model()
    engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                      config=config(0, "AdamW"))
    first = engine.module[0].weight
    engine.backward(engine(data(0)).pow(2).mean())
    engine.step()
    first.requires_grad_(False)
    before = first.detach().clone()
    engine.backward(engine(data(1)).pow(2).mean())
    grad_is_none = first.grad is None
    engine.step()
    out = {"frozen_grad_none": grad_is_none,
           "frozen_moved": (first - before).abs().max().item()}

    m = model()
    m[0].weight.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                      config=config(0, "AdamW"))
    late = engine.module[0].weight
    initial = late.detach().clone()
    for s in range(3):
        if s == 1:
            late.requires_grad_(True)
        engine.backward(engine(data(s)).pow(2).mean())
        engine.step()
    out["unfrozen_moved"] = (late - initial).abs().max().item()
    out["unfrozen_value"] = late.detach().flatten().tolist()
    out["fp16_unfrozen"] = fp16_unfrozen()
    return out


FP16 = {"enabled": True, "loss_scale": 128, "auto_cast": True}


def fp16_unfrozen() -> dict[str, Any]:
    """fp16 (fp32 masters) at stage 0: a weight frozen at initialize() and
    passed in model_parameters stays put while frozen and trains once
    unfrozen, alike on both ranks, as in fp32."""
    m = model()
    m[0].weight.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                      config={**config(0), "fp16": FP16})
    late = engine.module[0].weight
    initial = late.detach().float().clone()
    frozen_moved = -1.0
    for s in range(3):
        if s == 1:
            frozen_moved = (late.float() - initial).abs().max().item()
            late.requires_grad_(True)
        engine.backward(engine(data(s)).float().pow(2).mean())
        engine.step()
    return {"frozen_moved": frozen_moved, "moved": (late.float() - initial).abs().max().item(),
            "value": late.detach().float().flatten().tolist()}


def fp16_edited_case(out_dir: Path) -> dict[str, Any]:
    """fp16 at stage 0: 0.5 written into a weight frozen at initialize()
    (a base model loaded afterwards) survives a step and a checkpoint, and
    the weight trains from it once unfrozen."""
    from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    m = model()
    m[0].weight.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=m, config={**config(0), "fp16": FP16})
    weight = engine.module[0].weight
    with torch.no_grad():
        weight.fill_(0.5)
    engine.backward(engine(data(0)).float().pow(2).mean())
    engine.step()
    out: dict[str, Any] = {"after_step": (weight.float() - 0.5).abs().max().item()}
    root = str(out_dir / "fp16_edited")
    engine.save_checkpoint(root, tag="t")
    dist.barrier()
    if dist.get_rank() == 0:
        saved = get_fp32_state_dict_from_zero_checkpoint(root, tag="t")["0.weight"]
        out["saved"] = (saved - 0.5).abs().max().item()
    weight.requires_grad_(True)
    engine.backward(engine(data(1)).float().pow(2).mean())
    engine.step()
    # one SGD step from 0.5 moves it a little; from its stale master (its
    # random value at initialize()) it would land far from 0.5
    out["unfrozen_from"] = (weight.float() - 0.5).abs().max().item()
    out["unfrozen_moved"] = out["unfrozen_from"] > 0.0
    return out


def unlisted_case(stage: int) -> dict[str, Any]:
    m = model()
    listed = list(m[0].parameters())
    engine, *_ = deepspeed.initialize(model=m, model_parameters=[{"params": listed}],
                                      config=config(stage))
    head = engine.module[2].weight
    before_head, before_first = full(engine, head), full(engine, engine.module[0].weight)
    grad_none = []
    for s in range(3):
        engine.backward(engine(data(s)).pow(2).mean())
        grad_none.append(head.grad is None)  # right after backward: no full gradient kept
        engine.step()
    return {"unlisted_moved": (full(engine, head) - before_head).abs().max().item(),
            "listed_moved": (full(engine, engine.module[0].weight)
                             - before_first).abs().max().item(),
            "unlisted_grad_none": all(grad_none)}


def empty_group_case(stage: int) -> dict[str, Any]:
    m = model()
    groups = [{"params": list(m[0].parameters())}, {"params": [], "lr": 0.5},
              {"params": list(m[2].parameters()), "lr": 0.05}]
    engine, optimizer, *_ = deepspeed.initialize(model=m, model_parameters=groups,
                                                 config=config(stage))
    engine.backward(engine(data(0)).pow(2).mean())
    engine.step()
    return {"lrs": engine.get_lr(), "groups": len(optimizer.param_groups)}


def offset(engine: Any, by: float = 1.0) -> None:
    """Add ``by`` to every weight (gathered at stage 3), so that a load must
    write them all to make them equal to the saved ones."""
    for param in engine.module.parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0,
                                               enabled=hasattr(param, "ds_id")):
            with torch.no_grad():
                param.add_(by)


def built(stage: int, how: str) -> tuple[Any, torch.nn.Sequential]:
    """An engine in state ``how`` after two steps (none without an optimizer)."""
    m = model()
    if how == "frozen_init":  # frozen throughout, yet passed in model_parameters
        m[0].weight.requires_grad_(False)
    groups: Any = [{"params": list(m[0].parameters())}] if how == "unlisted" else m.parameters()
    optimizer = None if how == "noopt" else "AdamW" if how == "adamw" else "SGD"
    engine, *_ = deepspeed.initialize(model=m, model_parameters=groups,
                                      config=config(stage, optimizer))
    if how == "refreeze":
        engine.module[0].weight.requires_grad_(False)
    for s in range(2 if optimizer else 0):
        engine.backward(engine(data(s)).pow(2).mean())
        engine.step()
    return engine, m


def saved_case(out_dir: Path, stage: int, how: str, into: str = "") -> dict[str, Any]:
    """Save in state ``how``, load into an engine built as ``into`` (default
    alike), compare the full weights; rank 0 consolidates without frozen ones."""
    from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root = str(out_dir / f"saved_{how}_{stage}_{into}")
    engine, _ = built(stage, how)
    engine.save_checkpoint(root, tag="t")
    want = {n: full(engine, p) for n, p in engine.module.named_parameters()}
    dist.barrier()
    kept: list[str] = []
    if dist.get_rank() == 0:
        kept = sorted(get_fp32_state_dict_from_zero_checkpoint(
            root, tag="t", exclude_frozen_parameters=True))
    other, _ = built(stage, into or how)
    offset(other)
    path, _ = other.load_checkpoint(root, tag="t")
    got = {n: full(other, p) for n, p in other.module.named_parameters()}
    return {"loaded": path is not None, "kept": kept,
            "diff": max((got[n] - want[n]).abs().max().item() for n in want)}


def empty_group_scheduler_case() -> str:
    """A client LR scheduler built over a client optimizer with an empty
    param group: refused at initialize(), the group named."""
    m = model()
    client = torch.optim.SGD([{"params": list(m.parameters())}, {"params": [], "lr": 0.5}],
                             lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(client, lambda step: 1.0)
    return refused(lambda: deepspeed.initialize(model=m, optimizer=client,
                                                lr_scheduler=schedule, config=config(0, None)))


def guarded(case: Any, *args: Any) -> dict[str, Any]:
    """A case's facts, or the error it raised (each test then fails alone)."""
    try:
        return case(*args)
    except Exception as error:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(error).__name__}: {error}"}


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank = dist.get_rank()
    result: dict[str, Any] = {
        "rank": rank,
        "noopt": guarded(noopt_case, out_dir),
        "refreeze": {str(stage): guarded(refreeze_case, stage) for stage in (0, 1, 2, 3)},
        "stage0": guarded(stage0_case),
        "fp16_edited": guarded(fp16_edited_case, out_dir),
        "unlisted": {str(stage): guarded(unlisted_case, stage) for stage in (0, 2, 3)},
        "empty_group": {str(stage): guarded(empty_group_case, stage) for stage in (0, 3)},
        "empty_group_scheduler": guarded(empty_group_scheduler_case),
        "saved": {f"{how}{stage}": guarded(saved_case, out_dir, stage, how)
                  for how, stages in (("frozen_init", (0, 1, 2, 3)), ("refreeze", (1, 2, 3)),
                                      ("unlisted", (3,)), ("noopt", (3,)))
                  for stage in stages},
        "adamw_into_noopt": guarded(saved_case, out_dir, 3, "adamw", "noopt"),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
