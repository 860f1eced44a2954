"""``deepspeed.runtime.utils``'s helpers that scripts import:
set_random_seed, noop_context, move_to_device, partition_uniform and
partition_balanced, with DeepSpeed 0.19.8's results (its values for the
partitions were computed with DeepSpeed itself and agree on 3000 random
cases); the norm helpers against torch's norms (and DeepSpeed's rules:
what is skipped, -1 for an overflow); the small helpers, memory reports
and PartitionedTensor on one rank."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy
import pytest
import torch

from dsrun.runtime import utils as rt_utils


def test_set_random_seed_seeds_random_numpy_and_torch() -> None:
    draws = []
    for _ in range(2):
        rt_utils.set_random_seed(1234)
        draws.append((random.random(), numpy.random.rand(), torch.rand(1).item()))
    assert draws[0] == draws[1]
    rt_utils.set_random_seed(2**70 + 5)  # too large for numpy and torch: reduced, as DeepSpeed
    assert torch.initial_seed() == (2**70 + 5) % 2**63


def test_noop_context_does_nothing() -> None:
    with rt_utils.noop_context() as value:
        assert value is None


def test_move_to_device_through_containers() -> None:
    a, b = torch.ones(2), torch.zeros(1, dtype=torch.float64)
    moved = rt_utils.move_to_device({"x": [a, (b,)]}, "meta")
    assert moved["x"][0].device.type == "meta" and moved["x"][1][0].device.type == "meta"
    assert isinstance(moved["x"][1], tuple) and a.device.type == "cpu"
    # what criterion_func accepts moves in place: the caller's tensor itself
    c = torch.ones(3)
    assert rt_utils.move_to_device([c], torch.float64, lambda t: torch.is_tensor(t))[0] is c
    assert c.dtype == torch.float64


@pytest.mark.parametrize(("items", "parts", "bounds"), [
    (10, 4, [0, 3, 6, 8, 10]), (8, 4, [0, 2, 4, 6, 8]), (3, 3, [0, 1, 2, 3]),
    (2, 4, [0, 1, 2, 2, 2]), (0, 2, [0, 0, 0])])
def test_partition_uniform_as_deepspeed(items: int, parts: int, bounds: list[int]) -> None:
    assert rt_utils.partition_uniform(items, parts) == bounds


@pytest.mark.parametrize(("weights", "parts", "bounds"), [
    ([1, 2, 3, 4, 5, 6], 3, [0, 3, 5, 6]), ([5, 1, 1, 1, 1, 5], 2, [0, 3, 6]),
    ([3, 3, 3, 3], 3, [0, 2, 3, 4]), ([0, 0, 7, 1, 1, 1, 4], 3, [0, 3, 6, 7]),
    ([1, 1], 4, [0, 1, 2, 2, 2]), ([1, 9, 2, 5], 3, [0, 2, 3, 4])])
def test_partition_balanced_as_deepspeed(weights: list[int], parts: int,
                                         bounds: list[int]) -> None:
    """DeepSpeed's objective is the spread (heaviest minus lightest part),
    ties to the later cut: [1, 9, 2, 5] in 3 parts is 10 | 2 | 5, where
    dsrun's "flops" pipeline partitioning (the heaviest part) cuts 1 | 9 | 7."""
    assert rt_utils.partition_balanced(weights, parts) == bounds


def test_pipeline_cuts_as_deepspeed_except_flops_which_minimises_the_heaviest() -> None:
    from dsrun.runtime.pipe.partition import partition_balanced, partition_deepspeed

    assert partition_deepspeed([1, 9, 2, 5], 3) == (0, 2, 3, 4)  # = rt_utils' cut
    assert partition_balanced([1, 9, 2, 5], 3) == (0, 1, 2, 4)  # "flops": heaviest part 9


def test_deepspeed_import_path() -> None:
    from deepspeed.runtime.utils import (  # the alias finder
        move_to_device,
        noop_context,
        partition_balanced,
        partition_uniform,
        set_random_seed,
    )

    assert partition_uniform is rt_utils.partition_uniform
    assert (move_to_device, noop_context, partition_balanced, set_random_seed) == (
        rt_utils.move_to_device, rt_utils.noop_context, rt_utils.partition_balanced,
        rt_utils.set_random_seed)


# ------------------------------------------------------------ norms (one process; with an
# mpu over 2 ranks: tests/dist/test_comm_utils_dist.py)


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (7, 5, 11)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
        p.grad[::3] = 0.0
    return params


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


@pytest.mark.parametrize("norm_type", [2, 1, 3.0, math.inf])
def test_weight_and_gradient_norms_are_torchs(norm_type: float) -> None:
    params = _params(1)
    weights, grads = _flat(params), _flat([p.grad for p in params])
    expected_w = float(torch.linalg.vector_norm(weights, norm_type))
    expected_g = float(torch.linalg.vector_norm(grads, norm_type))
    assert rt_utils.get_weight_norm(params, norm_type) == pytest.approx(expected_w, rel=1e-6)
    assert rt_utils.get_weight_norm(params[0], norm_type) == pytest.approx(
        float(torch.linalg.vector_norm(params[0].detach(), norm_type)), rel=1e-6)
    assert rt_utils.get_flattened_grad_norm(params, norm_type) == pytest.approx(
        expected_g, rel=1e-6)
    total = rt_utils.get_global_norm_of_tensors([p.grad for p in params], norm_type)
    assert total.dtype == torch.float32 and total.dim() == 0
    assert float(total) == pytest.approx(expected_g, rel=1e-6)


