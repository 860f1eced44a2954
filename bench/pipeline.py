"""Pipeline parallelism: dsrun's PipelineEngine vs DeepSpeed's vs DDP, and the bubble.

    .venv/bin/python bench/pipeline.py [--rounds 3] [--steps 4] [--warmup 2]
        [--micro-batch 2] [--micro-batches 8]
        [--runners dsrun-pipe,dsrun-flops,deepspeed-pipe,ddp] [--bind-cores]
        [--json results.json]

The bench GPT of bench/train_throughput.py (vocab 8192, width 512, 6 blocks,
8 heads, sequence 128, embedding tied to the output layer: 23.2M parameters),
fp32, AdamW, on 2 CPU ranks with gloo (``dsrun --cpu --num_gpus 2``, one
thread per rank). One step is one global batch of ``--micro-batches``
micro-batches of ``--micro-batch`` sequences:

* ``dsrun-pipe``: a dsrun ``PipelineModule`` of 2 stages (``type:Block``:
  embedding and 3 blocks | 3 blocks, final norm and the tied output layer,
  a ``TiedLayerSpec``), ``engine.train_batch()`` (1F1B);
* ``dsrun-flops``: the same with ``partition_method="flops"`` (layers
  balanced by their counted forward + backward work on a micro-batch's
  shapes; it puts 4 blocks on the first stage, which carries no output
  layer). DeepSpeed has no work-based method (its ``"profile"`` raises
  ``NotImplementedError``) and each of its methods (``parameters``,
  ``uniform``, ``type:Block``) gives the ``type:Block`` split on this model,
  so this row compares each engine with its best automatic partition;
* ``deepspeed-pipe``: the same layer list as a DeepSpeed ``PipelineModule``
  under DeepSpeed's ``PipelineEngine`` (only where DeepSpeed imports, see
  below);
* ``ddp``: the whole model on each rank under torch DDP, half the
  micro-batches per rank (gradient accumulation with ``no_sync``).

Each round runs every runner once, in rotating order; a run does
``--warmup`` untimed steps, then ``--steps`` timed ones, and its time is the
median step time on rank 0. Reported: the median over rounds, ratios to
DeepSpeed's pipeline and to DDP, and dsrun's **measured bubble**: per stage,
the time spent in forward and backward passes over the time from the batch
start to its last pass (``engine.last_batch_timing``, which dsrun's engine
fills on every batch: no ``wall_clock_breakdown``, which neither engine has
on here), against the 1F1B ideal ``m / (m + s - 1)`` for ``m`` micro-batches
and ``s`` stages (equal stages and free communication assumed by the ideal).

Every runner starts from the same weights (those of ``whole_model()``,
copied into the pipeline stages' layers before the engine is built) and
trains on the same micro-batches, so each step's loss (the mean over the
global batch) must agree across runners: the bench compares them
(bench/losscheck.py, relative tolerance 1e-4), prints the verdict and exits
non-zero naming the runners that differ.

DeepSpeed runs from the interpreter ``--ds-python`` (default
``bench/.venv-ds/bin/python``), set up as bench/train_throughput.py's
docstring says; without it the table says "DeepSpeed not installed".
"""

from __future__ import annotations

import argparse
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

import losscheck  # noqa: E402 - the runners' losses compared
import train_throughput as tt  # noqa: E402 - the bench GPT's block

DS_PYTHON = tt.DS_PYTHON
VOCAB, WIDTH, LAYERS, HEADS, SEQ = 8192, 512, 6, 8, 128
LR = 3e-4
STAGES = 2

# ----------------------------------------------------------------- the model (rank side)


