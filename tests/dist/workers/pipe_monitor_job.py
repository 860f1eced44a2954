"""Monitored pipeline training for tests/dist/test_pipe_monitor.py.

Usage: ``dsrun --cpu --num_gpus N pipe_monitor_job.py OUT_DIR PHASE...``.
Each phase builds a 2-stage :class:`PipelineModule` (``N / 2`` replicas)
with ``csv_monitor`` (job name = the phase) and ``wall_clock_breakdown``,
trains ``STEPS`` batches with ``train_batch``, timing each call, then runs
one ``eval_batch``. Every rank also writes a custom event through
``engine.monitor.write_events`` (only rank 0's may reach the files). Rank
0 (the first stage) writes ``OUT_DIR/<phase>.json``: per step the loss
``train_batch`` returned, ``global_samples``, the call's wall time, the
learning rates, the loss scale and ``get_global_grad_norm()``; and the
eval loss.

The test imports this file for the phase definitions: data is a pure
function of (phase, step, replica, micro-batch), so it can train the same
layers in one process for reference gradient norms.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from dsrun.pipe import LayerSpec, PipelineModule, TiedLayerSpec

STEPS, PRINT_EVERY = 12, 4
VOCAB, DIM, SEQ, TOKEN_BATCH = 64, 256, 16, 8
WIDE, WIDE_BATCH, CLASSES = 768, 48, 10
_TEACHER = torch.randn(WIDE, CLASSES, generator=torch.Generator().manual_seed(7))


class Wide(nn.Module):
    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(fan_in, fan_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Mixer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(h)))


def logits(embedding: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    return h @ embedding.weight.t()


def token_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1))


def wide_layers() -> list[Any]:
    """Enough work per micro-batch (as in the other phases) that a step is
    long against what is not in its parts: the engine's bookkeeping between
    instructions, and the first breakdown's writing (it creates the files),
    which counts in the next interval."""
    return [LayerSpec(Wide, WIDE, WIDE), LayerSpec(Wide, WIDE, WIDE),
            LayerSpec(Wide, WIDE, WIDE), LayerSpec(nn.Linear, WIDE, CLASSES)]


def tied_layers() -> list[Any]:
    return [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM), LayerSpec(Mixer, DIM),
            LayerSpec(Mixer, DIM), LayerSpec(nn.LayerNorm, DIM),
            TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=logits)]


def wide_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(WIDE_BATCH, WIDE, generator=torch.Generator().manual_seed(seed))
    return x, (x @ _TEACHER).argmax(dim=1)


def token_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, seq) int64 token ids: the engine counts their tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, VOCAB, (TOKEN_BATCH,), generator=g)]
    for _ in range(SEQ):
        tokens.append((3 * tokens[-1] + 1) % VOCAB)
    seq = torch.stack(tokens, dim=1)
    return seq[:, :-1], seq[:, 1:]


@dataclass(frozen=True)
class Phase:
    layers: Callable[[], list[Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    data: Callable[[int], Any]
    micro_batches: int = 4
    clip: float = 0.0
    zero: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def config(self, out: Path, name: str) -> dict[str, Any]:
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": self.micro_batches,
            "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
            "gradient_clipping": self.clip, "steps_per_print": PRINT_EVERY,
            "wall_clock_breakdown": True, "zero_optimization": {"stage": self.zero},
            "csv_monitor": {"enabled": True, "output_path": str(out), "job_name": name},
            **self.extra}
        if "flops_profiler" in config:  # one report per stage: NAME.flops.stageS.txt
            config["flops_profiler"] = {**config["flops_profiler"],
                                        "output_file": str(out / f"{name}.flops.txt")}
        return config

    def batch(self, step: int, replica: int) -> list[Any]:
        return [self.data(10_000 * step + 100 * replica + k) for k in range(self.micro_batches)]


WARMUP = {"scheduler": {"type": "WarmupLR", "params": {
    "warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 2 * STEPS}}}

PHASES = {
    # plain SGD, no clipping: the gradient norm is measured for the monitor
    # alone, and the test recomputes it in one process
    "wide": Phase(wide_layers, F.cross_entropy, wide_batch),
    # tied weights across the stages, token ids (tokens/s), clipping
    # (and a learning rate that changes every step)
    "tied": Phase(tied_layers, token_loss, token_batch, clip=0.5, extra=WARMUP),
    "tied-zero1": Phase(tied_layers, token_loss, token_batch, clip=0.5, zero=1, extra=WARMUP),
    # the loss scale halves on overflow and doubles every 2 good steps
    "fp16": Phase(wide_layers, F.cross_entropy, wide_batch, extra={
        "fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8,
                 "loss_scale_window": 2}}),
    # the flops profiler on every stage's first replica (no breakdown lines)
    "wide-flops": Phase(wide_layers, F.cross_entropy, wide_batch, extra={
        "wall_clock_breakdown": False,
        "flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": 1}}),
}


def build(name: str, stages: int) -> PipelineModule:
    phase = PHASES[name]
    return PipelineModule(layers=phase.layers(), num_stages=stages, loss_fn=phase.loss_fn,
                          seed_layers=True)


def train(out: Path, name: str) -> None:
    import torch.distributed as dist

    import dsrun

    phase = PHASES[name]
    engine, _, _, _ = dsrun.initialize(model=build(name, 2), config=phase.config(out, name))
    replica = engine.grid.data_parallel_id
    rows = []
    for step in range(STEPS):
        data = iter(phase.batch(step, replica))
        start = time.perf_counter()
        loss = engine.train_batch(data)
        seconds = time.perf_counter() - start
        norm = engine.get_global_grad_norm()
        engine.monitor.write_events([("Custom/writer_rank", dist.get_rank(),
                                      engine.global_samples)])
        rows.append({"loss": float(loss), "samples": engine.global_samples,
                     "seconds": seconds, "lr": engine.get_lr(),
                     "loss_scale": float(engine.precision.loss_scale),
                     "grad_norm": None if norm is None else float(norm)})
    eval_loss = float(engine.eval_batch(iter(phase.batch(STEPS, replica))))
    if dist.get_rank() == 0:
        (out / f"{name}.json").write_text(json.dumps(
            {"rows": rows, "eval_loss": eval_loss, "stage": engine.stage_id,
             "train_batch_size": engine.train_batch_size(),
             "monitor_enabled": engine.monitor.enabled}))


def main(out: Path, names: list[str]) -> None:
    for name in names:
        train(out, name)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