def test_norm_helpers_skip_and_count_as_deepspeed() -> None:
    params = _params(2)
    params[1].ds_pipe_replicated = True  # a tied copy: counted on its owning stage only
    counted = _flat([params[0], params[2]])
    assert rt_utils.get_weight_norm(params) == pytest.approx(float(counted.norm()), rel=1e-6)
    no_grad = torch.nn.Parameter(torch.ones(4))  # gradient norms leave it out
    assert rt_utils.get_flattened_grad_norm([*params, no_grad]) == pytest.approx(
        float(_flat([p.grad for p in params]).norm()), rel=1e-6)
    assert rt_utils.get_grad_zeros(_params(3)) == 3 + 2 + 4  # every third element
    params[0].data[2] = float("nan")
    assert rt_utils.get_weight_norm(params) == -1  # DeepSpeed's mark of an overflow
    assert float(rt_utils.get_global_norm_of_tensors([p.data for p in params])) == -1.0


def test_flattened_grad_norm_mask_leaves_ranges_out_of_p_norms() -> None:
    params = _params(4)
    mask = [torch.tensor([[1, 3]]), torch.tensor([[0, 2], [4, 5]]),
            torch.empty(0, 2, dtype=torch.long)]
    kept = [p.grad.clone() for p in params]
    kept[0][1:3] = 0
    kept[1][0:2] = 0
    kept[1][4:5] = 0
    assert rt_utils.get_flattened_grad_norm(params, grad_norm_mask=mask) == pytest.approx(
        float(_flat(kept).norm()), rel=1e-6)
    # DeepSpeed's inf norm reads the whole gradients
    assert rt_utils.get_flattened_grad_norm(params, math.inf, grad_norm_mask=mask) == \
        pytest.approx(float(_flat([p.grad for p in params]).abs().max()))


def test_clip_tensors_by_global_norm() -> None:
    grads = [p.grad for p in _params(5)]
    before = float(_flat(grads).norm())
    norm = rt_utils.clip_tensors_by_global_norm(grads, max_norm=0.5)
    assert float(norm) == pytest.approx(before, rel=1e-6)
    assert float(_flat(grads).norm()) == pytest.approx(0.5, rel=1e-5)
    small = [torch.full((2,), 0.1)]
    rt_utils.clip_tensors_by_global_norm(small, max_norm=1.0)
    assert small[0].tolist() == pytest.approx([0.1, 0.1])  # under the limit: untouched
    # an overflowed norm (-1) scales nothing (DeepSpeed's would flip the signs)
    assert rt_utils.clip_tensors_by_global_norm(small, 1.0, global_norm=-1) == -1
    assert small[0].tolist() == pytest.approx([0.1, 0.1])
    with pytest.raises(ValueError, match="give mpu or moe_ep_group, not both"):
        rt_utils.get_global_norm_of_tensors(small, mpu=object(), moe_ep_group=object())
    with pytest.raises(TypeError, match="non-empty list of tensors"):
        rt_utils.get_global_norm_of_tensors([1.0])


def test_overflow_checks() -> None:
    assert bool(rt_utils.has_inf_or_nan(torch.tensor([1.0, math.inf])))
    assert bool(rt_utils.has_inf_or_nan(torch.tensor([math.nan])))
    assert not bool(rt_utils.has_inf_or_nan(torch.ones(3)))
    assert not bool(rt_utils.has_inf_or_nan(torch.empty(0)))
    sparse = torch.sparse_coo_tensor([[0, 3]], [1.0, -math.inf], (5,), check_invariants=True)
    assert bool(rt_utils.has_inf_or_nan(sparse))
    assert rt_utils.is_invalid_grad_norm(-1) and rt_utils.is_invalid_grad_norm(math.nan)
    assert not rt_utils.is_invalid_grad_norm(torch.tensor(2.0))
    t = torch.tensor([1.0, math.nan, -math.inf])
    rt_utils.mask_nan_or_inf_with_val_inplace(t)
    assert t.tolist() == [1.0, -1.0, -1.0]
    assert float(rt_utils.combine_grad_norm_groups([3.0, torch.tensor(4.0)])) == 5.0
    assert float(rt_utils.combine_grad_norm_groups([3.0, -1.0])) == math.inf
    p = torch.nn.Parameter(torch.ones(1))
    assert not rt_utils.is_model_parallel_parameter(p)
    p.model_parallel = True
    assert rt_utils.is_model_parallel_parameter(p)


# ------------------------------------------------------------ small helpers


