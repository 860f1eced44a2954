"""What a ZeRO-3 engine leaves in the process, in one gloo rank
(world size 1 with ``offload_param``, so the fetch hooks and the
``F.linear`` swap of dsrun/runtime/zero/linear.py are installed):

* ``engine.destroy()`` removes the fetch and gradient hooks, the weights'
  marks and the swap (it used to leave them all, and a holder of the swap,
  for the rest of the process); twice is harmless; a second engine works;
* only partitioned weights take dsrun's ``F.linear``; weights kept whole
  take torch's, and a model with nothing partitioned installs no swap;
* an ``F.linear`` wrapper installed before initialize() is what other
  weights reach while the swap stands (it used to be skipped), and is put
  back by ``destroy()``;
* a plain model and a stage-2 engine in the same process train as without
  the stage-3 engine;
* ordinary training copies nothing back from gathered parameters (the
  in-place-write check of whole_edits.take_gathered_edit); a copy-back
  writes zeros only into the shard's padding;
* at world size 1 without ``offload_param`` the per-step rebind check reads
  one pointer per parameter and still rebinds replaced data.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import dsrun
from dsrun.runtime.zero import linear, partitioned, whole_edits

pytestmark = pytest.mark.dist

TORCH_LINEAR = F.linear


@pytest.fixture(autouse=True)
def torch_linear_around() -> Iterator[None]:
    """Each test starts with torch's F.linear and no holder, and gives them back."""
    assert F.linear is TORCH_LINEAR and linear.holders() == 0
    try:
        yield
    finally:
        gc.collect()
        F.linear = TORCH_LINEAR
        linear._swap.holders.clear()


def net() -> torch.nn.Sequential:
    """Weights of 32 and 16 elements, biases of 8 and 2."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def engine_for(model: torch.nn.Module, *, stage: int = 3, threshold: int = 0,
               offload: bool = True) -> Any:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = threshold
        if offload:
            zero["offload_param"] = {"device": "cpu"}
    engine, *_ = dsrun.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
        "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": zero})
    return engine


def train(engine: Any, steps: int = 2) -> list[float]:
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        loss = engine(torch.randn(2, 4, generator=gen)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def hooks_left(model: torch.nn.Module) -> list[str]:
    left = []
    for name, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks or type(m._parameters) is not dict:
            left.append(f"module {name!r}")
    for name, p in model.named_parameters():
        if p._post_accumulate_grad_hooks or hasattr(p, "_ds_mem_linear"):
            left.append(f"parameter {name!r}")
    return left


# ------------------------------------------------------------- destroy


def test_destroy_gives_back_hooks_marks_and_f_linear(solo: None) -> None:
    model = net()
    engine = engine_for(model)
    assert F.linear is linear.zero3_linear and linear.holders() == 1
    assert hooks_left(model)
    train(engine)
    engine.destroy()
    assert F.linear is TORCH_LINEAR and linear.holders() == 0
    assert hooks_left(model) == []
    engine.destroy()  # again: harmless
    engine.optimizer.destroy()  # DeepSpeed's name for close()
    assert F.linear is TORCH_LINEAR and linear.holders() == 0
    second = engine_for(net())  # a second engine in the same process
    assert F.linear is linear.zero3_linear and linear.holders() == 1
    losses = train(second, 3)
    assert losses[-1] < losses[0]
    second.destroy()
    assert F.linear is TORCH_LINEAR and linear.holders() == 0


# ------------------------------------------------ which weights it takes


def test_weights_kept_whole_take_torchs_linear(solo: None) -> None:
    model = net()
    engine = engine_for(model, threshold=20)  # the 16-element weight stays whole
    persist = {name: p.ds_persist for name, p in model.named_parameters()}
    assert persist == {"0.weight": False, "0.bias": True, "2.weight": True, "2.bias": True}
    marked = {name for name, p in model.named_parameters() if hasattr(p, "_ds_mem_linear")}
    assert marked == {"0.weight"}
    x = torch.randn(3, 8)
    out = F.linear(x, model[2].weight, model[2].bias)
    assert type(out.grad_fn).__name__ == "AddmmBackward0"
    train(engine)
    engine.destroy()


def test_nothing_partitioned_installs_no_swap(solo: None) -> None:
    model = net()
    dsrun.utils.set_z3_leaf_modules(model, [torch.nn.Linear])  # hooks, but all kept whole
    engine = engine_for(model, threshold=10**6)
    assert all(p.ds_persist for p in model.parameters())
    assert F.linear is TORCH_LINEAR and linear.holders() == 0
    train(engine)
    engine.destroy()


class Counting:
    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        return self.inner(*args, **kwargs)


def test_a_wrapper_installed_before_initialize_is_kept_and_put_back(solo: None) -> None:
    wrapper = Counting(TORCH_LINEAR)
    F.linear = wrapper
    engine = engine_for(net())
    assert F.linear is linear.zero3_linear
    plain = net()
    plain(torch.randn(2, 4))  # two unmarked weights: the wrapper, twice
    assert wrapper.calls == 2
    engine.destroy()
    assert F.linear is wrapper


def test_other_models_train_as_without_the_stage3_engine(solo: None) -> None:
    def plain_grads() -> list[torch.Tensor]:
        model = net()
        model(torch.ones(3, 4)).square().sum().backward()
        return [p.grad for p in model.parameters()]

    before, stage2_before = plain_grads(), train(engine_for(net(), stage=2), 3)
    engine = engine_for(net())
    train(engine)
    assert F.linear is linear.zero3_linear
    after, stage2_after = plain_grads(), train(engine_for(net(), stage=2), 3)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert stage2_after == stage2_before
    engine.destroy()


# ------------------------------------------------------------ copy-back


@pytest.fixture
def copy_backs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the parameters whose gathered data went back into the shard."""
    seen: list[str] = []
    real = whole_edits.refresh_shard

    def counting(param: torch.Tensor) -> None:
        seen.append(partitioned.param_name(param))
        real(param)

    monkeypatch.setattr(whole_edits, "refresh_shard", counting)
    return seen


