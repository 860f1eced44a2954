"""Engine test cases, all run inside ONE job (dsrun --num_gpus 2, or plain python).

Importing torch costs seconds per process here, so the ranks start once and
run every case in CASES against the same process group; each rank writes
``<out>/rank<R>.json``: {case: {"ok": bool, "error": traceback, ...facts}}.
The pytest module tests/dist/test_engine_dist.py asserts on the facts.

Usage: engine_cases.py --out DIR [--only CASE,...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import dsrun
from dsrun.errors import DsrunError
from dsrun.runtime.lr_schedules import WarmupDecayLR

MICRO = 4
FEATURES, CLASSES = 16, 4


def rank_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, CLASSES))


def batch(step: int, micro: int, dtype: torch.dtype = torch.float32
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch: a fixed function of (step, micro, rank), learnable."""
    rank, _ = rank_world()
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    y = torch.randint(0, CLASSES, (MICRO,), generator=gen)
    x = torch.randn(MICRO, FEATURES, generator=gen) * 0.5
    x[torch.arange(MICRO), y] += 2.0  # the class is visible in the features
    return x.to(dtype), y


def params_of(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def ranks_agree(tensors: list[torch.Tensor]) -> bool:
    """Every rank holds rank 0's values, bitwise."""
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    mine = flat.clone()
    dist.broadcast(flat, src=0)
    same = torch.tensor([float(torch.equal(flat, mine))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


ADAM = {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8,
                                   "weight_decay": 0.01}}


def parity(gas: int, clip: float, schedule: bool, bucket_elements: int | None,
           steps: int = 20, stage: int = 0, client: bool = False,
           zero_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The engine against DDP + AdamW, same init, data, clipping and schedule.

    ``client``: the script builds the optimizer itself (two param groups,
    the second with half the LR) and passes it to initialize(), as Hugging
    Face's Trainer does; the reference uses the same groups."""
    rank, world = rank_world()
    config: dict[str, Any] = {
        "train_batch_size": MICRO * gas * world, "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas, "optimizer": ADAM, "gradient_clipping": clip,
        "steps_per_print": 1000}
    sched = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5,
             "total_num_steps": steps}
    if schedule:
        config["scheduler"] = {"type": "WarmupDecayLR", "params": sched}
    if bucket_elements or stage:
        config["zero_optimization"] = {"stage": stage}
        if bucket_elements:
            config["zero_optimization"]["reduce_bucket_size"] = bucket_elements
        config["zero_optimization"].update(zero_extra or {})
    # a different init on every rank: the engine must broadcast rank 0's
    model = make_model(100 + rank)
    client_opt = None
    if client:
        del config["optimizer"]
        client_opt = torch.optim.AdamW(_two_groups(model), lr=1e-2, betas=(0.9, 0.99),
                                       eps=1e-8, weight_decay=0.01)
    engine, _, _, _ = dsrun.initialize(model=model, config=config, optimizer=client_opt)
    initial_agree = ranks_agree(full_params(engine.module))
    ddp = DistributedDataParallel(make_model(100))  # rank 0's init everywhere
    ref_params = _two_groups(ddp.module) if client else ddp.parameters()
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                                weight_decay=0.01)
    ref_sched = WarmupDecayLR(ref_opt, **sched) if schedule else None
    losses, ref_losses, lrs, ref_lrs, clipped = [], [], [], [], 0
    for step in range(steps):
        for micro in range(gas):
            x, y = batch(step, micro)
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            sync = contextlib.nullcontext() if micro == gas - 1 else ddp.no_sync()
            with sync:
                ref_loss = F.cross_entropy(ddp(x), y)
                (ref_loss / gas if gas > 1 else ref_loss).backward()
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
            clipped += int(norm.item() > clip)
        ref_opt.step()
        if ref_sched is not None:
            ref_sched.step()
        ref_opt.zero_grad(set_to_none=True)
        lrs.append(engine.get_lr()[0])
        ref_lrs.append(ref_opt.param_groups[0]["lr"])
    mine, ref = full_params(engine.module), params_of(ddp.module)
    return {
        "initial_agree": initial_agree, "losses": losses, "ref_losses": ref_losses,
        "lrs": lrs, "ref_lrs": ref_lrs, "clipped_steps": clipped,
        "params_equal": all(torch.equal(a, b) for a, b in zip(mine, ref)),
        "max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(mine, ref)),
        "ranks_agree": ranks_agree(mine), "global_steps": engine.global_steps,
        "global_samples": engine.global_samples, "buckets": _buckets(engine),
    }


def train(engine: Any, steps: int, after_step: Callable[[], Any] = lambda: None
          ) -> list[float]:
    """``steps`` steps of one micro-batch each; the losses. ``after_step``
    runs after every step."""
    losses = []
    for step in range(steps):
        x, y = batch(step, 0)
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        after_step()
    return losses


def full_params(module: torch.nn.Module) -> list[torch.Tensor]:
    """Parameter values, gathered first if ZeRO stage 3 partitioned them."""
    params = list(module.parameters())
    if not any(hasattr(p, "ds_shape") for p in params):
        return params_of(module)
    import dsrun.zero

    with dsrun.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def zero3_init(steps: int = 8) -> dict[str, Any]:
    """A model built under dsrun.zero.Init and trained at stage 3 through
    initialize(): no rank ever holds a full (non-persistent) parameter
    outside forward/backward, and the loss goes down."""
    import dsrun.zero

    rank, world = rank_world()
    config = {"train_batch_size": MICRO * world, "train_micro_batch_size_per_gpu": MICRO,
              "optimizer": ADAM, "steps_per_print": 1000,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 16}}
    with dsrun.zero.Init(config_dict_or_path=config):  # the persistence threshold
        model = make_model(300 + rank)
    big = [p for p in model.parameters() if p.ds_numel > 16]
    held_after_init = max(p.data.numel() for p in big)
    engine, _, _, _ = dsrun.initialize(model=model, config=config)
    held: list[int] = []
    losses = train(engine, steps, lambda: held.append(max(p.data.numel() for p in big)))
    logical = [tuple(p.ds_shape) for p in big]
    return {"held_after_init": held_after_init, "held": held,
            "shard_max": max(-(-p.ds_numel // world) for p in big), "losses": losses,
            "logical_shapes": logical, "shapes": [tuple(p.shape) for p in big],
            "ranks_agree": ranks_agree(full_params(engine.module))}


def _two_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    params = list(model.parameters())
    return [{"params": params[:2]}, {"params": params[2:], "lr": 5e-3}]


def _buckets(engine: Any) -> int:
    sync = engine._grad_sync
    return 0 if sync is None else len(sync.buckets)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def fp16_overflow(steps: int = 14, inject: tuple[int, ...] = (3, 7, 8)) -> dict[str, Any]:
    """Rank 0 puts an inf into one gradient on chosen steps; every rank must skip them."""
    rank, world = rank_world()
    config = {"train_batch_size": MICRO * world, "steps_per_print": 1000,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "fp16": {"enabled": True, "initial_scale_power": 12, "hysteresis": 1}}
    engine, _, _, _ = dsrun.initialize(model=make_model(7), config=config)
    target = engine.module[2].weight
    now = {"inject": False}
    target.register_hook(lambda g: g * float("inf") if now["inject"] and rank == 0 else g)
    handler = _Lines()
    logging.getLogger("dsrun.runtime").addHandler(handler)
    facts: dict[str, list[Any]] = {"skipped": [], "scale": [], "unchanged": [], "loss": []}
    try:
        for step in range(steps):
            now["inject"] = step in inject
            before = params_of(engine.module)
            x, y = batch(step, 0, torch.float16)
            loss = F.cross_entropy(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
            facts["skipped"].append(not engine.was_step_applied())
            facts["scale"].append(engine.precision.loss_scale)
            facts["unchanged"].append(all(torch.equal(a, b) for a, b in
                                          zip(before, engine.module.parameters())))
            facts["loss"].append(loss.item())
    finally:
        logging.getLogger("dsrun.runtime").removeHandler(handler)
    return {**facts, "skipped_steps": engine.skipped_steps, "global_steps": engine.global_steps,
            "dtype": str(next(engine.module.parameters()).dtype),
            "overflow_lines": [ln for ln in handler.lines if "overflow" in ln],
            "ranks_agree": ranks_agree(params_of(engine.module))}


def bf16_autocast(steps: int = 15) -> dict[str, Any]:
    rank, world = rank_world()
    config = {"train_batch_size": MICRO * world, "steps_per_print": 1000, "optimizer": ADAM,
              "bf16": {"enabled": True}}
    engine, _, _, _ = dsrun.initialize(model=make_model(3), config=config)
    losses, out_dtype = [], None
    for step in range(steps):
        x, y = batch(step % 3, 0)
        out = engine(x)
        out_dtype = str(out.dtype)
        loss = F.cross_entropy(out.float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "out_dtype": out_dtype,
            "param_dtype": str(next(engine.module.parameters()).dtype),
            "ranks_agree": ranks_agree(params_of(engine.module))}


class WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = make_model(5)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def unused_and_no_sync() -> dict[str, Any]:
    """A parameter that gets no gradient must not hang the all-reduce; no_sync()
    micro-steps accumulate locally and the next synced backward averages all."""
    rank, world = rank_world()
    model = WithUnused()
    config = {"train_batch_size": MICRO * world, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = dsrun.initialize(model=model, config=config)
    unused_before = params_of(engine.module.unused)
    x, y = batch(0, 0)
    with engine.no_sync():
        engine.backward(F.cross_entropy(engine(x), y))
    local = [p.grad.clone() for p in engine.module.body[0].parameters()]
    engine.backward(F.cross_entropy(engine(x), y))
    synced = [p.grad.clone() for p in engine.module.body[0].parameters()]
    unused_grad_zero = all(p.grad is not None and not p.grad.any()
                           for p in engine.module.unused.parameters())
    engine.step()
    # synced = mean over ranks of 2 x this rank's gradient
    expect = [g * 2 for g in local]
    for g in expect:
        dist.all_reduce(g)
        g /= world
    return {"unused_grad_zero": unused_grad_zero,
            "averaged": all(torch.allclose(a, b, atol=1e-6) for a, b in zip(synced, expect)),
            "unused_unchanged": all(torch.equal(a, b) for a, b in
                                    zip(unused_before, engine.module.unused.parameters()))}


class Branchy(torch.nn.Module):
    """A branch ``a`` that some micro-batches use and others do not."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model(6)
        self.a = torch.nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor, use_a: bool) -> torch.Tensor:
        out = self.body(x)
        return out + self.a(x) if use_a else out


def branch_in_earlier_micro_steps(stage: int) -> dict[str, Any]:
    """A parameter with a gradient from an earlier micro-step (accumulation,
    or a no_sync() backward) but none in the synchronising one keeps it: the
    reduction averages it like every other gradient."""
    _, world = rank_world()
    grads: dict[str, list[torch.Tensor]] = {}
    for how in ("accumulation", "no_sync") if stage == 0 else ("accumulation",):
        gas = 2 if how == "accumulation" else 1
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
                  "steps_per_print": 1000, "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0}
        engine, _, _, _ = dsrun.initialize(model=Branchy(), config=config)
        ref = Branchy()
        ref.load_state_dict(engine.module.state_dict())
        before = [p.detach().clone() for p in ref.a.parameters()]
        for micro, use_a in enumerate((True, False)):
            x, y = batch(0, micro)
            context = engine.no_sync() if how == "no_sync" and use_a else contextlib.nullcontext()
            with context:
                engine.backward(F.cross_entropy(engine(x, use_a), y))
            (F.cross_entropy(ref(x, use_a), y) / gas).backward()
            if how == "accumulation":
                engine.step()  # a boundary after the second micro-step only
        if how == "no_sync":
            engine.step()
        assert engine.global_steps == 1
        expect = [p.grad.clone() for p in ref.a.parameters()]
        for g in expect:
            dist.all_reduce(g)
            g /= world
        # SGD, lr 0.1: the update is -0.1 x the averaged gradient
        grads[how] = [(b - p.detach()) / 0.1 - e
                      for b, p, e in zip(before, engine.module.a.parameters(), expect)]
    fact: dict[str, Any] = {how: max(float(d.abs().max()) for d in diffs)
                            for how, diffs in grads.items()}
    if stage > 0:  # ZeRO stage 2 reduces during every backward: no_sync() is refused
        try:
            with engine.no_sync():
                pass
            fact["no_sync_refused"] = False
        except DsrunError as err:
            fact["no_sync_refused"] = "not possible at ZeRO stage 2" in str(err)
    return fact


def dataloader(n: int = 40) -> dict[str, Any]:
    rank, world = rank_world()
    data = torch.utils.data.TensorDataset(torch.arange(n).float().unsqueeze(1), torch.arange(n))
    config = {"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, loader, _ = dsrun.initialize(model=torch.nn.Linear(1, 1), config=config,
                                            training_data=data)
    mine = [int(i) for _, idx in loader for i in idx]
    every = [None] * world
    dist.all_gather_object(every, mine)
    return {"sizes": [len(idx) for _, idx in loader], "train_batch": engine.train_batch_size(),
            "disjoint_cover": sorted(sum(every, [])) == list(range(n))}


def _logged_run(stage: int, enabled: bool, steps: int) -> dict[str, Any]:
    """One engine's run with the comms logger on or off: its losses, what
    was logged (name -> size -> count) and the straggler analysis's keys."""
    from dsrun import comm

    comm.reset_log()
    config = {"train_batch_size": MICRO * dist.get_world_size(),
              "train_micro_batch_size_per_gpu": MICRO, "optimizer": ADAM,
              "steps_per_print": 1000, "zero_optimization": {"stage": stage},
              "comms_logger": {"enabled": enabled}}
    engine, _, _, _ = dsrun.initialize(model=make_model(100), config=config)
    losses = train(engine, steps)
    summary = comm.log_summary(show_straggler=True, return_dict=True)
    comm.configure(enabled=False)
    assert summary is not None
    return {"losses": losses,
            "ops": {name: {str(size): row["count"] for size, row in by_size.items()}
                    for name, by_size in summary["summary"].items()},
            "straggler": {name: sorted(map(str, by_size))
                          for name, by_size in summary["straggler_analysis"].items()}}


def comms_logged(steps: int = 3) -> dict[str, Any]:
    """DeepSpeed's comms logger on the engine's own collectives, stages 0, 2
    and 3: what it logged and the losses, with the logger on and off."""
    out: dict[str, Any] = {"param_bytes": sum(
        p.numel() * p.element_size() for p in make_model(0).parameters())}
    for stage in (0, 2, 3):
        out[f"stage{stage}"] = {"logged": _logged_run(stage, True, steps),
                                "unlogged": _logged_run(stage, False, steps)}
    return out


def logged_exchange() -> dict[str, Any]:
    """Both ranks isend then irecv with the comms logger on (a wait inside
    isend would deadlock), then the same through DeepSpeed's P2POp idiom
    (deepspeed.comm's isend/irecv in P2POp, batch_isend_irecv)."""
    from dsrun import comm

    rank, world = rank_world()
    peer = (rank + 1) % world
    comm.reset_log()
    comm.configure(enabled=True, prof_all=True)
    try:
        mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
        works = [comm.isend(mine, peer), comm.irecv(theirs, peer)]
        for work in works:
            work.wait()
        got = torch.empty(4)
        batch = comm.batch_isend_irecv([comm.P2POp(comm.isend, mine * 2, peer),
                                        comm.P2POp(comm.irecv, got, peer)])
        for work in batch:
            work.wait()
        logged = {name: sorted(by_size) for name, by_size in comm.log_summary(
            return_dict=True)["summary"].items()}
    finally:
        comm.configure(enabled=False)
        comm.reset_log()
    return {"received": theirs.tolist(), "batched": got.tolist(), "logged": logged}


def logged_gathers() -> dict[str, Any]:
    """The all-gathers with the comms logger on: the message size each is
    filed under (DeepSpeed's: one rank's input) and the algbw it reports."""
    from dsrun import comm

    rank, world = rank_world()
    comm.reset_log()
    comm.configure(enabled=True, prof_all=True)
    try:
        x = torch.full((256,), float(rank))  # 1 KiB per rank
        parts = [torch.empty(256) for _ in range(world)]
        comm.all_gather(parts, x)
        out = torch.empty(256 * world)
        comm.all_gather_into_tensor(out, x)
        comm.allgather_fn(out, x)
        summary = comm.log_summary(return_dict=True)["summary"]
    finally:
        comm.configure(enabled=False)
        comm.reset_log()
    return {"gathered": out.tolist()[::256], "sizes": {
        name: {str(size): [row["tput_avg_gbps"], row["avg_latency_ms"]]
               for size, row in by_size.items()} for name, by_size in summary.items()}}


def flops_profiled(steps: int = 3) -> dict[str, Any]:
    """The flops profiler at ZeRO stage 3: rank 0 writes the report (whole
    parameter counts although each rank holds a shard), other ranks write
    nothing, and profiling changes no loss."""
    import tempfile

    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "flops.txt")
        for profiled in (True, False):
            config = {"train_batch_size": MICRO * dist.get_world_size(),
                      "train_micro_batch_size_per_gpu": MICRO, "optimizer": ADAM,
                      "steps_per_print": 1000,
                      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                      "flops_profiler": {"enabled": profiled, "profile_step": 1,
                                         "output_file": report}}
            engine, _, _, _ = dsrun.initialize(model=make_model(100), config=config)
            runs[str(profiled)] = train(engine, steps)
            runs[f"held_{profiled}"] = sum(p.ds_tensor.numel() for p in engine.module.parameters())
        text = open(report, encoding="utf-8").read() if os.path.exists(report) else None
    return {"losses_on": runs["True"], "losses_off": runs["False"], "held": runs["held_True"],
            "whole": sum(p.numel() for p in make_model(0).parameters()), "report": text}


def no_backward_allreduce(steps: int = 3) -> dict[str, Any]:
    """``enable_backward_allreduce = False`` at stage 0: ``backward`` leaves
    each rank its local gradients (equal to a plain backward of the same
    model), ``allreduce_gradients()`` then averages them - bitwise as the
    hooks of a twin engine left at the default, and as a plain
    ``all_reduce`` / world size."""
    rank, world = rank_world()
    config = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": ADAM}
    manual, _, _, _ = dsrun.initialize(model=make_model(1 + rank), config=config)
    hooked, _, _, _ = dsrun.initialize(model=make_model(1 + rank), config=config)
    manual.enable_backward_allreduce = False
    facts: dict[str, Any] = {"flag": manual.enable_backward_allreduce, "local": [],
                             "ranks_differ_before": [], "as_hooks": [], "as_all_reduce": []}
    for step in range(steps):
        x, y = batch(step, 0)
        ref = make_model(0)
        ref.load_state_dict(manual.module.state_dict())
        F.cross_entropy(ref(x), y).backward()
        manual.backward(F.cross_entropy(manual(x), y))
        local = [p.grad.clone() for p in manual.module.parameters()]
        facts["local"].append(all(torch.equal(g, r.grad) for g, r in zip(local, ref.parameters())))
        facts["ranks_differ_before"].append(not ranks_agree(local))
        manual.allreduce_gradients()
        hooked.backward(F.cross_entropy(hooked(x), y))
        pairs = zip(manual.module.parameters(), hooked.module.parameters())
        facts["as_hooks"].append(all(torch.equal(a.grad, b.grad) for a, b in pairs))
        plain = [g.clone() for g in local]
        for g in plain:
            dist.all_reduce(g)
            g.div_(world)
        facts["as_all_reduce"].append(all(torch.equal(a, p.grad) for a, p in
                                          zip(plain, manual.module.parameters())))
        manual.step()
        hooked.step()
    facts["params_equal"] = all(torch.equal(a, b) for a, b in
                                zip(manual.module.parameters(), hooked.module.parameters()))
    facts["ranks_agree"] = ranks_agree(params_of(manual.module))
    return facts


def direct_backward() -> dict[str, Any]:
    """DeepSpeed's torch-style backward: ``loss.backward()`` (with
    ``engine.scale(loss)`` under fp16) trains bitwise as ``engine.backward``
    at every stage, with accumulation; an unscaled fp16 one is refused
    before any gradient lands; ``autograd.grad`` through the output (a
    gradient penalty) is left alone; the value ``engine.backward`` returns;
    and the accumulation round when the script sets the boundaries."""
    out: dict[str, Any] = {}
    rank, _ = rank_world()

    def build(stage: int, gas: int = 1, fp16: bool = False) -> Any:
        torch.manual_seed(0)
        cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                               "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
                               "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
                               "zero_optimization": {"stage": stage}}
        if fp16:
            cfg["fp16"] = {"enabled": True, "auto_cast": True, "initial_scale_power": 8}
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(),
                                    torch.nn.Linear(4, 1))
        return dsrun.initialize(model=model, config=cfg)[0]

    def inputs(step: int) -> torch.Tensor:
        return torch.randn(2, 3, generator=torch.Generator().manual_seed(10 * step + rank))

    def full(engine: Any) -> list[torch.Tensor]:
        return [dsrun.utils.safe_get_full_fp32_param(p).clone()
                for p in engine.module.parameters()]

    for stage, gas, fp16 in ((0, 1, False), (0, 2, True), (1, 2, False), (2, 1, True),
                             (2, 2, False), (3, 2, True), (3, 1, False)):
        ref, own = build(stage, gas, fp16), build(stage, gas, fp16)
        for step in range(2 * gas):
            ref.backward(ref(inputs(step)).float().pow(2).mean())
            ref.step()
            loss = own(inputs(step)).float().pow(2).mean()
            (own.scale(loss) if fp16 else loss).backward()
            own.step()
        name = f"stage{stage}_gas{gas}" + ("_fp16" if fp16 else "")
        out[name] = all(torch.equal(a, b) for a, b in zip(full(ref), full(own)))
        out[f"{name}_steps"] = own.global_steps
        out[f"{name}_agree"] = ranks_agree(full(own))
    # an output computed from another (a loss returned beside its logits), and
    # every parameter under a reentrant checkpoint: divided once, at the parameters
    class LossBeside(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(),
                                           torch.nn.Linear(4, 1))

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = torch.utils.checkpoint.checkpoint(
                self.net, x.requires_grad_(), use_reentrant=True) if self.reentrant \
                else self.net(x)
            return {"loss": logits.pow(2).mean(), "logits": logits}

    for reentrant in (False, True):
        engines = []
        for _ in range(2):
            torch.manual_seed(0)
            model = LossBeside()
            model.reentrant = reentrant
            engines.append(dsrun.initialize(model=model, config={
                "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                "gradient_clipping": 0.0, "steps_per_print": 1000,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0])
        ref, own = engines
        for step in range(4):
            ref.backward(ref(inputs(step))["loss"])
            ref.step()
            own(inputs(step))["loss"].backward()
            own.step()
        out[f"beside_reentrant{reentrant}"] = all(
            torch.equal(a, b) for a, b in zip(full(ref), full(own)))
    # a GAN's generator loss through the discriminator's engine: G's
    # engine.backward is no script-started pass for D (fp16: no refusal)
    gen, twin = build(0, gas=2), build(0, gas=2)
    torch.manual_seed(1)
    critic = torch.nn.Linear(1, 1)
    disc = dsrun.initialize(model=critic, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "fp16": {"enabled": True, "auto_cast": True}})[0]
    plain = torch.nn.Linear(1, 1).half()
    plain.load_state_dict(disc.module.state_dict())
    gen.backward(disc(gen(inputs(0))).float().sum())
    twin.backward(plain(twin(inputs(0)).half()).float().sum())
    out["gan"] = (disc.micro_in_round() == 0 and all(
        torch.equal(a.grad, b.grad)
        for a, b in zip(gen.module.parameters(), twin.module.parameters())))
    engine = build(2, fp16=True)  # engine.scale of a loss never backwarded scales nothing
    engine.scale(engine(inputs(0)).float().pow(2).mean())
    try:
        engine(inputs(1)).float().pow(2).mean().backward()
        out["scale_elsewhere"] = "ran"
    except RuntimeError as err:
        out["scale_elsewhere"] = str(err)
    engine, twin = build(2, fp16=True), build(2, fp16=True)  # fp16 without engine.scale:
    try:  # refused before anything lands, the engine trains on as its twin
        engine(inputs(0)).float().pow(2).mean().backward()
        out["unscaled"] = "ran"
    except RuntimeError as err:
        out["unscaled"] = str(err)
    for each in (engine, twin):
        each.backward(each(inputs(1)).float().pow(2).mean())
        each.step()
    out["unscaled_then_trains"] = (all(torch.equal(a, b) for a, b in zip(full(engine), full(twin)))
                                   and engine.global_steps == 1 and engine.skipped_steps == 0)
    engine = build(0, gas=2)
    loss = engine(inputs(0)).pow(2).mean()
    out["loss"], out["returned"] = loss.item(), engine.backward(loss).item()
    # a gradient penalty: autograd.grad through the output is not divided
    engine, plain = build(0, gas=2), build(0).module
    x = inputs(0).requires_grad_()
    y = engine(x).pow(2).mean()
    (penalty,) = torch.autograd.grad(y, x, create_graph=True)
    (expected,) = torch.autograd.grad(plain(x).pow(2).mean(), x)
    out["penalty_undivided"] = torch.equal(penalty, expected)
    engine.backward(y + penalty.pow(2).sum())
    engine.step()
    engine.backward(engine(inputs(1)).pow(2).mean())
    engine.step()
    out["penalty_steps"] = engine.global_steps
    engine = build(2, gas=2)  # Accelerate: boundaries set by the script, step() at one only
    rounds = []
    for sync in (False, True, False, True):
        engine.set_gradient_accumulation_boundary(sync)
        engine.backward(engine(inputs(0)).pow(2).mean())
        rounds.append(engine.micro_in_round())
        if sync:
            engine.step()
            rounds.append(engine.micro_in_round())
    engine.set_train_batch_size(engine.train_batch_size())  # refused inside a round
    out["rounds"] = rounds
    return out


def zero_grad_mid_round() -> dict[str, Any]:
    """``zero_grad()`` between the micro-steps of a round drops what the
    round accumulated: the same weights as a round whose first micro-step
    gave zero gradients, at stages 0, 2 and 3 (gradient accumulation 2)."""
    x1, x2 = torch.full((2, 3), 3.0), torch.ones(2, 3)
    out: dict[str, Any] = {}
    for stage in (0, 2, 3):
        weights = []
        for drop in (True, False):
            torch.manual_seed(0)
            engine = dsrun.initialize(model=torch.nn.Linear(3, 1), config={
                "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                "gradient_clipping": 0.0, "steps_per_print": 1000,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "zero_optimization": {"stage": stage}})[0]
            first = engine(x1).pow(2).mean()
            engine.backward(first if drop else first * 0.0)
            engine.step()
            if drop:
                engine.zero_grad()
            engine.backward(engine(x2).pow(2).mean())
            engine.step()
            weights.append(torch.cat([dsrun.utils.safe_get_full_fp32_param(p).flatten()
                                      for p in engine.module.parameters()]))
        out[f"stage{stage}"] = (weights[0] - weights[1]).abs().max().item()
    return out


class _TiedHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # reads a released parameter
        return self.lin(self.emb(x)) @ self.emb.weight.t()


def _adam(model: torch.nn.Module) -> torch.optim.Adam:
    return torch.optim.Adam(model.parameters(), lr=0.01, foreach=False)


def older_destroyed_later(steps: int = 3) -> dict[str, Any]:
    """Stage 3: initialize() twice on one model, then destroy() the older
    engine (what its superseded error suggests): the newer one trains on as
    an engine built once would (the older close() used to undo its set-up)."""
    x = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(1))
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
              "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    out: dict[str, Any] = {}
    for twice in (False, True):
        torch.manual_seed(0)
        model = _TiedHead()
        engine = dsrun.initialize(model=model, optimizer=_adam(model), config=config)[0]
        if twice:
            older, engine = engine, dsrun.initialize(model=model, optimizer=_adam(model),
                                                     config=config)[0]
            older.destroy()
        losses = []
        for _ in range(steps):
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.destroy()
        out["twice" if twice else "once"] = losses
    return out


def configs_differ() -> dict[str, Any]:
    """Ranks whose resolved configs differ (a per-rank learning rate): the
    keys that differ, and what initialize() logs about them on rank 0."""
    import logging

    from dsrun.runtime.config import resolve
    from dsrun.runtime.config_agree import check_ranks_agree

    rank, world = rank_world()

    def config(lr: float) -> dict[str, Any]:
        return {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
                "optimizer": {"type": "SGD", "params": {"lr": lr}}}

    same = check_ranks_agree(resolve(config(0.1), dp_size=world, dp_source="test"))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("dsrun.runtime.engine").addHandler(handler)
    try:
        engine = dsrun.initialize(model=torch.nn.Linear(2, 1), config=config(0.1 * (rank + 1)))[0]
        engine.destroy()
    finally:
        logging.getLogger("dsrun.runtime.engine").removeHandler(handler)
    return {"same": same, "warned": [r for r in records if "different training configs" in r]}


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "parity_gas1": lambda: parity(gas=1, clip=0.0, schedule=False, bucket_elements=None),
    "parity_gas4_clip_schedule": lambda: parity(gas=4, clip=0.05, schedule=True,
                                                bucket_elements=300),
    "zero1_gas1": lambda: parity(gas=1, clip=0.0, schedule=False, bucket_elements=None,
                                 stage=1),
    "zero1_gas4_clip_schedule": lambda: parity(gas=4, clip=0.05, schedule=True,
                                               bucket_elements=300, stage=1),
    "zero2_gas1_client": lambda: parity(gas=1, clip=0.0, schedule=False,
                                        bucket_elements=300, stage=2, client=True),
    "zero2_gas4_clip_schedule": lambda: parity(gas=4, clip=0.05, schedule=True,
                                               bucket_elements=300, stage=2),
    "zero3_gas1": lambda: parity(gas=1, clip=0.0, schedule=False, bucket_elements=300,
                                 stage=3),
    "zero3_gas4_clip_schedule_client": lambda: parity(gas=4, clip=0.05, schedule=True,
                                                      bucket_elements=300, stage=3,
                                                      client=True),
    # DeepSpeed-style offload sections and a small sub_group_size, through the config
    "zero2_gas4_clip_offload": lambda: parity(
        gas=4, clip=0.05, schedule=True, bucket_elements=300, stage=2,
        zero_extra={"offload_optimizer": {"device": "cpu", "pin_memory": True},
                    "sub_group_size": 50}),
    "zero3_gas4_clip_offload": lambda: parity(
        gas=4, clip=0.05, schedule=True, bucket_elements=300, stage=3,
        zero_extra={"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                    "sub_group_size": 50}),
    "zero3_init": zero3_init,
    "fp16_overflow": fp16_overflow,
    "bf16_autocast": bf16_autocast,
    "unused_and_no_sync": unused_and_no_sync,
    "no_backward_allreduce": no_backward_allreduce,
    "branch_in_earlier_micro_steps": lambda: branch_in_earlier_micro_steps(0),
    "branch_in_earlier_micro_steps_zero2": lambda: branch_in_earlier_micro_steps(2),
    "dataloader": dataloader,
    "direct_backward": direct_backward,
    "zero_grad_mid_round": zero_grad_mid_round,
    "older_destroyed_later": older_destroyed_later,
    "configs_differ": configs_differ,
    "comms_logger": comms_logged,
    "flops_profiler": flops_profiled,
    "logged_exchange": logged_exchange,
    "logged_gathers": logged_gathers,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    dsrun.init_distributed()  # no-op under dsrun; world size 1 under plain python
    wanted = [c for c in args.only.split(",") if c] or list(CASES)
    results: dict[str, Any] = {"world_size": dist.get_world_size()}
    for name in wanted:
        try:
            results[name] = {"ok": True, **CASES[name]()}
        except Exception:  # noqa: BLE001 - reported per case; the others still run
            results[name] = {"ok": False, "error": traceback.format_exc()}
    path = os.path.join(args.out, f"rank{dist.get_rank()}.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main()
