"""A monitored training job for tests/dist/test_monitor_job.py (one job, two phases).

Each phase trains through ``dsrun.initialize`` with ``csv_monitor`` and
``wall_clock_breakdown`` on (tensorboard too where installed) and rank 0
writes ``<out>/<phase>.json`` with what the script itself saw: per optimizer
step the global_samples, the mean of the micro-batch losses over all ranks,
and the wall time of the step measured around the engine calls.

* ``stage0``: ZeRO stage 0, 2 micro-steps per step, tokens counted from the
  (batch, seq) integer input; every rank also writes a custom event through
  ``engine.monitor.write_events`` (only rank 0's may reach the files).
* ``stage3``: ZeRO stage 3 (parameter gathers and gradient reductions go
  through the communication-wait hook), ``dsrun.seq_length`` from the config.

Usage: monitor_job.py --out DIR [--steps N]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import dsrun

VOCAB, SEQ, MICRO, WIDTH = 64, 32, 8, 192
CONFIG_SEQ_LENGTH = 7  # stage3: given in the config, so it wins over the input's 32


class TokenRegressor(torch.nn.Module):
    """Embedding, a few wide layers over every token, mean-pooled; forward
    returns the loss, so all of a micro-step's compute is inside the engine."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.Sequential(*[torch.nn.Sequential(
            torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(4)])
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        hidden = self.layers(self.embed(tokens)).mean(dim=1)
        return torch.nn.functional.mse_loss(self.head(hidden).squeeze(-1), target)


def micro_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
    return tokens, (tokens.float().mean(dim=1) / VOCAB - 0.5) * 4


def config(out: Path, phase: str, stage: int, gas: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
        "steps_per_print": 4, "wall_clock_breakdown": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_max_lr": 3e-3, "warmup_num_steps": 3, "total_num_steps": 40}},
        "zero_optimization": {"stage": stage},
        "csv_monitor": {"enabled": True, "output_path": str(out), "job_name": phase},
    }
    if phase == "stage0" and importlib.util.find_spec("tensorboard") is not None:
        cfg["tensorboard"] = {"enabled": True, "output_path": str(out / "tb"),
                              "job_name": phase}
    if phase == "stage3":
        cfg["dsrun"] = {"seq_length": CONFIG_SEQ_LENGTH}
    return cfg


def train(out: Path, phase: str, stage: int, gas: int, steps: int) -> None:
    torch.manual_seed(0)
    engine, *_ = dsrun.initialize(model=TokenRegressor(), config=config(out, phase, stage, gas))
    rows = []
    for step in range(steps):
        batches = [micro_batch(step, m) for m in range(gas)]
        losses = []
        start = time.perf_counter()
        for tokens, target in batches:
            loss = engine(tokens, target)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        seconds = time.perf_counter() - start
        mean = torch.tensor(sum(float(v) for v in losses) / len(losses), dtype=torch.float64)
        dist.all_reduce(mean)
        if phase == "stage0":  # every rank writes; only rank 0's event may land
            engine.monitor.write_events([("Custom/writer_rank", dist.get_rank(),
                                          engine.global_samples)])
        rows.append({"samples": engine.global_samples, "loss": mean.item() / dist.get_world_size(),
                     "seconds": seconds, "lr": engine.get_lr()})
    if dist.get_rank() == 0:
        (out / f"{phase}.json").write_text(json.dumps(
            {"rows": rows, "train_batch_size": engine.train_batch_size(),
             "monitor_enabled": engine.monitor.enabled}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    out = Path(args.out)
    train(out, "stage0", stage=0, gas=2, steps=args.steps)
    train(out, "stage3", stage=3, gas=1, steps=args.steps)


if __name__ == "__main__":
    main()