def test_ordinary_training_copies_nothing_back(solo: None, copy_backs: list[str]) -> None:
    engine = engine_for(net())
    train(engine, 3)
    assert copy_backs == []
    engine.destroy()


class MaxNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(6, 4, max_norm=1.0)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x).mean(1))


def test_an_in_place_write_is_copied_back(solo: None, copy_backs: list[str]) -> None:
    model = MaxNorm()
    engine = engine_for(model)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        engine(ids)
    assert copy_backs == ["emb.weight"]
    with dsrun.zero.GatheredParameters([model.emb.weight]):
        norms = model.emb.weight.norm(dim=1)
    assert torch.all(norms[1:4] <= 1.0 + 1e-6) and torch.all(norms[[0, 4, 5]] > 1.0)
    engine.destroy()


class Writes(TorchDispatchMode):
    """Counts the elements every zero_/fill_ call writes."""

    def __init__(self) -> None:
        super().__init__()
        self.zeroed = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if func in (torch.ops.aten.zero_.default, torch.ops.aten.fill_.Scalar):
            self.zeroed += args[0].numel()
        return func(*args, **(kwargs or {}))


def test_a_copy_back_zeroes_only_the_padding(solo: None) -> None:
    param = partitioned.partition_param(torch.nn.Parameter(torch.ones(5)), group=None,
                                        persist=True, alignment=4)
    assert param.ds_spec.shard_numel == 8 and not partitioned.shard_is_view(param)
    param.ds_tensor.fill_(7.0)  # padding that is not zero: refresh_shard must zero it
    with torch.no_grad():
        param.data.copy_(torch.arange(5.0))
    with Writes() as writes:
        partitioned.refresh_shard(param)
    assert param.ds_tensor.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    assert writes.zeroed == 3  # the padding, not the whole shard


# --------------------------------------------- world size 1, no offload


def test_the_rebind_check_reads_pointers_only(solo: None, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    model = net()
    engine = engine_for(model, offload=False)
    real, looked = whole_edits.committed, []

    def counting(param: torch.Tensor) -> torch.Tensor:
        looked.append(partitioned.param_name(param))
        return real(param)

    monkeypatch.setattr(whole_edits, "committed", counting)
    train(engine, 2)
    assert looked == []  # nothing replaced: no parameter looked at further
    model[2].weight.data = torch.full((2, 8), 0.5)  # replaced: rebound at the next step
    train(engine, 1)
    assert looked == ["2.weight"]
    weight = model[2].weight
    assert weight.data_ptr() == weight.ds_tensor.data_ptr()
    train(engine, 1)
    assert not torch.all(weight == 0.5)  # the step reaches what forward reads
    assert torch.equal(weight.detach().reshape(-1), weight.ds_tensor[:16])
    engine.destroy()
