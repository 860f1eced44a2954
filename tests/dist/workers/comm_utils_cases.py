"""Worker for test_comm_utils_dist: on 2 gloo ranks, DeepSpeed's
``ReduceOp`` in ``deepspeed.comm``'s reductions, the norm helpers of
``deepspeed.runtime.utils`` with an mpu whose model-parallel group is both
ranks (each rank holds a replicated parameter and its half of a
tensor-parallel one), and ``PartitionedTensor`` split and gathered back, and the members of groups
a rank is not in.
Writes ``OUT/rankR.json``: what each rank computed and what it should be."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from clip_mpu import Mpu  # the sibling worker's: the world as the model-parallel group

import dsrun
from dsrun import comm
from dsrun.comm import pg_utils
from dsrun.comm.reduce_op import ReduceOp
from dsrun.runtime.utils import (
    PartitionedTensor,
    get_flattened_grad_norm,
    get_global_norm_of_tensors,
    get_grad_zeros,
    get_weight_norm,
)


def reductions() -> dict[str, Any]:
    rank = dist.get_rank()
    got = {}
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT):
        t = torch.tensor([rank + 2.0, 5.0 - rank])
        comm.all_reduce(t, op=op)
        got[op.name] = t.tolist()
    out = torch.empty(1)
    comm.reduce_scatter_tensor(out, torch.tensor([rank + 1.0, 10.0 * (rank + 1)]),
                               op=ReduceOp.MAX)
    got["reduce_scatter_max"] = out.tolist()
    return {"got": got, "expected": {"SUM": [5.0, 9.0], "MAX": [3.0, 5.0], "MIN": [2.0, 4.0],
                                     "PRODUCT": [6.0, 20.0],
                                     "reduce_scatter_max": [[2.0], [20.0]][rank]}}


def whole(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    replicated, split = torch.randn(3, generator=gen), torch.randn(8, generator=gen)
    split[::3] = 0.0
    return replicated, split


def params(seed: int) -> list[torch.nn.Parameter]:
    """This rank's parameters: values and gradients both from ``whole``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rep, split = whole(seed)
    replicated = torch.nn.Parameter(rep.clone())
    part = torch.nn.Parameter(split.chunk(world)[rank].clone())
    part.tensor_model_parallel = True  # type: ignore[attr-defined]
    replicated.grad, part.grad = rep.clone(), part.detach().clone()
    return [replicated, part]


def norms() -> dict[str, Any]:
    got, expected = {}, {}
    rep, split = whole(5)
    every = torch.cat([rep, split])
    for p in (2.0, 1.0, math.inf):
        got[f"weight{p}"] = get_weight_norm(params(5), p, mpu=Mpu())
        expected[f"weight{p}"] = float(torch.linalg.vector_norm(every, p))
        # DeepSpeed's flattened norm counts every parameter it is given on
        # every rank: the replicated one twice over the group
        got[f"flat{p}"] = get_flattened_grad_norm(params(5), p, mpu=Mpu())
        twice = torch.cat([rep, rep, split])
        expected[f"flat{p}"] = float(torch.linalg.vector_norm(twice, p))
        got[f"tensors{p}"] = float(get_global_norm_of_tensors(
            [g.grad for g in params(5)], p, mpu=Mpu()))
        expected[f"tensors{p}"] = expected[f"flat{p}"]
    got["zeros"] = get_grad_zeros(params(5), mpu=Mpu())
    expected["zeros"] = float((every == 0).sum())
    return {"got": got, "expected": expected}


def partitioned() -> dict[str, Any]:
    rank = dist.get_rank()
    facts = {}
    for numel in (6, 7):  # an even and an uneven split over 2 ranks
        whole_tensor = torch.arange(float(numel)).reshape(1, numel) * 1.5
        part = PartitionedTensor(whole_tensor, dist.group.WORLD)
        rebuilt = PartitionedTensor.from_meta(part.to_meta(), part.data(), dist.group.WORLD,
                                              device="cpu")
        facts[str(numel)] = {
            "full": torch.equal(part.full(), whole_tensor),
            "rebuilt_full": torch.equal(rebuilt.full(), whole_tensor),
            "local": part.data().tolist(),
            "expected_local": whole_tensor.reshape(-1)[part.partition[rank]:
                                                       part.partition[rank + 1]].tolist(),
            "partition": part.partition,
        }
    return facts


def groups() -> dict[str, Any]:
    """get_all_ranks_from_group on members and non-members (DeepSpeed
    answers the members on every rank); inference_all_reduce on 2 ranks."""
    only0, only1, both = comm.new_group([0]), comm.new_group([1]), comm.new_group([0, 1])
    t = torch.tensor([dist.get_rank() + 1.0])
    returned = comm.inference_all_reduce(t)
    return {"only0": comm.get_all_ranks_from_group(only0),
            "only1": comm.get_all_ranks_from_group(only1),
            "both": comm.get_all_ranks_from_group(both),
            "world": comm.get_all_ranks_from_group(None),
            "inference_returned_tensor": returned is t, "inference_sum": t.tolist()}


def main() -> None:
    out = Path(sys.argv[1])
    dsrun.init_distributed()
    results = {"reductions": reductions(), "norms": norms(), "partitioned": partitioned(),
               "is_parallel": pg_utils.is_parallel(dist.group.WORLD), "groups": groups()}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
