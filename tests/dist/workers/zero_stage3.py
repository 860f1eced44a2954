"""Runs every ZeRO stage 3 case inside one dsrun job and writes what it saw.

Usage: ``dsrun --num_gpus 3 zero_stage3.py OUT_DIR``. Parity cases run on
all 3 ranks and on a 2-rank subgroup (ranks 0 and 1; rank 2 waits); the
zero.Init, GatheredParameters, memory and divergence cases run on the
subgroup. Each rank writes ``OUT_DIR/rank<R>.json``; the test
(tests/dist/test_zero_stage3.py) judges.

Parity setup (as the stage 1/2 suite): a small MLP with uneven layer sizes,
one frozen layer, two param groups (weights: lr 1e-2, weight decay 1e-2;
biases: lr 3e-2), Adam, fp32, fixed seeds, every rank its own data. The
reference is torch DDP with ``no_sync()`` on accumulation micro-steps and
``clip_grad_norm_``, stepping with the same Adam implementation as the
stage-3 optimizer: fused (dsrun's choice when the client leaves it open),
or single-tensor for the cases meant to show bitwise parity
(:data:`SINGLE_TENSOR`: the client asks for ``foreach=False``).
"""

from __future__ import annotations

import collections
import json
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dsrun import zero
from dsrun.errors import DsrunError
from dsrun.runtime.zero import CommStrategy, GuardSettings, Stage3Settings, ZeroStage3
from dsrun.runtime.zero.partitioned import full_numel_held

STEPS = 20
NCCL_LIKE = CommStrategy(reduce="reduce_scatter", owner_reduce="reduce", gather="all_gather")
SMALL = dict(param_persistence_threshold=0, prefetch_bucket_size=200, reduce_bucket_size=60)


@dataclass(frozen=True)
class Case:
    gas: int
    max_norm: float
    settings: Stage3Settings
    init: bool = False
    init_threshold: Optional[int] = 0  # None: zero.Init's default (keeps this model whole)


# cases whose client asks for single-tensor Adam (bitwise parity on 2 ranks)
SINGLE_TENSOR = {"gas1-noclip", "gas1-noclip-subgroups"}
CASES = {
    "gas1-noclip": Case(1, 0.0, Stage3Settings(**SMALL)),
    "gas1-clip": Case(1, 0.05, Stage3Settings(**SMALL)),
    "gas3-noclip": Case(3, 0.0, Stage3Settings(**SMALL)),
    "gas3-clip": Case(3, 0.05, Stage3Settings(**SMALL)),
    # biases (<= 20 elements) whole on every rank; DeepSpeed's default buckets
    "gas3-clip-persist": Case(3, 0.05, Stage3Settings(param_persistence_threshold=20)),
    "gas3-clip-livecap-nccl": Case(3, 0.05, Stage3Settings(
        param_persistence_threshold=0, prefetch_bucket_size=1000, max_live_parameters=100,
        reduce_bucket_size=60, overlap_comm=False, strategy=NCCL_LIKE)),
    "gas1-clip-init": Case(1, 0.05, Stage3Settings(**SMALL), init=True),
    # zero.Init keeps every parameter whole (default threshold 1e5); stage 3 releases them
    "gas1-clip-init-repartition": Case(1, 0.05, Stage3Settings(**SMALL), init=True,
                                       init_threshold=None),
    "gas3-clip-debugguard": Case(3, 0.05, Stage3Settings(
        **SMALL, guard=GuardSettings(mode="debug", timeout_s=60))),
    # stage3_max_reuse_distance above the model: every parameter kept from
    # the end of each micro-step's forward to its backward
    "gas3-clip-reuse": Case(3, 0.05, Stage3Settings(**SMALL, max_reuse_distance=10**6)),
    # the inner optimizer steps 7-element pieces of each master (views)
    "gas1-noclip-subgroups": Case(1, 0.0, Stage3Settings(**SMALL, sub_group_size=7)),
    # masters, optimizer state and parameter shards in host memory
    "gas3-clip-offload": Case(3, 0.05, Stage3Settings(
        **SMALL, offload_optimizer=True, offload_param=True, pin_memory=True)),
    "gas1-clip-init-offload": Case(1, 0.05, Stage3Settings(
        **SMALL, offload_optimizer=True, offload_param=True), init=True),
}


