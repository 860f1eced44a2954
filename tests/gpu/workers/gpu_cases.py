"""GPU cases, all run inside ONE job: ``dsrun --num_gpus 1 gpu_cases.py --out DIR``.

Each case trains on the rank's GPU (an NCCL process group of one rank) and
records facts; ``tests/gpu/test_gpu.py`` asserts on them. Importing torch and
bringing CUDA up costs seconds, so the job starts once for every case.

References are plain torch on the same GPU with the same initial weights and
data: fp32 -> the model in fp32 with ``torch.optim.AdamW``; bf16 -> the same
under ``torch.autocast(bfloat16)`` (dsrun's bf16 is autocast over fp32
weights); fp16 -> the fp32 reference (dsrun's fp16 is a fp16 model with fp32
masters and loss scaling, which plain torch has no exact twin of).

Usage: gpu_cases.py --out DIR [--only CASE,...]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dsrun
import dsrun.zero

WIDTH, DEPTH, CLASSES, MICRO = 256, 4, 16, 32
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01}
STEPS = 12


def make_model(seed: int = 0, width: int = WIDTH, depth: int = DEPTH) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, CLASSES))
    return torch.nn.Sequential(*layers)


def batch(step: int, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    y = torch.randint(0, CLASSES, (MICRO,), generator=gen)
    x = torch.randn(MICRO, width, generator=gen) * 0.5
    x[torch.arange(MICRO), y] += 2.0
    return x.cuda(), y.cuda()


def config(stage: int, precision: str, **zero: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": MICRO, "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 10_000,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
        "zero_optimization": {"stage": stage, **zero}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12}
    return cfg


def full_params(module: torch.nn.Module) -> list[torch.Tensor]:
    params = list(module.parameters())
    if not any(hasattr(p, "ds_shape") for p in params):
        return [p.detach().float().clone() for p in params]
    with dsrun.zero.GatheredParameters(params):
        return [p.detach().float().clone() for p in params]


def reference(precision: str, steps: int = STEPS) -> dict[str, Any]:
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    cast = torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16" \
        else contextlib.nullcontext()
    losses = []
    for step in range(steps):
        x, y = batch(step)
        with cast:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "params": full_params(model)}


def train(engine: Any, steps: int = STEPS, width: int = WIDTH, half: bool = False
          ) -> list[float]:
    """``half``: the inputs are cast to fp16, as a DeepSpeed fp16 script does
    (the engine casts them only with ``fp16.auto_cast``)."""
    losses = []
    for step in range(steps):
        x, y = batch(step, width)
        x = x.half() if half else x
        loss = F.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def compare(params: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, Any]:
    num = sum(float((a - b).float().norm() ** 2) for a, b in zip(params, ref)) ** 0.5
    den = sum(float(b.float().norm() ** 2) for b in ref) ** 0.5
    return {"params_equal": all(torch.equal(a, b) for a, b in zip(params, ref)),
            "params_rel_diff": num / den}


_REFS: dict[str, dict[str, Any]] = {}


def ref_for(precision: str) -> dict[str, Any]:
    key = "bf16" if precision == "bf16" else "fp32"
    if key not in _REFS:
        _REFS[key] = reference(key)
    return _REFS[key]


def parity(stage: int, precision: str) -> dict[str, Any]:
    """Stage ``stage`` in ``precision`` against plain torch on this GPU."""
    model = make_model()
    if stage == 3:
        dtype = torch.float16 if precision == "fp16" else torch.float32
        cfg = config(stage, precision)
        with dsrun.zero.Init(config_dict_or_path=cfg, dtype=dtype):
            model = make_model()
    engine, *_ = dsrun.initialize(model=model, config=config(stage, precision))
    losses = train(engine, half=precision == "fp16")
    ref = ref_for(precision)
    out = {"losses": losses, "ref_losses": ref["losses"], "device": str(engine.device),
           "skipped": engine.skipped_steps, **compare(full_params(engine.module), ref["params"])}
    _release(engine)
    return out


def nccl_group() -> dict[str, Any]:
    return {"backend": dist.get_backend(), "world_size": dist.get_world_size(),
            "current_device": torch.cuda.current_device(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "local_rank": os.environ.get("LOCAL_RANK")}


def fp16_overflow() -> dict[str, Any]:
    """A loss scale of 2^24 overflows fp16 gradients: the step is skipped
    (weights unchanged) and the scale halves until gradients fit; then
    ``loss_scale_window`` clean steps double it again."""
    cfg = config(0, "fp16")
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 3,
                   "hysteresis": 1, "min_loss_scale": 1}
    engine, *_ = dsrun.initialize(model=make_model(), config=cfg)
    before = full_params(engine.module)
    scales, skipped, grad_dtypes = [], [], set()
    unchanged_after_first = None
    for step in range(14):
        x, y = batch(step)
        x = x.half()
        loss = F.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        grad_dtypes |= {str(p.grad.dtype) for p in engine.module.parameters()
                        if p.grad is not None}
        engine.step()
        if step == 0:
            unchanged_after_first = all(torch.equal(a, b) for a, b in
                                        zip(before, full_params(engine.module)))
        scales.append(engine.precision.loss_scale)
        skipped.append(engine.skipped_steps)
    out = {"scales": scales, "skipped": skipped, "grad_dtypes": sorted(grad_dtypes),
           "unchanged_after_first": unchanged_after_first,
           "model_dtype": str(next(engine.module.parameters()).dtype)}
    _release(engine)
    return out


def zero_init_cuda() -> dict[str, Any]:
    cfg = config(3, "bf16", stage3_param_persistence_threshold=0)
    with dsrun.zero.Init(config_dict_or_path=cfg):
        model = make_model()
    shard_devices = sorted({str(p.ds_tensor.device) for p in model.parameters()})
    engine, *_ = dsrun.initialize(model=model, config=cfg)
    losses = train(engine)
    out = {"shard_devices": shard_devices, "losses": losses,
           "param_devices": sorted({str(p.device) for p in engine.module.parameters()})}
    _release(engine)
    return out


def offload(stage: int, param: bool) -> dict[str, Any]:
    """Offload with pinned host copies against the same stage without it, in
    fp32 (in bf16 the last-bit differences between the CPU's and the GPU's
    Adam flip bf16 roundings of activations and grow to ~1e-4)."""
    extra: dict[str, Any] = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if param:
        extra["offload_param"] = {"device": "cpu", "pin_memory": True}
    runs = {}
    for name, zero in (("plain", {}), ("offload", extra)):
        model = make_model()
        if stage == 3:
            with dsrun.zero.Init(config_dict_or_path=config(3, "fp32", **zero)):
                model = make_model()
        engine, *_ = dsrun.initialize(model=model, config=config(stage, "fp32", **zero))
        losses = train(engine)
        facts: dict[str, Any] = {"losses": losses, "params": full_params(engine.module)}
        opt = engine.optimizer
        facts["master_devices"] = sorted({str(m.device) for m in _masters(opt)})
        facts["masters_pinned"] = all(m.is_pinned() for m in _masters(opt))
        if stage == 3:
            facts["shard_devices"] = sorted({str(p.ds_tensor.device)
                                             for p in engine.module.parameters()})
            facts["shards_pinned"] = all(p.ds_tensor.is_pinned()
                                         for p in engine.module.parameters()
                                         if p.ds_tensor.device.type == "cpu")
        runs[name] = facts
        _release(engine)
    plain, off = runs["plain"], runs["offload"]
    return {"losses": off["losses"], "plain_losses": plain["losses"],
            **compare(off["params"], plain["params"]),
            **{k: v for k, v in off.items() if k not in ("losses", "params")},
            "plain_master_devices": plain["master_devices"]}


def _masters(opt: Any) -> list[torch.Tensor]:
    return [p for g in opt.optimizer.param_groups for p in g["params"]]


def memory() -> dict[str, Any]:
    """Peak CUDA memory of two training steps: stage 0 against stage 3 with
    both offloads, on a model whose state (16 bytes/parameter) dominates.
    Each peak is counted above what was allocated before the run (earlier
    cases' leftovers are not charged to it); ``leaked``: what each run left
    allocated after its engine was dropped."""
    width, depth = 2048, 8
    peaks, leaked = {}, {}
    for name, stage, zero in (
            ("stage0", 0, {}),
            ("stage3_offload", 3, {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                                   "offload_param": {"device": "cpu", "pin_memory": True}})):
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        cfg = config(stage, "bf16", **zero)
        if stage == 3:
            with dsrun.zero.Init(config_dict_or_path=cfg):
                model = make_model(width=width, depth=depth)
        else:
            model = make_model(width=width, depth=depth)
        engine, *_ = dsrun.initialize(model=model, config=cfg)
        train(engine, steps=2, width=width)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        _release(engine)
        del model
        gc.collect()
        leaked[name] = torch.cuda.memory_allocated() - base
    params = depth * (width * width + width) + width * CLASSES + CLASSES
    return {"peaks": peaks, "leaked": leaked, "parameters": params}


def no_host_sync(stage: int) -> dict[str, Any]:
    """bf16 at world size 1: after two warm-up steps (the first logs the
    memory report), a whole training step - forward, backward, step - under
    ``torch.cuda.set_sync_debug_mode("error")``, which raises on any call
    that makes the host wait for the GPU; also whether the parameters are
    views of one flat buffer aliased by the masters (nothing copied)."""
    cfg = config(stage, "bf16")
    if stage == 3:  # fp32 parameters (autocast computes in bf16), as at stages 1-2
        with dsrun.zero.Init(config_dict_or_path=cfg, dtype=torch.float32):
            model = make_model()
    else:
        model = make_model()
    engine, *_ = dsrun.initialize(model=model, config=cfg)
    train(engine, steps=2)
    x, y = batch(2)
    error = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = F.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
    except RuntimeError as err:
        error = str(err)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    masters = {m.data_ptr() for m in engine.optimizer.masters}
    first = next(p for p in engine.module.parameters() if p.requires_grad)
    out = {"error": error, "backward_hooks": engine.optimizer.backward_hook_installed,
           "master_is_param_buffer": first.data_ptr() in masters}
    _release(engine)
    return out


def client_state_cuda() -> dict[str, Any]:
    """A checkpoint whose client_state holds a CUDA tensor: load_checkpoint
    hands it back in host memory (loaded to the CPU on every rank, as
    DeepSpeed loads), the model's state on the GPU."""
    with tempfile.TemporaryDirectory() as save_dir:
        engine, *_ = dsrun.initialize(model=make_model(), config=config(1, "fp32"))
        train(engine, steps=2)
        saved = torch.arange(4.0, device="cuda")
        engine.save_checkpoint(save_dir, client_state={"t": saved, "step": 7})
        _release(engine)
        engine, *_ = dsrun.initialize(model=make_model(seed=1), config=config(1, "fp32"))
        _, client = engine.load_checkpoint(save_dir)
        out = {"client_device": str(client["t"].device), "client_step": client["step"],
               "client_equal": torch.equal(client["t"], saved.cpu()),
               "param_devices": sorted({str(p.device) for p in engine.module.parameters()})}
        _release(engine)
    return out


def _release(engine: Any) -> None:
    engine.destroy()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "nccl_group": nccl_group,
    **{f"parity_s{s}_{p}": (lambda s=s, p=p: parity(s, p))
       for s in range(4) for p in ("fp32", "bf16", "fp16")},
    "fp16_overflow": fp16_overflow,
    "zero_init_cuda": zero_init_cuda,
    "offload_s2": lambda: offload(2, param=False),
    "offload_s3": lambda: offload(3, param=True),
    "memory": memory,
    "client_state_cuda": client_state_cuda,
    **{f"no_host_sync_s{s}": (lambda s=s: no_host_sync(s)) for s in (1, 2, 3)},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    only = [c for c in args.only.split(",") if c]
    results: dict[str, Any] = {}
    for name, case in CASES.items():
        if only and name not in only:
            continue
        try:
            results[name] = {"ok": True, **case()}
        except Exception:  # noqa: BLE001 - recorded for the test to show
            results[name] = {"ok": False, "error": traceback.format_exc()}
        print(f"case {name}: {'ok' if results[name]['ok'] else 'FAILED'}", flush=True)
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, default=str)


if __name__ == "__main__":
    main()