def layer_classes() -> dict[str, Any]:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class AddPosition(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wpe = nn.Embedding(SEQ, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.wpe.weight[: x.shape[1]]

    Block = tt.block_class(WIDTH, HEADS)

    def logits(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
        return x @ embedding.weight.t()

    def lm_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1))

    return {"AddPosition": AddPosition, "Block": Block, "logits": logits, "lm_loss": lm_loss}


def pipeline_layers(pipe: Any) -> list[Any]:
    """The GPT as a layer list, with ``pipe`` = ``dsrun.pipe`` or ``deepspeed.pipe``."""
    import torch.nn as nn

    c = layer_classes()
    return [pipe.TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH),
            pipe.LayerSpec(c["AddPosition"]),
            *[pipe.LayerSpec(c["Block"]) for _ in range(LAYERS)],
            pipe.LayerSpec(nn.LayerNorm, WIDTH),
            pipe.TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=c["logits"])]


def whole_model() -> Any:
    """The same layers in one module (for DDP); returns the loss."""
    import torch
    import torch.nn as nn

    c = layer_classes()

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(VOCAB, WIDTH)
            self.pos = c["AddPosition"]()
            self.blocks = nn.Sequential(*[c["Block"]() for _ in range(LAYERS)])
            self.ln_f = nn.LayerNorm(WIDTH)

        def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = self.ln_f(self.blocks(self.pos(self.wte(tokens))))
            return c["lm_loss"](c["logits"](self.wte, x), targets)

    torch.manual_seed(0)
    return GPT()


def load_reference(module: Any) -> None:
    """Give a pipeline module (dsrun's or DeepSpeed's: layer ``i`` is the
    submodule named ``str(i)``, the tied embedding ``tied_modules["embed"]``)
    the weights ``whole_model()`` starts with, for the layers this stage holds,
    so that every runner starts from the same weights."""
    import torch

    ref = whole_model()
    layers = {1: ref.pos, **{2 + i: block for i, block in enumerate(ref.blocks)},
              2 + LAYERS: ref.ln_f}
    with torch.no_grad():
        for index, layer in layers.items():
            mine = getattr(module, str(index), None)
            if mine is not None:
                mine.load_state_dict(layer.state_dict())
        if "embed" in module.tied_modules:
            module.tied_modules["embed"].load_state_dict(ref.wte.state_dict())


# ------------------------------------------------------------------- runners (rank side)

Step = Callable[[list[Any]], Any]  # micro-batches -> the step's mean loss


def _config(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": args.micro_batch,
            "gradient_accumulation_steps": args.micro_batches, "steps_per_print": 10**9,
            "gradient_clipping": 0.0,  # as DDP: no clipping
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0,
                                                      "torch_adam": True}}, **extra}


def _dsrun_pipe(args: argparse.Namespace, method: str = "type:Block") -> tuple[Step, Any]:
    import torch

    import dsrun
    import dsrun.pipe

    c = layer_classes()
    example = torch.zeros(args.micro_batch, SEQ, dtype=torch.long)  # shapes only
    module = dsrun.pipe.PipelineModule(pipeline_layers(dsrun.pipe), num_stages=STAGES,
                                       loss_fn=c["lm_loss"], partition_method=method,
                                       example_inputs=example, example_labels=example)
    load_reference(module)
    engine, _, _, _ = dsrun.initialize(model=module, config=_config(args))

    def step(micro: list[Any]) -> Any:
        return engine.train_batch(iter(micro))
    return step, engine


def _dsrun_pipe_flops(args: argparse.Namespace) -> tuple[Step, Any]:
    return _dsrun_pipe(args, "flops")


def _deepspeed_pipe(args: argparse.Namespace) -> tuple[Step, Any]:
    import deepspeed
    import deepspeed.pipe

    c = layer_classes()
    deepspeed.init_distributed()
    module = deepspeed.pipe.PipelineModule(pipeline_layers(deepspeed.pipe), num_stages=STAGES,
                                           loss_fn=c["lm_loss"], partition_method="type:Block")
    load_reference(module)
    engine, _, _, _ = deepspeed.initialize(model=module, config=_config(args),
                                           model_parameters=module.parameters())

    def step(micro: list[Any]) -> Any:
        return engine.train_batch(iter(micro))
    return step, None