def build_model(seed: int = 1234) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.Tanh(),  # frozen
        torch.nn.Linear(7, 13), torch.nn.Tanh(),
        torch.nn.Linear(13, 11), torch.nn.Tanh(),
        torch.nn.Linear(11, 3))
    model[0].requires_grad_(False)
    return model


def build_under_init(group: Any, threshold: Optional[int]) -> torch.nn.Module:
    """Each rank seeds differently: equality with the reference proves that
    rank 0's values were broadcast."""
    zero_config: dict[str, Any] = {"stage": 3}
    if threshold is not None:
        zero_config["stage3_param_persistence_threshold"] = threshold
    with zero.Init(data_parallel_group=group, config_dict_or_path={
            "zero_optimization": zero_config}):
        return build_model(seed=1234 + dist.get_rank())


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    weights = [m.weight for m in model if isinstance(m, torch.nn.Linear)]
    biases = [m.bias for m in model if isinstance(m, torch.nn.Linear)]
    return [{"params": weights, "weight_decay": 1e-2}, {"params": biases, "lr": 3e-2}]


def batches(rank: int, step: int, gas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10_000 * rank + step)
    return [(torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g))
            for _ in range(gas)]


def train(ddp: Any, ref_opt: Any, trainable: list, model: torch.nn.Module,
          stage3: ZeroStage3, case: Case, rank: int) -> dict[str, Any]:
    seen: dict[str, Any] = {"losses": {"ddp": [], "zero": []}, "norms": {"ddp": [], "zero": []},
                            "held_after_step": []}
    for step in range(STEPS):
        for micro, (x, y) in enumerate(batches(rank, step, case.gas)):
            with ddp.no_sync() if micro < case.gas - 1 else nullcontext():
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                (loss / case.gas).backward()
            seen["losses"]["ddp"].append(loss.item())
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / case.gas).backward()
            stage3.micro_step_done()
            seen["losses"]["zero"].append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(trainable, case.max_norm or 1e30)
        seen["norms"]["ddp"].append(norm.item())
        ref_opt.step()
        ref_opt.zero_grad()
        stage3.reduce_gradients()
        seen["norms"]["zero"].append(stage3.clip_grad_norm(case.max_norm).item())
        stage3.step()
        stage3.zero_grad()
        seen["held_after_step"].append(full_numel_held(model.parameters()))
    return seen


def run_case(case: Case, group: Any, single_tensor: bool) -> dict[str, Any]:
    rank = dist.get_rank(group)
    ref = build_model()
    ddp = DDP(ref, process_group=group)
    ref_kind = {"foreach": False} if single_tensor else {"fused": True}
    ref_opt = torch.optim.Adam(param_groups(ref), lr=1e-2, **ref_kind)
    model = build_under_init(group, case.init_threshold) if case.init else build_model()
    held_after_init = full_numel_held(model.parameters())
    client = torch.optim.Adam(param_groups(model), lr=1e-2,
                              **({"foreach": False} if single_tensor else {}))
    stage3 = ZeroStage3.from_optimizer(model, client, group=group, settings=case.settings)
    held_after_wrap = full_numel_held(model.parameters())
    counts_before = collections.Counter(stage3.guard.counts)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    seen = train(ddp, ref_opt, trainable, model, stage3, case, rank)
    counts = collections.Counter(stage3.guard.counts)
    counts.subtract(counts_before)
    peak = stage3.fetcher.live.peak
    with zero.GatheredParameters(list(model.parameters())):
        pairs = list(zip(ref.parameters(), model.parameters()))
        result = {
            "max_param_diff": max((a - b).abs().max().item() for a, b in pairs),
            "bitwise": all(torch.equal(a, b) for a, b in pairs),
            "frozen_unchanged": torch.equal(model[0].weight, build_model()[0].weight),
            "checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
        }
    stage3.close()
    module_numels = [sum(p.numel() for p in m.parameters()) for m in model
                     if isinstance(m, torch.nn.Linear)]
    return {**seen, **result, "held_after_init": held_after_init,
            "held_after_wrap": held_after_wrap, "events": dict(counts), "peak_live": peak,
            "max_live": case.settings.max_live_parameters, "module_numels": module_numels}


