"""Pipeline parity cases: trains each case in one dsrun job and saves what it saw.

Usage: ``dsrun --cpu --num_gpus N pipe_cases.py OUT_DIR CASE...``. For each
case, every rank trains ``STEPS`` batches with ``train_batch`` and saves
``OUT_DIR/<case>-rank<R>.pt``: the losses train_batch returned, its
stage's parameters by name after the last step, an ``eval_batch`` loss and
the output of ``engine(inputs)`` (last stage). The test
(tests/dist/test_pipe_parity.py) imports this file for the case
definitions and trains the reference - the same layers as a one-stage
PipelineModule in one process, the same micro-batches - and compares.

A case with ``aux`` uses :class:`AuxPipelineModule`, whose
``get_additional_losses()`` reports two values of each forward's output;
every rank saves what ``engine.get_additional_losses()`` gave after each
batch (``None`` for the other cases).

Data is a pure function of (case, step, replica, micro-batch): replica
``r`` trains on its own micro-batches; the reference accumulates all
replicas' micro-batches, each loss divided by their total count.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from dsrun.pipe import LayerSpec, PipelineModule, TiedLayerSpec

STEPS = 10
VOCAB, DIM = 11, 8


class Affine(nn.Module):
    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(fan_in, fan_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


class Mixer(nn.Module):
    """A residual MLP over the last dimension (works for any sequence length)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(h)))


class Split(nn.Module):
    """Starts a (hidden, mask) pair: the mask is an int64 tensor (no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), (x[:, :1] > 0).long()


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(10, 10)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h, mask = pair
        keep = mask.to(h.dtype)
        return keep * torch.tanh(self.linear(h)) + (1 - keep) * h, mask


class Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(10, 5)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.linear(pair[0])


def logits(embedding: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    return h @ embedding.weight.t()


def token_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1))


class AuxPipelineModule(PipelineModule):
    """Reports DeepSpeed's additional losses: the mean square and the mean
    absolute value of its last forward's output (on the last stage, the
    logits; other stages' answers are not used)."""

    def forward(self, x: Any) -> Any:
        out = super().forward(x)
        self.aux = OrderedDict(square=out.detach().pow(2).mean(), size=out.detach().abs().mean())
        return out

    def get_additional_losses(self) -> Any:
        return getattr(self, "aux", None)


def mlp_layers() -> list[Any]:
    return [LayerSpec(Affine, 6, 12), LayerSpec(Affine, 12, 9), double,
            LayerSpec(nn.Linear, 9, 9), nn.Tanh(), LayerSpec(nn.Linear, 9, 5)]


def inplace_layers() -> list[Any]:
    """Stage 1 (boundaries 0|4|7) starts with an in-place ReLU on the activation it receives."""
    return [LayerSpec(Affine, 6, 12), LayerSpec(Affine, 12, 9), double,
            nn.ReLU(inplace=True), LayerSpec(nn.Linear, 9, 9), nn.Tanh(),
            LayerSpec(nn.Linear, 9, 5)]


def tied_layers() -> list[Any]:
    return [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM), LayerSpec(Mixer, DIM),
            LayerSpec(Mixer, DIM), LayerSpec(nn.LayerNorm, DIM),
            TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=logits)]


def tuple_layers() -> list[Any]:
    return [LayerSpec(Split), LayerSpec(Masked), LayerSpec(Masked), LayerSpec(Join)]


_TEACHER = torch.randn(6, 5, generator=torch.Generator().manual_seed(7))


def mlp_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and the class a fixed linear teacher gives them (learnable)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=g)
    return x, (x @ _TEACHER).argmax(dim=1)