def _ddp(args: argparse.Namespace) -> tuple[Step, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(whole_model())
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.0)
    rank, world = dist.get_rank(), dist.get_world_size()

    def step(micro: list[Any]) -> Any:
        mine = micro[rank::world]  # this rank's half of the global batch
        total = torch.zeros(())
        for i, (tokens, targets) in enumerate(mine):
            last = i == len(mine) - 1
            with (ddp.no_sync() if not last else torch.enable_grad()):
                loss = ddp(tokens, targets) / len(mine)
                loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total  # this rank's half: worker() averages the ranks' after the timer
    return step, None


RUNNERS: dict[str, Callable[[argparse.Namespace], tuple[Step, Any]]] = {
    "dsrun-pipe": _dsrun_pipe, "dsrun-flops": _dsrun_pipe_flops,
    "deepspeed-pipe": _deepspeed_pipe, "ddp": _ddp}
PARTITIONS = {"dsrun-pipe": "type:Block", "dsrun-flops": "flops",
              "deepspeed-pipe": "type:Block"}
NEEDS_DEEPSPEED = {"deepspeed-pipe"}


def worker(args: argparse.Namespace) -> None:
    """One rank: build, warm up, time, write facts to ``args.out``."""
    import torch
    import torch.distributed as dist

    import dsrun

    dsrun.init_distributed()
    rank = dist.get_rank()
    step, engine = RUNNERS[args.worker](args)
    gen = torch.Generator().manual_seed(1)
    micro = []
    for _ in range(args.micro_batches):
        tokens = torch.randint(0, VOCAB, (args.micro_batch, SEQ + 1), generator=gen)
        micro.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    losses = [global_loss(args.worker, step(micro)) for _ in range(args.warmup)]
    dist.barrier()
    times, timings = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = step(micro)
        times.append(time.perf_counter() - start)
        losses.append(global_loss(args.worker, loss))  # outside the timed step
        if engine is not None:
            timings.append(engine.last_batch_timing)
    dist.barrier()
    parts = list(engine.module.parts) if engine is not None else None
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "times": times, "timings": timings, "threads": torch.get_num_threads(),
         "parts": parts, "losses": losses}))


def global_loss(runner: str, loss: Any) -> float:
    """The step's mean loss over the global batch: a pipeline engine returns
    it on every rank; DDP's ranks each hold their half's, averaged here."""
    import torch.distributed as dist

    if runner == "ddp":
        loss = loss.clone()
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    return float(loss)


# -------------------------------------------------------------- orchestration (driver)


def deepspeed_python(path: Path) -> str | None:
    if not path.exists():
        return None
    probe = subprocess.run([str(path), "-c", "import deepspeed, dsrun"], capture_output=True,
                           env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return str(path) if probe.returncode == 0 else None


def run_once(python: str, runner: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out:
        bind = ["--bind_cores_to_rank"] if args.bind_cores else []
        argv = [python, "-m", "dsrun.launcher.cli", "--cpu", "--num_gpus", str(STAGES), *bind,
                __file__, "--worker", runner, "--out", out, "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--micro-batch", str(args.micro_batch),
                "--micro-batches", str(args.micro_batches)]
        env = {**os.environ, "DS_ACCELERATOR": "cpu"}
        res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(ROOT))
        if res.returncode != 0:
            raise SystemExit(f"{runner} failed ({res.returncode}):\n{res.stderr[-3000:]}"
                             f"\n{res.stdout[-3000:]}")
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]


def bubble(rounds: list[list[dict[str, Any]]]) -> list[tuple[float, float, float]]:
    """Per stage, medians over all timed steps: busy fraction, pipeline
    seconds, seconds in forward and backward passes."""
    out = []
    for rank in range(STAGES):
        steps = [t for r in rounds for t in r[rank]["timings"]]
        out.append((statistics.median(t["compute_s"] / t["pipeline_s"] for t in steps),
                    statistics.median(t["pipeline_s"] for t in steps),
                    statistics.median(t["compute_s"] for t in steps)))
    return out