# ---------------------------------------------------------------- zero.Init


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)


class Net(torch.nn.Module):
    """Records the full elements held by the blocks built so far after each
    block: zero under Init (each block is partitioned as it finishes)."""

    def __init__(self, width: int, depth: int, probe: list[int]) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList()
        for _ in range(depth):
            self.blocks.append(Block(width))
            probe.append(sum(p.data.numel() for p in self.parameters()))
        self.head = torch.nn.Linear(width, 1)
        self.apply(self._init_weights)  # as HF models do: children are partitioned by now

    @staticmethod
    def _init_weights(module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
            torch.nn.init.zeros_(module.bias)


def init_case(group: Any) -> dict[str, Any]:
    rank = dist.get_rank(group)
    probe: list[int] = []
    with zero.Init(data_parallel_group=group, config_dict_or_path={
            "zero_optimization": {"stage3_param_persistence_threshold": 0}}):
        torch.manual_seed(7 + rank)
        net = Net(16, 4, probe)

        class DefinedInside(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = torch.nn.Parameter(torch.randn(9, 4))

        inside = DefinedInside()
    torch.manual_seed(7)
    ref = Net(16, 4, [])
    applied = bool((ref.head.bias == 0).all()) and float(ref.head.weight.std()) < 0.1
    after_exit = torch.nn.Linear(3, 3)
    weight = net.blocks[0].fc1.weight
    with zero.GatheredParameters(list(net.parameters())):
        equal = all(torch.equal(a, b) for a, b in zip(ref.parameters(), net.parameters()))
    return {
        "probe": probe, "equal_to_rank0_model": equal and applied,
        "held_after_init": full_numel_held(net.parameters()),
        "shard_numel": sum(p.ds_tensor.numel() for p in net.parameters()),
        "model_numel": sum(p.ds_numel for p in net.parameters()),
        "ds_shape": list(weight.ds_shape), "shape": list(weight.shape),
        "size": list(weight.size()), "numel": weight.numel(), "repr": repr(weight),
        "data_numel": weight.data.numel(),
        "inside_class_partitioned": hasattr(inside.inner, "ds_id")
        and inside.inner.data.numel() == 0,
        "after_exit_untouched": not hasattr(after_exit.weight, "ds_id"),
    }


# --------------------------------------------------------- GatheredParameters


def gathered_case(group: Any) -> dict[str, Any]:
    rank = dist.get_rank(group)
    model = build_model()
    stage3 = ZeroStage3(model, param_groups(model), torch.optim.Adam, {"lr": 1e-2},
                        group=group, settings=Stage3Settings(param_persistence_threshold=0))
    ref = build_model()
    with zero.GatheredParameters(model.parameters()):
        read_equal = all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
        held_inside = full_numel_held(model.parameters())
    held_after_read = full_numel_held(model.parameters())
    weight = model[2].weight
    with zero.GatheredParameters(weight, modifier_rank=0):
        with torch.no_grad():
            weight.fill_(1.0 + rank)  # rank 0 writes 1.0; the others' values are dropped
    held_after_modify = full_numel_held(model.parameters())
    with zero.GatheredParameters([weight]):
        sees_rank0 = bool((weight == 1.0).all())
    master = stage3.master_shard(weight)[:weight.ds_spec.valid(rank)]
    full = stage3.module_state_dict()
    with torch.no_grad():
        ref[2].weight.fill_(1.0)
    state_dict_equal = all(torch.equal(full[k], v) for k, v in ref.state_dict().items())
    stage3.close()
    return {"read_equal": read_equal, "held_inside": held_inside,
            "model_numel": sum(p.numel() for p in model.parameters()),
            "held_after_read": held_after_read, "held_after_modify": held_after_modify,
            "sees_rank0": sees_rank0, "master_updated": bool((master == 1.0).all()),
            "module_state_dict_equal": state_dict_equal,
            "held_after_state_dict": full_numel_held(model.parameters())}


# ------------------------------------------------------- external parameters


class Tied(torch.nn.Module):
    """The output layer reuses the input layer's weight in the root's own
    forward: an external parameter of the root."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.embed = torch.nn.Linear(6, 8)
        self.mid = torch.nn.Linear(8, 8)
        zero.register_external_parameter(self, self.embed.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.embed(x))))
        return torch.nn.functional.linear(h, self.embed.weight.t())


def tied_case(group: Any) -> dict[str, Any]:
    """Parity with DDP for a tied weight, with an eval forward (no_grad)
    before every training step."""
    rank = dist.get_rank(group)
    ref, model = Tied(), Tied()
    ddp = DDP(ref, process_group=group)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, fused=True)
    stage3 = ZeroStage3(model, None, torch.optim.Adam, {"lr": 1e-2}, group=group,
                        settings=Stage3Settings(**SMALL))
    eval_equal = True
    for step in range(10):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * rank + step))
        with torch.no_grad():
            eval_equal &= torch.equal(ref(x), model(x))
        ddp(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(x).square().mean().backward()
        stage3.micro_step_done()
        stage3.step()
        stage3.zero_grad()
    held = full_numel_held(model.parameters())
    with zero.GatheredParameters(list(model.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(),
                                                               model.parameters()))
    stage3.close()
    return {"max_param_diff": diff, "eval_equal": bool(eval_equal), "held_after": held}


# ------------------------------------------------------------------- memory


def pinned_bytes(group: Any, efficient: bool) -> int:
    """Bytes of gathered parameter storage that autograd keeps from forward
    to backward (saved tensors that are not the parameters themselves)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    stage3 = ZeroStage3(model, None, torch.optim.SGD, {"lr": 0.1}, group=group,
                        settings=Stage3Settings(param_persistence_threshold=0,
                                                memory_efficient_linear=efficient))
    gathered: list[torch.Tensor] = []  # held here so that no address is reused
    saved: list[torch.Tensor] = []

    def record(module: torch.nn.Module, args: Any) -> None:  # runs after stage 3's gather
        gathered.extend(p.data for p in module.parameters(recurse=False))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    for m in model:
        m.register_forward_pre_hook(record)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(torch.randn(8, 64)).sum()
    ptrs = {t.untyped_storage().data_ptr() for t in gathered}
    pinned = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
              if not isinstance(t, torch.nn.Parameter) and t.untyped_storage().data_ptr() in ptrs}
    loss.backward()
    stage3.micro_step_done()
    stage3.close()
    return sum(pinned.values())


def memory_case(group: Any) -> dict[str, Any]:
    """Bytes of model state per rank after a backward (gradients present)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1000, 1000)
    psi = sum(p.numel() for p in model.parameters())
    stage3 = ZeroStage3(model, None, torch.optim.Adam, {"lr": 1e-3}, group=group,
                        settings=Stage3Settings(param_persistence_threshold=0,
                                                reduce_bucket_size=100_000))
    x = torch.randn(4, 1000)
    for _ in range(2):
        stage3.zero_grad()
        model(x).square().mean().backward()
        stage3.micro_step_done()
        counted = stage3.state_bytes()
        stage3.step()
    held = full_numel_held(model.parameters())
    stage3.close()
    return {"psi": psi, "params": counted.params, "grads": counted.grads,
            "optimizer": counted.optimizer, "buffers": counted.buffers,
            "model_state": counted.model_state, "held_after_step": held}


# --------------------------------------------------------------- divergence


class Branchy(torch.nn.Module):
    """Two branches of the same size: mixing them up would go unnoticed by
    gloo (equal message sizes) without the guard."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.trunk = torch.nn.Linear(4, 8)
        self.branch_a = torch.nn.Linear(8, 8)
        self.branch_b = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, branch: str) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        h = (self.branch_a if branch == "a" else self.branch_b)(h)
        return self.head(torch.tanh(h))