def test_small_helpers(tmp_path: Path) -> None:
    def f() -> int:
        return 1

    assert rt_utils.noop_decorator(f) is f
    target = tmp_path / "a" / "b" / "ckpt.pt"
    rt_utils.ensure_directory_exists(str(target))
    assert target.parent.is_dir() and not target.exists()
    assert rt_utils.call_to_str("f", 1, "a", x=[1], y=None) == "f(1, 'a', x=[1], y=None)"
    assert rt_utils.call_to_str("g") == "g()" and rt_utils.call_to_str("h", z=2) == "h(z=2)"
    assert rt_utils.get_only_unique_item([4, 4, 4]) == 4
    with pytest.raises(RuntimeError, match=r"only one unique element in \[1, 2\]"):
        rt_utils.get_only_unique_item([1, 2])
    assert rt_utils.prefix_sum_inc([3, 4, 5]) == [3, 7, 12]
    padded = rt_utils.align_dense_tensors([torch.ones(3), torch.ones(2)], 4)
    assert [t.numel() for t in padded] == [3, 2, 3] and padded[2].sum() == 0
    same = [torch.ones(4)]
    assert rt_utils.align_dense_tensors(same, 4) is same
    nested = {"a": [torch.ones(3), (torch.ones(2, dtype=torch.float16),)], "b": 5}
    assert rt_utils.get_tensor_bytes(nested) == 16
    copied = rt_utils.copy_to_device({"a": [torch.ones(1), 3]}, torch.float64, torch.is_tensor)
    assert copied["a"][0].dtype == torch.float64 and copied["a"][1] == 3


def test_parameter_filters() -> None:
    empty, full = torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.ones(2))
    assert rt_utils.filter_empty_parameters([empty, full]) == [full]
    groups = rt_utils.filter_empty_parameters([{"params": [empty, full], "lr": 1},
                                               {"params": [empty]}])
    assert groups == [{"lr": 1, "params": [full]}]  # the group left empty is dropped
    assert rt_utils.filter_empty_parameters([]) == []
    frozen = torch.nn.Parameter(torch.ones(1), requires_grad=False)
    assert [rt_utils.is_optimized_parameter(p) for p in (empty, full, frozen)] == [
        False, True, False]


def test_memory_reports(capsys: pytest.CaptureFixture[str]) -> None:
    from dsrun.accelerator import get_accelerator

    rt_utils.memory_status("start")
    block = torch.ones(8 << 20)  # 32 MB more
    rt_utils.memory_status("after", reset_max=True)
    del block
    first, second = capsys.readouterr().out.strip().splitlines()
    assert first.startswith("RANK=0 MEMSTATS start device=cpu current alloc=")
    delta = float(second.split("(delta=")[1].split("GB")[0])
    assert delta > 0.02  # the block, in GB
    rt_utils.memory_status("elsewhere", print_rank=3)  # only rank 3 prints
    assert capsys.readouterr().out == ""
    assert isinstance(rt_utils.get_ma_status(), int) and rt_utils.get_ma_status() > 0
    reserved = rt_utils.torch_memory_reserved()
    assert reserved > 0 and rt_utils.torch_max_memory_reserved() >= reserved
    assert get_accelerator().memory_reserved() > 0


# ------------------------------------------------------------ PartitionedTensor


def test_partitioned_tensor_on_one_rank(solo: None) -> None:
    import torch.distributed as dist

    tensor = torch.arange(6.0).reshape(2, 3)
    part = rt_utils.PartitionedTensor(tensor, dist.group.WORLD)
    assert part.partition == [0, 6] and torch.equal(part.data(), tensor.reshape(-1))
    assert part.local_size() == (6,) and part.full_size() == [2, 3]
    assert part.to_meta().tolist() == [2, 2, 3, 1, 0, 0, 6]  # dims, shape, parts, rank, bounds
    assert torch.equal(part.full(), tensor)
    again = rt_utils.PartitionedTensor.from_meta(part.to_meta(), part.data(), dist.group.WORLD)
    assert torch.equal(again.full(), tensor) and again.orig_device == "cpu"
    with pytest.raises(TypeError, match="must be a torch.long tensor"):
        rt_utils.PartitionedTensor.from_meta(part.to_meta().float(), part.data(), None)
    wrong = part.to_meta()
    wrong[3] = 2  # made for a group of 2
    with pytest.raises(ValueError, match="meta is for part 0 of 2, this is rank 0 of a group "
                                         "of 1"):
        rt_utils.PartitionedTensor.from_meta(wrong, part.data(), dist.group.WORLD)


def test_new_names_by_their_deepspeed_path() -> None:
    import deepspeed.runtime.utils as ds_utils  # the alias finder

    for name in ("PartitionedTensor", "get_weight_norm", "get_grad_zeros", "call_to_str",
                 "noop_decorator", "get_global_norm_of_tensors", "clip_tensors_by_global_norm",
                 "memory_status", "see_memory_usage", "empty_cache", "clip_grad_norm_"):
        assert getattr(ds_utils, name) is getattr(rt_utils, name)
        assert name in rt_utils.__all__
