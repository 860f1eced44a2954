"""Per-step Python/launch overhead of dsrun's ZeRO stages at world size 1.

    .venv/bin/python bench/step_overhead.py [--rounds 5] [--steps 30] [--warmup 5]
        [--runners torch,dsrun-s0,...] [--precision fp32|bf16] [--layers 48] [--width 32]

A CPU proxy for what dominates a ZeRO step on a GPU: there, kernels are fast
and a step is bound by the host work around them (Python in hooks, operator
dispatch, one kernel launch per parameter and per operation). Here the
model has many small parameters and almost no arithmetic - ``--layers``
blocks of LayerNorm + Linear (4 parameters each, ``--width`` wide; 48 x 4 +
2 = 194 parameters by default, about the 149 of the 217M GPT in
``gpu_step.py``) on a batch of 2 - so a step's time is that host work.

Every runner trains the same model in this one process (a gloo group of one
rank, as ``dsrun.initialize`` makes under plain python), ``torch.set_num_threads(1)``.
Each round runs every runner in rotating order (interleaved: machine noise
hits all alike); a run does ``--warmup`` untimed steps and ``--steps``
timed ones. Reported per runner: the *least* over rounds of a run's median
step time in microseconds (host work only adds time: the least disturbed
run is the best estimate of its cost on a shared machine; timeit's rule),
and the overhead over the torch baselines in microseconds per step (the
number that adds to every GPU step) and per parameter.

Runners: ``torch`` (``torch.optim.AdamW`` with torch's default
implementation: single-tensor on the CPU, foreach on CUDA - what dsrun's
stage 0 steps with too), ``torch-foreach`` (what plain torch runs on CUDA by
default: one kernel per operation over all parameters), ``torch-fused``
(``fused=True``: what dsrun's stages 1-3 pick), ``dsrun-s0``..``dsrun-s3``
(stage 3 built under ``dsrun.zero.Init``), ``dsrun-s2-off`` /
``dsrun-s3-off`` (the offload code path: on CPU ranks its host copies are
plain copies; stage 3 with ``offload_param`` fetches each module's
parameters and sends each gradient to the host accumulators, as on a GPU).

The overhead columns compare each runner with ``torch`` (same optimizer
implementation as stage 0) and with ``torch-fused`` (same as stages 1-3).
The ranks are CPU ranks (``DSRUN_ACCELERATOR=cpu``, as ``dsrun --cpu``
sets), also on a host with GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import time
from typing import Any, Callable

import torch

LR = 1e-3
Step = Callable[[torch.Tensor], None]
OFFLOAD_OPT = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
OFFLOAD_BOTH = {**OFFLOAD_OPT, "offload_param": {"device": "cpu", "pin_memory": True}}


def build_model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = [torch.nn.Linear(width, width)]
    for _ in range(layers):
        blocks += [torch.nn.LayerNorm(width), torch.nn.Linear(width, width)]
    return torch.nn.Sequential(*blocks)


def _autocast(precision: str) -> Any:
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _torch(kind: dict[str, bool]) -> Callable[[argparse.Namespace], Step]:
    def setup(args: argparse.Namespace) -> Step:
        model = build_model(args.layers, args.width)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, **kind)

        def step(x: torch.Tensor) -> None:
            with _autocast(args.precision):
                loss = model(x).float().square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return step
    return setup


def _config(stage: int, precision: str, zero: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9, "zero_optimization": {"stage": stage, **zero},
        "gradient_clipping": 0.0,  # as the torch runners: no clipping
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _dsrun(stage: int, zero: dict[str, Any] | None = None) -> Callable[[argparse.Namespace],
                                                                        Step]:
    def setup(args: argparse.Namespace) -> Step:
        import dsrun

        config = _config(stage, args.precision, zero or {})
        if stage == 3:
            import dsrun.zero

            with dsrun.zero.Init(config_dict_or_path=config):
                model = build_model(args.layers, args.width)
        else:
            model = build_model(args.layers, args.width)
        engine, _, _, _ = dsrun.initialize(model=model, config=config)

        def step(x: torch.Tensor) -> None:
            loss = engine(x).float().square().mean()
            engine.backward(loss)
            engine.step()
        return step
    return setup


RUNNERS: dict[str, Callable[[argparse.Namespace], Step]] = {
    "torch": _torch({}),
    "torch-foreach": _torch({"foreach": True}),
    "torch-fused": _torch({"fused": True}),
    **{f"dsrun-s{s}": _dsrun(s) for s in range(4)},
    "dsrun-s2-off": _dsrun(2, OFFLOAD_OPT),
    "dsrun-s3-off": _dsrun(3, OFFLOAD_BOTH),
}


def time_runner(name: str, args: argparse.Namespace) -> float:
    """Median step time of one fresh run of ``name``, in seconds."""
    step = RUNNERS[name](args)
    x = torch.randn(2, args.width, generator=torch.Generator().manual_seed(1))
    for _ in range(args.warmup):
        step(x)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--runners", default=",".join(RUNNERS))
    args = parser.parse_args()
    names = [n for n in args.runners.split(",") if n]
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        raise SystemExit(f"unknown runner(s) {unknown}; choose from {list(RUNNERS)}")
    torch.set_num_threads(1)
    logging.getLogger("dsrun").setLevel(logging.WARNING)
    os.environ.setdefault("DSRUN_ACCELERATOR", "cpu")  # CPU ranks, as dsrun --cpu
    import dsrun

    dsrun.init_distributed()  # one rank, gloo (zero.Init needs the group)
    runs: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            runs[name].append(time_runner(name, args))
    params = sum(1 for _ in build_model(args.layers, args.width).parameters())
    base = {b: min(runs[b]) * 1e6 for b in ("torch", "torch-fused") if b in runs}
    print(f"{params} parameters ({args.layers} x LayerNorm+Linear, width {args.width}), "
          f"batch 2, {args.precision}, world size 1, 1 thread; {args.rounds} interleaved "
          f"round(s) of {args.steps} steps")
    print(f"{'runner':<16}{'us/step':>9}" + "".join(
        f"{'over ' + b + ' us/step':>26}{'us/param':>10}" for b in base))
    for name, values in runs.items():
        us = min(values) * 1e6
        cells = "".join(f"{us - ref:>26.0f}{(us - ref) / params:>10.2f}"
                        for ref in base.values())
        print(f"{name:<16}{us:>9.0f}{cells}")


if __name__ == "__main__":
    main()