def report(runs: dict[str, list[list[dict[str, Any]]]], missing: list[str],
           args: argparse.Namespace) -> dict[str, Any]:
    table = {name: statistics.median(statistics.median(r[0]["times"]) for r in rounds)
             for name, rounds in runs.items()}
    m = args.micro_batches
    print(f"bench GPT 23.2M params (tied embedding), fp32 AdamW, {STAGES} CPU ranks (gloo); "
          f"{m} micro-batches of {args.micro_batch}x{SEQ} tokens per step; {args.rounds} "
          f"interleaved round(s) of {args.steps} timed steps"
          + ("; every rank bound to its own core (--bind_cores_to_rank)" if args.bind_cores
             else ""))
    print(f"{'runner':<16}{'partition':>12}{'s/step':>9}{'vs DeepSpeed pipe':>19}"
          f"{'vs DDP':>9}")
    for name, seconds in table.items():
        ds = table.get("deepspeed-pipe")
        ddp = table.get("ddp")
        parts = runs[name][0][0].get("parts")
        where = PARTITIONS.get(name, "-") if parts is None else \
            f"{'|'.join(str(p) for p in parts)}"
        print(f"{name:<16}{where:>12}{seconds:>9.3f}"
              f"{(f'{seconds / ds:.3f}x' if ds else '-'):>19}"
              f"{(f'{seconds / ddp:.3f}x' if ddp else '-'):>9}")
    for name in missing:
        print(f"{name:<16}  DeepSpeed not installed (see this file's docstring)")
    print("(partition: layer boundaries; DeepSpeed's partition methods 'parameters', "
          "'uniform' and 'type:Block' all give 0|5|10 here, and it has no work-based one)")
    result: dict[str, Any] = {"s_per_step": table, "missing": missing, "bubble": {}}
    ideal = m / (m + STAGES - 1)
    for name in ("dsrun-pipe", "dsrun-flops"):
        if name not in runs:
            continue
        stages = bubble(runs[name])
        result["bubble"][name] = {"ideal_busy": ideal, "stages": stages}
        for stage, (busy, seconds, compute) in enumerate(stages):
            print(f"{name} stage {stage}: busy {busy:.1%} of the {seconds:.3f} s pipeline "
                  f"(bubble {1 - busy:.1%}; {compute:.3f} s in passes); 1F1B ideal busy "
                  f"m/(m+s-1) = {ideal:.1%}")
        bound = max(compute for _, _, compute in stages)
        print(f"{name}: the slowest stage computes {bound:.3f} s per step (median): no "
              f"schedule of this partition takes less; the step takes "
              f"{table[name] / bound:.3f}x that (the rest: the first forward and "
              "the last backward of the other stage, the tied-gradient sum, the optimizer "
              "step)")
        result["bubble"][name]["slowest_stage_compute_s"] = bound
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument("--ds-python", default=str(DS_PYTHON))
    parser.add_argument("--bind-cores", action="store_true",
                        help="start every runner with dsrun --bind_cores_to_rank")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    names = [n for n in args.runners.split(",") if n]
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        raise SystemExit(f"unknown runner(s) {unknown}; choose from {list(RUNNERS)}")
    ds_python = deepspeed_python(Path(args.ds_python))
    missing = [n for n in names if n in NEEDS_DEEPSPEED and ds_python is None]
    names = [n for n in names if n not in missing]
    runs: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in names}
    for i in range(args.rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            python = ds_python if name in NEEDS_DEEPSPEED else sys.executable
            runs[name].append(run_once(python or sys.executable, name, args))
            print(f"round {i + 1} {name}: {statistics.median(runs[name][-1][0]['times']):.3f}"
                  f" s/step ({runs[name][-1][0]['threads']} thread(s) per rank)",
                  file=sys.stderr, flush=True)
    result = report(runs, missing, args)
    result["loss_mismatches"] = losscheck.check(
        {f"{name} round {i + 1}": ranks[0]["losses"] for name, rounds in runs.items()
         for i, ranks in enumerate(rounds)}, "losses (global batch mean, every step)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    losscheck.exit_on(result["loss_mismatches"])


if __name__ == "__main__":
    main()
