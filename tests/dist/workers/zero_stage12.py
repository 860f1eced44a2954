"""Runs every ZeRO stage 1/2 case inside one dsrun job and writes what it saw.

Usage: ``dsrun --num_gpus N zero_stage12.py OUT_DIR``. Each rank writes
``OUT_DIR/rank<R>.json``: for every parity case, the per-micro-step losses
of torch DDP and of the ZeRO optimizer, the max abs difference of every
parameter after the last step (and whether all are bitwise equal), the
global gradient norms, and a checksum of the parameters (equal on all ranks);
on 2 ranks also the bytes of model state held per rank for DP, stage 1 and
stage 2. The test (tests/dist/test_zero_stage12.py) judges.

Parity setup: a small MLP with uneven layer sizes, one frozen layer, two
param groups (weights: lr 1e-2, weight decay 1e-2; biases: lr 3e-2), Adam,
fp32, fixed seeds; every rank draws its own data. The reference is DDP with
``no_sync()`` on accumulation micro-steps and ``clip_grad_norm_``. Both
sides step with the same Adam implementation: the one the ZeRO optimizer
picks when the client leaves it open (``fused=True``) - whose CPU kernel
rounds an element differently depending on where it lies in its tensor, so
flat partitions match per-parameter tensors to ~1 ulp per step, not
bitwise - or, for the cases meant to show bitwise parity
(:data:`SINGLE_TENSOR`), torch's single-tensor Adam chosen explicitly by
the client (``foreach=False``, which dsrun keeps).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dsrun.runtime.zero import CommStrategy, ZeroOptimizer, ZeroSettings, model_state_bytes

STEPS = 20
NCCL_LIKE = CommStrategy(reduce="reduce_scatter", owner_reduce="reduce", gather="all_gather")

# name -> (stage, gas, max_norm, settings)
CASES: dict[str, tuple[int, int, float, ZeroSettings]] = {}
for _stage in (1, 2):
    for _gas in (1, 3):
        CASES[f"s{_stage}-gas{_gas}-clip"] = (_stage, _gas, 0.05, ZeroSettings(
            reduce_bucket_size=60, allgather_bucket_size=50, overlap_comm=_stage == 2))
        CASES[f"s{_stage}-gas{_gas}-noclip"] = (_stage, _gas, 0.0, ZeroSettings(
            reduce_bucket_size=60, allgather_bucket_size=50, overlap_comm=_stage == 2))
    CASES[f"s{_stage}-gas3-clip-ncclstrategy"] = (_stage, 3, 0.05, ZeroSettings(
        reduce_bucket_size=60, allgather_bucket_size=50, strategy=NCCL_LIKE))
    CASES[f"s{_stage}-gas1-clip-onebucket"] = (_stage, 1, 0.05, ZeroSettings())
CASES["s2-gas3-clip-nooverlap-noncontiguous"] = (2, 3, 0.05, ZeroSettings(
    reduce_bucket_size=60, overlap_comm=False, contiguous_gradients=False))
CASES["s2-gas1-clip-allreduce"] = (2, 1, 0.05, ZeroSettings(
    reduce_bucket_size=60, reduce_scatter=False, strategy=NCCL_LIKE))
# offload_optimizer: masters, their gradients and Adam's state in host memory
# (on CPU ranks the same memory, but the offload code path: explicit copies)
# the inner optimizer steps 7-element pieces of each master (views)
for _stage in (1, 2):
    CASES[f"s{_stage}-gas1-noclip-subgroups"] = (_stage, 1, 0.0, ZeroSettings(
        reduce_bucket_size=60, allgather_bucket_size=50, sub_group_size=7))
for _stage in (1, 2):
    CASES[f"s{_stage}-gas3-clip-offload"] = (_stage, 3, 0.05, ZeroSettings(
        reduce_bucket_size=60, allgather_bucket_size=50, overlap_comm=True,
        offload_optimizer=True, pin_memory=True))


# cases whose client asks for single-tensor Adam (bitwise parity on 2 ranks)
SINGLE_TENSOR = {"s1-gas1-noclip", "s1-gas3-noclip", "s2-gas1-noclip",
                 "s1-gas1-noclip-subgroups", "s2-gas1-noclip-subgroups"}


def build_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.Tanh(),  # frozen
        torch.nn.Linear(7, 13), torch.nn.Tanh(),
        torch.nn.Linear(13, 11), torch.nn.Tanh(),
        torch.nn.Linear(11, 3))
    model[0].requires_grad_(False)
    return model


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    weights = [m.weight for m in model if isinstance(m, torch.nn.Linear)]
    biases = [m.bias for m in model if isinstance(m, torch.nn.Linear)]
    return [{"params": weights, "weight_decay": 1e-2},
            {"params": biases, "lr": 3e-2}]


def batches(rank: int, step: int, gas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10_000 * rank + step)
    return [(torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g))
            for _ in range(gas)]


def run_case(stage: int, gas: int, max_norm: float, settings: ZeroSettings,
             single_tensor: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    ref_model, zero_model = build_model(), build_model()
    ddp = DDP(ref_model)
    ref_kind = {"foreach": False} if single_tensor else {"fused": True}
    ref_opt = torch.optim.Adam(param_groups(ref_model), lr=1e-2, **ref_kind)
    client = torch.optim.Adam(param_groups(zero_model), lr=1e-2,
                              **({"foreach": False} if single_tensor else {}))
    zero = ZeroOptimizer.from_optimizer(client, stage=stage, settings=settings)
    assert zero.inner_impl == ("single-tensor" if single_tensor else "fused")
    losses: dict[str, list[float]] = {"ddp": [], "zero": []}
    norms: dict[str, list[float]] = {"ddp": [], "zero": []}
    trainable = [p for p in ref_model.parameters() if p.requires_grad]
    for step in range(STEPS):
        for micro, (x, y) in enumerate(batches(rank, step, gas)):
            boundary = micro == gas - 1
            with (ddp.no_sync() if not boundary else _null()):
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                (loss / gas).backward()
            losses["ddp"].append(loss.item())
            loss = torch.nn.functional.mse_loss(zero_model(x), y)
            (loss / gas).backward()
            zero.micro_step_done()
            losses["zero"].append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(trainable, max_norm if max_norm > 0 else 1e30)
        norms["ddp"].append(norm.item())
        ref_opt.step()
        ref_opt.zero_grad()
        zero.reduce_gradients()
        norms["zero"].append(zero.clip_grad_norm(max_norm).item())
        zero.step()
        zero.zero_grad()
    pairs = list(zip(ref_model.parameters(), zero_model.parameters()))
    zero.close()
    return {
        "losses": losses, "norms": norms,
        "max_param_diff": max((a - b).abs().max().item() for a, b in pairs),
        "bitwise": all(torch.equal(a, b) for a, b in pairs),
        "frozen_unchanged": torch.equal(zero_model[0].weight, build_model()[0].weight),
        "checksum": float(sum(p.detach().double().sum() for p in zero_model.parameters())),
    }


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def memory_case() -> dict[str, Any]:
    """Bytes of model state per rank after a step and the next backward."""
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    for name, stage in (("dp", 0), ("stage1", 1), ("stage2", 2)):
        model = torch.nn.Linear(1000, 1000)
        psi = sum(p.numel() for p in model.parameters())
        x = torch.randn(4, 1000)
        if stage == 0:
            wrapped = DDP(model, gradient_as_bucket_view=True)
            opt: Any = torch.optim.Adam(model.parameters(), lr=1e-3)
        else:
            wrapped = model
            # The 1M-element weight is over the cap: reduced in its own gradient.
            opt = ZeroOptimizer(model.parameters(), torch.optim.Adam, {"lr": 1e-3},
                                stage=stage, settings=ZeroSettings(reduce_bucket_size=10_000))
        for _ in range(2):
            opt.zero_grad()
            wrapped(x).square().mean().backward()
            if stage:
                opt.micro_step_done()
            counted = (model_state_bytes(model.parameters(), opt) if stage == 0
                       else opt.state_bytes())
            opt.step()
        out[name] = {"psi": psi, "params": counted.params, "grads": counted.grads,
                     "optimizer": counted.optimizer, "buffers": counted.buffers,
                     "model_state": counted.model_state}
        if stage:
            opt.close()
    return out


def overflow_case(stage: int) -> dict[str, Any]:
    """An inf in one gradient element on the last rank only, in a partition
    element that rank 0 owns: every rank must report the overflow."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    zero = ZeroOptimizer(param_groups(model), torch.optim.Adam, {"lr": 1e-2}, stage=stage)
    x, y = batches(rank, 0, 1)[0]
    seen = []
    for inject in (False, True):
        first = model[2].weight  # flat offset 0 of group 0: owned by rank 0
        handle = None
        if inject and rank == world - 1:
            handle = first.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), math.inf))
        torch.nn.functional.mse_loss(model(x), y).backward()
        zero.micro_step_done()
        zero.reduce_gradients()
        own_inf = not bool(torch.isfinite(zero.masters[0].grad).all())
        seen.append({"overflow": zero.has_overflow(), "own_partition_has_inf": own_inf})
        zero.zero_grad()
        if handle is not None:
            handle.remove()
    zero.close()
    return {"clean": seen[0], "injected": seen[1]}


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, Any] = {"world": world, "cases": {}}
    for name, (stage, gas, max_norm, settings) in CASES.items():
        results["cases"][name] = run_case(stage, gas, max_norm, settings,
                                          name in SINGLE_TENSOR)
    results["overflow"] = {f"s{stage}": overflow_case(stage) for stage in (1, 2)}
    if world == 2:
        results["memory"] = memory_case()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