def token_batch(seed: int, varlen: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences where each token determines the next (learnable); with
    ``varlen`` the batch size and length change from micro-batch to micro-batch."""
    g = torch.Generator().manual_seed(seed)
    batch, length = (int(torch.randint(1, 5, (), generator=g)),
                     int(torch.randint(2, 9, (), generator=g))) if varlen else (3, 6)
    tokens = [torch.randint(0, VOCAB, (batch,), generator=g)]
    for _ in range(length):
        tokens.append((3 * tokens[-1] + 1) % VOCAB)
    seq = torch.stack(tokens, dim=1)
    return seq[:, :-1], seq[:, 1:]


@dataclass(frozen=True)
class Case:
    layers: Callable[[], list[Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    data: Callable[[int], Any]
    micro_batches: int = 4
    clip: float = 0.5
    zero: int = 0
    bf16: bool = False
    module: dict[str, Any] = field(default_factory=dict)
    pipeline: dict[str, Any] = field(default_factory=dict)  # the config's section
    aux: bool = False  # built as an AuxPipelineModule

    def config(self) -> dict[str, Any]:
        return {"train_micro_batch_size_per_gpu": 4, "pipeline": self.pipeline,
                "gradient_accumulation_steps": self.micro_batches,
                "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
                "gradient_clipping": self.clip, "steps_per_print": 1000,
                "zero_optimization": {"stage": self.zero}, "bf16": {"enabled": self.bf16}}

    def batch(self, step: int, replica: int) -> list[Any]:
        return [self.data(10_000 * step + 100 * replica + k) for k in range(self.micro_batches)]

    def eval_data(self) -> list[Any]:
        return [self.data(99_000 + k) for k in range(self.micro_batches)]


CASES = {
    "mlp": Case(mlp_layers, F.cross_entropy, mlp_batch),
    "mlp-noclip": Case(mlp_layers, F.cross_entropy, mlp_batch, clip=0.0),
    "mlp-3mb": Case(mlp_layers, F.cross_entropy, mlp_batch, micro_batches=3, clip=0.0),
    "mlp-ckpt": Case(mlp_layers, F.cross_entropy, mlp_batch,
                     module={"activation_checkpoint_interval": 1}),
    # torch's reentrant checkpoint from the config: the first stage's inputs must
    # require grad, or its layers would get no gradient (DeepSpeed does the same)
    "mlp-reentrant": Case(mlp_layers, F.cross_entropy, mlp_batch,
                          pipeline={"activation_checkpoint_interval": 1, "use_reentrant": True}),
    "inplace": Case(inplace_layers, F.cross_entropy, mlp_batch,
                    module={"partition_method": [0, 3, 7]}),
    "mlp-zero1": Case(mlp_layers, F.cross_entropy, mlp_batch, zero=1),
    "mlp-zero2": Case(mlp_layers, F.cross_entropy, mlp_batch, zero=2),
    "mlp-aux": Case(mlp_layers, F.cross_entropy, mlp_batch, aux=True),
    "mlp-bf16": Case(mlp_layers, F.cross_entropy, mlp_batch, bf16=True),
    "tied": Case(tied_layers, token_loss, token_batch),
    "tied-zero1": Case(tied_layers, token_loss, token_batch, zero=1),
    "varlen": Case(tied_layers, token_loss, lambda seed: token_batch(seed, varlen=True),
                   micro_batches=5, clip=0.0, module={"partition_method": [0, 2, 5]}),
    "tuple": Case(tuple_layers, F.cross_entropy, mlp_batch,
                  module={"partition_method": "uniform"}),
    # balanced by counted work: layers 0-1 | 2-5 ("parameters" gives 0-2 | 3-5)
    "mlp-flops": Case(mlp_layers, F.cross_entropy, mlp_batch,
                      module={"partition_method": "flops", "example_inputs": mlp_batch(0)[0],
                              "example_labels": mlp_batch(0)[1]}),
}


def build(name: str, stages: int) -> PipelineModule:
    case = CASES[name]
    options = dict(case.module)
    if stages == 1:  # the reference: one stage, no checkpointing
        options = {}
    cls = AuxPipelineModule if case.aux else PipelineModule
    return cls(layers=case.layers(), num_stages=stages, loss_fn=case.loss_fn,
               seed_layers=True, **options)


def main(out: Path, names: list[str]) -> None:
    import torch.distributed as dist

    import dsrun

    dsrun.init_distributed()
    rank = dist.get_rank()
    for name in names:
        case = CASES[name]
        engine, _, _, _ = dsrun.initialize(model=build(name, 2), config=case.config())
        replica = engine.grid.data_parallel_id
        losses, additional = [], []
        for step in range(STEPS):
            losses.append(float(engine.train_batch(iter(case.batch(step, replica)))))
            extra = engine.get_additional_losses()
            assert extra is engine.agg_additional_losses  # DeepSpeed's attribute
            additional.append(None if extra is None else
                              {k: (float(v), v.dtype, tuple(v.shape)) for k, v in extra.items()})
        eval_loss = float(engine.eval_batch(iter(case.eval_data())))
        local = engine.eval_batch(iter(case.eval_data()), bcast_loss=False)  # last stage only
        output = engine(case.eval_data()[0][0])
        torch.save({"losses": losses, "eval": eval_loss, "stage": engine.stage_id,
                    "additional": additional,
                    "eval_local": None if local is None else float(local),
                    "replica": replica, "forward": output, "parts": engine.module.parts,
                    "params": {n: p.detach().clone() for n, p in
                               engine.module.named_parameters()}},
                   out / f"{name}-rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