def _branchy(group: Any, guard: GuardSettings, prefetch: int) -> tuple[Branchy, ZeroStage3]:
    model = Branchy()
    stage3 = ZeroStage3(model, None, torch.optim.SGD, {"lr": 0.1}, group=group,
                        settings=Stage3Settings(param_persistence_threshold=0,
                                                prefetch_bucket_size=prefetch, guard=guard))
    return model, stage3


def _step(model: Branchy, stage3: ZeroStage3, branch: str) -> None:
    model(torch.ones(2, 4), branch).sum().backward()
    stage3.micro_step_done()
    stage3.step()
    stage3.zero_grad()


def divergence_case(group: Any, mode: str, prefetch: int) -> dict[str, Any]:
    """Two agreeing steps (traces recorded), then rank 0 takes branch a and
    rank 1 branch b: both must raise at the first differing collective."""
    rank = dist.get_rank(group)
    model, stage3 = _branchy(group, GuardSettings(mode=mode, timeout_s=30), prefetch)
    for _ in range(2):
        _step(model, stage3, "a")
    start, error = time.monotonic(), None
    try:
        _step(model, stage3, "a" if rank == 0 else "b")
    except DsrunError as exc:
        error = str(exc)
    elapsed = time.monotonic() - start
    dist.barrier(group=group)
    stage3.close()
    return {"error": error, "elapsed": elapsed}


