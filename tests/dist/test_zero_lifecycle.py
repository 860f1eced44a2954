"""ZeRO engines over a model's life, in one gloo rank (``solo``), compared
with plain torch running the same optimizer implementation (single-tensor
Adam, ``foreach=False``: bitwise at world size 1) over the same parameters:

* a trainable parameter left out of ``model_parameters`` stays fixed and
  the others train exactly as plain torch's, at every stage (stage 3 at
  world size 1 used to zero every later step's gradients: the dropped
  parameter's hook opened a backward round whose end wiped the flat
  gradient);
* ``engine.step()`` with no backward since the last step leaves the
  parameters and Adam's step count as they are, as stage 0 and torch do,
  while ``global_steps`` and the LR schedule advance (stages 1-3 used to
  step Adam with a zero gradient, its momentum moving the weights);
  offload variants take the hooked paths (stage 2's bucket reducer, stage
  3's shard reducer);
* ``initialize()`` twice on one model: the newer engine owns the
  parameters and trains exactly as plain torch (with offload the older
  engine's bucket-reducer hooks used to take its gradients: a bare
  AssertionError), while the older engine's step raises one DsrunError
  naming the problem (it used to update flat buffers the module no longer
  used, silently); destroy() then initialize() again trains as torch with
  a fresh optimizer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import dsrun
from dsrun.errors import DsrunError
from dsrun.runtime.zero.ownership import SUPERSEDED
from tests.dist.zero_variants import VARIANTS

pytestmark = pytest.mark.dist



def net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1),
                               torch.nn.Linear(1, 1))


def adam(params: list[torch.nn.Parameter]) -> torch.optim.Adam:
    return torch.optim.Adam(params, lr=0.01, foreach=False)


def config(variant: str) -> dict[str, Any]:
    stage, extra = VARIANTS[variant]
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
            "gradient_clipping": 0.0, "zero_optimization": {"stage": stage, **extra}}


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(10)
    return [(torch.randn(4, 6, generator=gen), torch.randn(4, 1, generator=gen))
            for _ in range(n)]


def full_values(model: torch.nn.Module) -> list[torch.Tensor]:
    params = list(model.parameters())
    with dsrun.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def run_engine(variant: str, pick: Callable[[torch.nn.Module], list[torch.nn.Parameter]],
               plan: str) -> tuple[list[float], list[torch.Tensor], Any]:
    """``plan``: per step, "b" = forward, backward and step; "s" = a step alone."""
    model = net()
    params = pick(model)
    engine, optimizer, *_ = dsrun.initialize(model=model, optimizer=adam(params),
                                             config=config(variant))
    losses, data = [], iter(batches(len(plan)))
    try:
        for what in plan:
            if what == "b":
                x, y = next(data)
                loss = (engine(x) - y).square().mean()
                engine.backward(loss)
                losses.append(loss.item())
            engine.step()
        steps = sorted({float(s["step"]) for s in optimizer.state.values() if "step" in s})
        return losses, full_values(model), (engine.global_steps, steps)
    finally:
        engine.destroy()


def train(engine: Any, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    losses = []
    for x, y in data:
        loss = (engine(x) - y).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def run_torch(pick: Callable[[torch.nn.Module], list[torch.nn.Parameter]],
              plan: str) -> tuple[list[float], list[torch.Tensor], Any]:
    model = net()
    optimizer = adam(pick(model))
    losses, data = [], iter(batches(len(plan)))
    for what in plan:
        if what == "b":
            x, y = next(data)
            loss = (model(x) - y).square().mean()
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    steps = sorted({float(s["step"]) for s in optimizer.state.values() if "step" in s})
    return losses, [p.detach().clone() for p in model.parameters()], (len(plan), steps)


def all_but_last_layer(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [*model[0].parameters(), *model[2].parameters()]


def all_but_first_layer(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [*model[2].parameters(), *model[3].parameters()]


def assert_same(got: tuple[list[float], list[torch.Tensor], Any],
                want: tuple[list[float], list[torch.Tensor], Any]) -> None:
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b), (a - b).abs().max()
    assert got[2] == want[2]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("pick", [all_but_last_layer, all_but_first_layer])
def test_parameter_left_out_of_model_parameters_trains_like_torch(
        solo: None, variant: str, pick: Callable[[torch.nn.Module], list[Any]]) -> None:
    got = run_engine(variant, pick, "bbbb")
    want = run_torch(pick, "bbbb")
    assert_same(got, want)
    model = net()
    picked = {id(p) for p in pick(model)}
    left_out = [i for i, p in enumerate(model.parameters()) if id(p) not in picked]
    fresh = [p.detach() for p in model.parameters()]
    assert len(left_out) == 2 and all(torch.equal(got[1][i], fresh[i]) for i in left_out)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_step_without_backward_moves_nothing(solo: None, variant: str) -> None:
    every = lambda model: list(model.parameters())  # noqa: E731
    got = run_engine(variant, every, "bsbss")
    assert_same(got, run_torch(every, "bsbss"))
    assert got[2] == (5, [2.0])  # every step counted by the engine, two by Adam


ZERO = [v for v in VARIANTS if v != "0"]


@pytest.mark.parametrize("variant", ZERO)
def test_older_engine_of_a_model_initialized_twice_refuses_to_step(
        solo: None, variant: str) -> None:
    model = net()
    every = list(model.parameters())
    older, *_ = dsrun.initialize(model=model, optimizer=adam(every), config=config(variant))
    newer, *_ = dsrun.initialize(model=model, optimizer=adam(every), config=config(variant))
    try:
        before = full_values(model)
        x, y = batches(1)[0]
        older.backward((older(x) - y).square().mean())
        with pytest.raises(DsrunError, match=re.escape(
                f"ZeRO stage {VARIANTS[variant][0]} engine: {SUPERSEDED}")):
            older.step()
        assert all(torch.equal(a, b) for a, b in zip(full_values(model), before))
    finally:
        newer.destroy()
        older.destroy()


@pytest.mark.parametrize("variant", ["3", "3-offload"])
def test_stage3_engine_without_optimizer_over_a_trained_model_supersedes_it(
        solo: None, variant: str) -> None:
    """It re-partitions the module and its hooks drop the gradients of
    parameters it does not train (at world size 1 the older engine used to
    train on zero gradients, silently)."""
    model = net()
    older, *_ = dsrun.initialize(model=model, optimizer=adam(list(model.parameters())),
                                 config=config(variant))
    newer, *_ = dsrun.initialize(model=model, config=config(variant))
    try:
        x, y = batches(1)[0]
        older.backward((older(x) - y).square().mean())
        with pytest.raises(DsrunError, match=re.escape(SUPERSEDED)):
            older.step()
    finally:
        newer.destroy()
        older.destroy()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_newer_engine_of_a_model_initialized_twice_trains_like_torch(
        solo: None, variant: str) -> None:
    model = net()
    every = list(model.parameters())
    older, *_ = dsrun.initialize(model=model, optimizer=adam(every), config=config(variant))
    newer, optimizer, *_ = dsrun.initialize(model=model, optimizer=adam(every),
                                            config=config(variant))
    try:
        losses = train(newer, batches(3))
        steps = sorted({float(s["step"]) for s in optimizer.state.values() if "step" in s})
        got = (losses, full_values(model), (newer.global_steps, steps))
    finally:
        newer.destroy()
        older.destroy()
    assert_same(got, run_torch(lambda m: list(m.parameters()), "bbb"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_destroy_then_initialize_again_trains_like_torch(solo: None, variant: str) -> None:
    data = batches(4)
    model = net()
    first, *_ = dsrun.initialize(model=model, optimizer=adam(list(model.parameters())),
                                 config=config(variant))
    losses = train(first, data[:2])
    first.destroy()
    second, *_ = dsrun.initialize(model=model, optimizer=adam(list(model.parameters())),
                                  config=config(variant))
    try:
        losses += train(second, data[2:])
        got = full_values(model)
    finally:
        second.destroy()
    plain = net()
    want = []
    for part in (data[:2], data[2:]):  # a fresh torch optimizer for the second engine
        optimizer = adam(list(plain.parameters()))
        for x, y in part:
            loss = (plain(x) - y).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            want.append(loss.item())
    assert losses == want
    assert all(torch.equal(a, b.detach()) for a, b in zip(got, plain.parameters()))
