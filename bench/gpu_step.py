"""Step time on one GPU: plain torch vs dsrun's ZeRO stages and offload (vs DeepSpeed).

    python3 bench/gpu_step.py [--precision bf16[,fp32,fp16]] [--runners torch,dsrun-s0,...]
        [--steps 12] [--warmup 3] [--json out.json] [--profile RUNNER --trace DIR]

The model is the bench GPT of ``train_throughput.py`` at the ``gpu`` size:
vocab 32000, width 1024, 12 layers, 16 heads, sequence 512, 8 sequences,
untied output head (217M parameters); AdamW (lr 1e-4). Every runner runs in
its own ``dsrun --num_gpus 1`` job (an NCCL process group of one rank, the
same launch path for all), does ``--warmup`` untimed steps, then
``--steps`` timed ones, each between two ``torch.cuda.synchronize()``;
reported: the median step time, its ratio to plain torch in the same
precision, and the peak CUDA memory (``max_memory_allocated``).

Runners: ``torch`` (the model on the GPU; bf16/fp16 through
``torch.autocast``, fp16 with ``GradScaler``; ``torch.optim.AdamW`` with its
default implementation, foreach on CUDA), ``torch-fused`` (the same with
``AdamW(fused=True)``, the implementation dsrun's ZeRO stages use),
``dsrun-s0..s3`` (stage 3 built under ``dsrun.zero.Init``),
``dsrun-s2-off`` (``offload_optimizer`` cpu, pinned),
``dsrun-s3-off`` (``offload_optimizer`` and ``offload_param`` cpu, pinned),
and, where ``import deepspeed`` works, DeepSpeed 0.19.8 in the same shapes:
``ds-s0..s3``, ``ds-s2-off``, ``ds-s3-off`` with torch's Adam
(``torch_adam``), and ``ds-s2-off-cpuadam`` / ``ds-s3-off-cpuadam`` with its
JIT-built ``DeepSpeedCPUAdam``.

``--profile RUNNER`` runs that runner once under ``torch.profiler`` for three
steps and prints the top operators by self CUDA time and by self CPU time
(``--trace DIR`` also writes a Chrome trace there).

On a GPU host whose Python has torch with CUDA but not this checkout
installed: ``PYTHONPATH=$PWD python3 bench/gpu_step.py``. The DeepSpeed
runners start from ``--ds-python`` (default: the interpreter running the
bench), which must import deepspeed, dsrun and a CUDA torch (a venv set up as
bench/train_throughput.py's docstring says, or a ``PYTHONPATH`` with DeepSpeed
on it, as scripts/gpu_checks.sh does); where it cannot import deepspeed they
are left out, and the output says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import train_throughput as tt  # noqa: E402 - the shared bench model

tt.use_model("gpu")
LR = 1e-4
PRECISIONS = ("bf16", "fp32", "fp16")
OFFLOAD_OPT = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
OFFLOAD_BOTH = {**OFFLOAD_OPT, "offload_param": {"device": "cpu", "pin_memory": True}}

Step = Callable[[Any], None]


def ds_config(stage: int, precision: str, zero: dict[str, Any] | None = None,
              torch_adam: bool = True) -> dict[str, Any]:
    optimizer: dict[str, Any] = {"lr": LR, "weight_decay": 0.0}
    if torch_adam:
        optimizer["torch_adam"] = True
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": tt.BATCH, "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9, "zero_optimization": {"stage": stage, **(zero or {})},
        "gradient_clipping": 0.0,  # as the torch runners: no clipping
        "optimizer": {"type": "AdamW", "params": optimizer}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12}
    return cfg


def _engine_step(engine: Any) -> Step:
    def step(tokens: Any) -> None:
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
    return step


def _torch(precision: str, fused: bool = False) -> Step:
    import torch

    model = tt.build_model(tied=False).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0,
                            fused=True if fused else None)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")

    def step(tokens: Any) -> None:
        cast = torch.autocast("cuda", dtype=dtype) if dtype else contextlib.nullcontext()
        with cast:
            loss = model(tokens)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return step


def _dsrun(stage: int, zero: dict[str, Any] | None = None) -> Callable[[str], Step]:
    def setup(precision: str) -> Step:
        import torch

        import dsrun

        config = ds_config(stage, precision, zero)
        if stage == 3:
            import dsrun.zero

            dtype = torch.float16 if precision == "fp16" else torch.float32
            with dsrun.zero.Init(config_dict_or_path=config, dtype=dtype):
                model = tt.build_model(tied=False)
            dsrun.zero.register_external_parameter(model, model.wpe.weight)
        else:
            model = tt.build_model(tied=False)
        engine, _, _, _ = dsrun.initialize(model=model, config=config)
        return _engine_step(engine)
    return setup


def _deepspeed(stage: int, zero: dict[str, Any] | None = None,
               torch_adam: bool = True) -> Callable[[str], Step]:
    def setup(precision: str) -> Step:
        import deepspeed

        model = tt.build_model(tied=False)
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(),
            config=ds_config(stage, precision, zero, torch_adam))
        return _engine_step(engine)
    return setup


RUNNERS: dict[str, Callable[[str], Step]] = {
    "torch": _torch,
    "torch-fused": lambda precision: _torch(precision, fused=True),
    **{f"dsrun-s{s}": _dsrun(s) for s in range(4)},
    "dsrun-s2-off": _dsrun(2, OFFLOAD_OPT),
    "dsrun-s3-off": _dsrun(3, OFFLOAD_BOTH),
    **{f"ds-s{s}": _deepspeed(s) for s in range(4)},
    "ds-s2-off": _deepspeed(2, OFFLOAD_OPT),
    "ds-s3-off": _deepspeed(3, OFFLOAD_BOTH),
    "ds-s2-off-cpuadam": _deepspeed(2, OFFLOAD_OPT, torch_adam=False),
    "ds-s3-off-cpuadam": _deepspeed(3, OFFLOAD_BOTH, torch_adam=False),
}
DEFAULT = ["torch", "torch-fused", "dsrun-s0", "dsrun-s1", "dsrun-s2", "dsrun-s3", "dsrun-s2-off",
           "dsrun-s3-off"]
COMPARISONS = [(f"dsrun-s{s}", f"ds-s{s}") for s in range(4)] + [
    ("dsrun-s2-off", "ds-s2-off"), ("dsrun-s3-off", "ds-s3-off"),
    ("dsrun-s2-off", "ds-s2-off-cpuadam"), ("dsrun-s3-off", "ds-s3-off-cpuadam")]


def worker(runner: str, precision: str, steps: int, warmup: int, out: str,
           trace: str | None, profile: bool) -> None:
    import torch

    import dsrun

    dsrun.init_distributed()
    step = RUNNERS[runner](precision)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, tt.VOCAB, (tt.BATCH, tt.SEQ + 1), generator=gen).cuda()
    for _ in range(warmup):
        step(tokens)
    torch.cuda.synchronize()
    if profile:
        _profile(step, tokens, trace)
        return
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(tokens)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    facts = {"times": times, "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
             "device": torch.cuda.get_device_name()}
    Path(out, "facts.json").write_text(json.dumps(facts))


def _profile(step: Step, tokens: Any, trace: str | None) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step(tokens)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cuda_time_total", row_limit=25), flush=True)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    if trace:
        os.makedirs(trace, exist_ok=True)
        prof.export_chrome_trace(os.path.join(trace, "trace.json"))


def run_once(runner: str, precision: str, args: argparse.Namespace) -> dict[str, Any] | str:
    python = args.ds_python if runner.startswith("ds-") else sys.executable
    with tempfile.TemporaryDirectory() as out:
        argv = [python, "-m", "dsrun.launcher.cli", "--num_gpus", "1", __file__,
                "--worker", runner, "--precision", precision, "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--out", out]
        if args.profile:
            argv += ["--profile", runner] + (["--trace", args.trace] if args.trace else [])
        res = subprocess.run(argv, capture_output=not args.profile, text=True, cwd=str(ROOT))
        if res.returncode != 0:
            tail = (res.stderr or "")[-2500:]
            return f"failed ({res.returncode}): {tail}"
        if args.profile:
            return {}
        return json.loads(Path(out, "facts.json").read_text())


def has_deepspeed(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import deepspeed, dsrun"], capture_output=True,
                           cwd=str(ROOT))
    return probe.returncode == 0


def print_table(precision: str, rows: dict[str, dict[str, Any] | str]) -> None:
    base = rows.get("torch")
    base_ms = statistics.median(base["times"]) * 1e3 if isinstance(base, dict) else None
    device = next((r["device"] for r in rows.values() if isinstance(r, dict)), "?")
    print(f"\n{precision}: GPT 217M, {tt.BATCH}x{tt.SEQ} tokens, AdamW, on {device}")
    print(f"{'runner':<20}{'ms/step':>9}{'vs torch':>10}{'peak MiB':>10}")
    ms: dict[str, float] = {}
    for name, row in rows.items():
        if isinstance(row, str):  # "failed (rc): ..." and the job's stderr
            head, _, tail = row.partition(": ")
            last = next((ln for ln in reversed(tail.splitlines()) if ln.strip()), "")
            print(f"{name:<20}  {head}: {last.strip()}")
            continue
        ms[name] = statistics.median(row["times"]) * 1e3
        ratio = f"{ms[name] / base_ms:.2f}x" if base_ms else "-"
        print(f"{name:<20}{ms[name]:>9.1f}{ratio:>10}{row['peak_mib']:>10.0f}")
    if "torch-fused" in ms:
        print("vs torch-fused: " + ", ".join(
            f"{n} {ms[n] / ms['torch-fused']:.2f}x" for n in ms if n.startswith("dsrun")))
    for mine, anchor in COMPARISONS:
        if mine in ms and anchor in ms:
            print(f"{mine} / {anchor} = {ms[mine] / ms[anchor]:.2f} (step time)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--runners", default=",".join(DEFAULT),
                        help=f"comma-separated, from {', '.join(RUNNERS)}; 'all' for every "
                             "one (DeepSpeed's where it imports)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ds-python", default=sys.executable,
                        help="the interpreter that runs the ds-* runners (default: this one)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", default=None, metavar="RUNNER")
    parser.add_argument("--trace", default=None, metavar="DIR")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.precision, args.steps, args.warmup, args.out, args.trace,
               profile=args.profile is not None)
        return
    precisions = [p for p in args.precision.split(",") if p]
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad:
        raise SystemExit(f"unknown precision(s) {bad}; choose from {PRECISIONS}")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_step.py needs a CUDA GPU: torch.cuda.is_available() is "
                         "False here")
    if args.profile:
        for precision in precisions:
            run_once(args.profile, precision, args)
        return
    names = list(RUNNERS) if args.runners == "all" else [n for n in args.runners.split(",") if n]
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        raise SystemExit(f"unknown runner(s) {unknown}; choose from {list(RUNNERS)}")
    left_out = [n for n in names if n.startswith("ds-")]
    if left_out and not has_deepspeed(args.ds_python):
        names = [n for n in names if n not in left_out]
        print(f"DeepSpeed does not import in {args.ds_python} (--ds-python): "
              f"{', '.join(left_out)} left out", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for precision in precisions:
        rows: dict[str, dict[str, Any] | str] = {}
        for name in names:
            rows[name] = run_once(name, precision, args)
            print(f"{precision} {name}: done", file=sys.stderr, flush=True)
        print_table(precision, rows)
        results[precision] = rows  # type: ignore[assignment]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    failed = [f"{p} {n}" for p, rows in results.items() for n, row in rows.items()
              if isinstance(row, str)]
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