def timeout_case(group: Any) -> dict[str, Any]:
    """Rank 1 stops issuing stage-3 collectives (it waits in a barrier of
    its own); rank 0's next one times out and names where rank 1 is. Then
    both go on training: the guard recovers with a new side group."""
    rank = dist.get_rank(group)
    model, stage3 = _branchy(group, GuardSettings(mode="check", timeout_s=2.0), 100)
    for _ in range(2):
        _step(model, stage3, "a")
    start, error = time.monotonic(), None
    if rank == 0:
        try:
            _step(model, stage3, "a")
        except DsrunError as exc:
            error = str(exc)
    elapsed = time.monotonic() - start
    dist.barrier(group=group)
    recovered: Optional[float] = None
    model2, stage3b = _branchy(group, GuardSettings(mode="check", timeout_s=30.0), 100)
    for _ in range(2):
        _step(model2, stage3b, "a")
    with zero.GatheredParameters(list(model2.parameters())):
        recovered = float(sum(p.detach().double().sum() for p in model2.parameters()))
    stage3b.close()
    stage3.close()
    return {"error": error, "elapsed": elapsed, "recovered_checksum": recovered}


# ---------------------------------------------------------------------- main


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([0, 1])
    results: dict[str, Any] = {"world": world, "rank": rank}
    results["world3"] = {name: run_case(case, None, name in SINGLE_TENSOR)
                         for name, case in CASES.items()}
    if rank < 2:
        results["world2"] = {name: run_case(case, pair, name in SINGLE_TENSOR)
                             for name, case in CASES.items()}
        results["init"] = init_case(pair)
        results["gathered"] = gathered_case(pair)
        results["tied"] = tied_case(pair)
        results["memory"] = memory_case(pair)
        results["pinned"] = {"efficient": pinned_bytes(pair, True),
                             "plain": pinned_bytes(pair, False)}
        results["divergence"] = {
            "check-noprefetch": divergence_case(pair, "check", 0),
            "debug-prefetch": divergence_case(pair, "debug", 100),
        }
        results["timeout"] = timeout_case(pair)
    dist.barrier()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
