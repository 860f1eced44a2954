"""What monitoring costs per optimizer step: dsrun's engine with and without monitors.

    .venv/bin/python bench/monitor_overhead.py [--rounds 4] [--steps 30] [--warmup 5]
        [--pipeline]

Starts ``dsrun --cpu --num_gpus 2`` on itself (2 gloo ranks, OMP_NUM_THREADS=1)
and trains one model (token embedding + 4 tanh layers of width 256 over
8 x 64 tokens per rank, fp32, AdamW, ZeRO stage 0, no gradient clipping:
``"gradient_clipping": 0``, so that the ``off`` baseline computes no gradient
norm and the norm the monitor needs counts as its cost) under each setting:

* ``off``: no monitor section, no breakdown;
* ``csv``: ``csv_monitor`` (one all-reduce of the loss statistics per step,
  ~12 CSV rows appended and flushed);
* ``csv+breakdown``: plus ``wall_clock_breakdown`` (timers, a log line and
  the breakdown events every ``steps_per_print`` = 10 steps);
* ``csv+tb+breakdown``: plus ``tensorboard`` (when the package is installed).

With ``--pipeline`` the same layers are a 2-stage ``PipelineModule`` (one
per rank) trained with ``train_batch`` over 4 micro-batches: the monitor
then adds, without clipping, one scalar all-reduce for the norm over all
stages, and the breakdown times every schedule instruction.

Each round runs every setting once in rotating order (interleaved, so the
shared machine's noise hits all alike); a run does ``--warmup`` untimed steps
then ``--steps`` timed ones, and its figure is the median step time on rank 0
(script-side wall clock around forward/backward/step, or train_batch).
Printed: the median over rounds per setting and its ratio to ``off``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VOCAB, SEQ, MICRO, WIDTH = 1024, 64, 8, 256
PIPE_MICRO_BATCHES = 4


def settings(out: str) -> dict[str, dict[str, Any]]:
    csv_section = {"csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv"}}
    chosen = {"off": {}, "csv": csv_section,
              "csv+breakdown": {**csv_section, "wall_clock_breakdown": True}}
    if importlib.util.find_spec("tensorboard") is not None:
        chosen["csv+tb+breakdown"] = {
            **csv_section, "wall_clock_breakdown": True,
            "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb"}}
    return chosen


def worker(args: argparse.Namespace) -> None:
    import logging

    import torch
    import torch.distributed as dist

    import dsrun

    logging.getLogger("dsrun").setLevel(logging.WARNING)  # no per-step lines in the figures

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, WIDTH)
            self.layers = torch.nn.Sequential(*[torch.nn.Sequential(
                torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(4)])
            self.head = torch.nn.Linear(WIDTH, 1)

        def forward(self, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            out = self.head(self.layers(self.embed(tokens)).mean(dim=1)).squeeze(-1)
            return torch.nn.functional.mse_loss(out, target)

    if args.pipeline:
        return pipeline_worker(args)
    chosen = settings(args.out)
    names = list(chosen)
    times: dict[str, list[float]] = {name: [] for name in names}
    gen = torch.Generator().manual_seed(dist.get_rank())
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            torch.manual_seed(0)
            config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10,
                      "gradient_clipping": 0.0,  # no norm in the baseline (docstring)
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **chosen[name]}
            engine, *_ = dsrun.initialize(model=Model(), config=config)
            steps = []
            for step in range(args.warmup + args.steps):
                tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
                target = torch.randn(MICRO, generator=gen)
                start = time.perf_counter()
                engine.backward(engine(tokens, target))
                engine.step()
                if step >= args.warmup:
                    steps.append(time.perf_counter() - start)
            engine.monitor.close()
            times[name].append(statistics.median(steps))
    if dist.get_rank() == 0:
        Path(args.out, "times.json").write_text(json.dumps(times))


def pipeline_worker(args: argparse.Namespace) -> None:
    import logging

    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import dsrun
    from dsrun.pipe import LayerSpec, PipelineModule

    logging.getLogger("dsrun").setLevel(logging.WARNING)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(WIDTH, WIDTH)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.linear(h))

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(WIDTH, 1)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.linear(h.mean(dim=1)).squeeze(-1)

    def layers() -> list[Any]:
        return [LayerSpec(nn.Embedding, VOCAB, WIDTH), *[LayerSpec(Block) for _ in range(4)],
                LayerSpec(Head)]

    chosen = settings(args.out)
    names = list(chosen)
    times: dict[str, list[float]] = {name: [] for name in names}
    gen = torch.Generator().manual_seed(dist.get_rank())
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            module = PipelineModule(layers(), num_stages=2, partition_method="uniform",
                                    loss_fn=nn.functional.mse_loss, seed_layers=True)
            config = {"train_micro_batch_size_per_gpu": MICRO,
                      "gradient_accumulation_steps": PIPE_MICRO_BATCHES, "steps_per_print": 10,
                      "gradient_clipping": 0.0,  # no norm in the baseline (docstring)
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **chosen[name]}
            engine, *_ = dsrun.initialize(model=module, config=config)
            steps = []
            for step in range(args.warmup + args.steps):
                batch = [(torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen),
                          torch.randn(MICRO, generator=gen)) for _ in range(PIPE_MICRO_BATCHES)]
                start = time.perf_counter()
                engine.train_batch(iter(batch))
                if step >= args.warmup:
                    steps.append(time.perf_counter() - start)
            engine.monitor.close()
            times[name].append(statistics.median(steps))
    if dist.get_rank() == 0:
        Path(args.out, "times.json").write_text(json.dumps(times))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--pipeline", action="store_true",
                        help="2 pipeline stages (train_batch) instead of 2 replicas")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, "-m", "dsrun.launcher.cli", "--cpu", "--num_gpus", "2",
                "--env", "OMP_NUM_THREADS=1", __file__, "--worker", "--out", out,
                "--rounds", str(args.rounds), "--steps", str(args.steps),
                "--warmup", str(args.warmup)] + (["--pipeline"] if args.pipeline else [])
        res = subprocess.run(argv, cwd=str(ROOT), capture_output=True, text=True)
        if res.returncode != 0:
            print(res.stdout[-2000:], res.stderr[-4000:], sep="\n")
            return res.returncode
        times = json.loads(Path(out, "times.json").read_text())
    base = statistics.median(times["off"])
    layout = "2 pipeline stages" if args.pipeline else "2 data-parallel ranks"
    print(f"{layout} on 2 CPU ranks (gloo), {args.rounds} rounds x {args.steps} steps; "
          "median of the per-run median step time on rank 0")
    print(f"{'setting':<20}{'ms/step':>10}{'vs off':>10}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<20}{1000 * median:>10.2f}{median / base:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
