"""Worker for test_clip_grad_norm_mpu: ``deepspeed.runtime.utils.clip_grad_norm_``
with an mpu whose model-parallel group is both ranks. Each rank holds a
replicated parameter (the same gradient everywhere) and its half of a
tensor-parallel one (``tensor_model_parallel``); the norm and the clipped
gradients must equal torch's on the whole (unsplit) model. Writes
``OUT/rankR.json``."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import dsrun
from dsrun.runtime.utils import clip_grad_norm_


class Mpu:
    def get_model_parallel_group(self) -> object:
        return dist.group.WORLD

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank()

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size()


def whole() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(3, generator=gen) * 2, torch.randn(8, generator=gen) * 2


def case(norm_type: float) -> dict[str, float | bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    replicated_grad, split_grad = whole()
    replicated = torch.nn.Parameter(torch.zeros(3))
    replicated.grad = replicated_grad.clone()
    part = split_grad.chunk(world)[rank]
    split = torch.nn.Parameter(torch.zeros_like(part))
    split.tensor_model_parallel = True  # type: ignore[attr-defined]
    split.grad = part.clone()
    norm = clip_grad_norm_([replicated, split], 1.0, norm_type=norm_type, mpu=Mpu())
    ref = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(8))]
    ref[0].grad, ref[1].grad = whole()
    expected = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type=norm_type)
    return {"norm": float(norm), "expected": float(expected),
            "grads_match": bool(torch.allclose(replicated.grad, ref[0].grad)
                                and torch.allclose(split.grad, ref[1].grad.chunk(world)[rank]))}


def main() -> None:
    out = Path(sys.argv[1])
    dsrun.init_distributed()
    results = {str(p): case(p) for p in (2.0, 1.0, math.inf)}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
