"""What an engine leaves on its model's parameters, in one gloo rank
(``solo``), over several ``initialize()`` / ``destroy()`` cycles on one model:

* ``destroy()`` takes the engine's tensor hooks off every parameter (the
  hooks of :mod:`dsrun.runtime.direct_backward`, which divide a
  script-started ``loss.backward()``'s gradients by the accumulation steps);
  they used to stay, one more per parameter at each ``initialize()``, and
  every later backward ran them all;
* a destroyed engine, and its optimizer state, can be collected while the
  model lives (those hooks used to hold it), and so can an engine dropped
  without ``destroy()`` (its hooks go with it);
* a forward through a destroyed engine hooks nothing again;
* the engine of the next cycle trains exactly as plain torch (the same
  single-tensor Adam over the same weights), through ``loss.backward()``
  with gradient accumulation, so its own hooks still divide.
"""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch

import dsrun
from tests.dist.zero_variants import VARIANTS

pytestmark = pytest.mark.dist

CYCLES = 3
ACCUMULATION = 2


def net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def adam(params: Any) -> torch.optim.Adam:
    return torch.optim.Adam(params, lr=0.01, foreach=False)


def config(variant: str) -> dict[str, Any]:
    stage, extra = VARIANTS[variant]
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
            "gradient_accumulation_steps": ACCUMULATION, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, **extra}}


def batches(n: int, seed: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=gen), torch.randn(4, 1, generator=gen))
            for _ in range(n)]


def tensor_hooks(model: torch.nn.Module) -> list[int]:
    """Per parameter: how many tensor hooks (``register_hook``) it holds."""
    return [len(p._backward_hooks or {}) for p in model.parameters()]


def full_values(model: torch.nn.Module) -> list[torch.Tensor]:
    params = list(model.parameters())
    with dsrun.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def train_direct(engine: Any, model: torch.nn.Module,
                 data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """The script's own ``loss.backward()``; ``engine.step()`` at each micro-step."""
    losses = []
    for x, y in data:
        loss = (engine(x) - y).square().mean()
        loss.backward()
        engine.step()
        losses.append(loss.item())
    return losses


def train_torch(model: torch.nn.Module,
                data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    optimizer = adam(model.parameters())
    losses = []
    for i, (x, y) in enumerate(data):
        loss = (model(x) - y).square().mean()
        (loss / ACCUMULATION).backward()
        losses.append(loss.item())
        if (i + 1) % ACCUMULATION == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return losses


def one_cycle(model: torch.nn.Module, variant: str, seed: int, *,
              destroy: bool = True) -> tuple[weakref.ref, weakref.ref]:
    """initialize, train one accumulation round, destroy (or just drop) the
    engine; -> weak references to the engine and its optimizer."""
    engine, optimizer, *_ = dsrun.initialize(model=model, optimizer=adam(model.parameters()),
                                             config=config(variant))
    train_direct(engine, model, batches(ACCUMULATION, seed))
    refs = weakref.ref(engine), weakref.ref(optimizer)
    if destroy:
        engine.destroy()
    return refs


#: with and without destroy(): a dropped engine's hooks (DirectBackward's,
#: and with offload the ZeRO reducers', which hold it weakly) come off too
CASES = [(variant, destroy) for variant in VARIANTS for destroy in (True, False)]


@pytest.mark.parametrize(("variant", "destroy"), CASES)
def test_cycles_leave_no_hooks_and_free_their_engines(solo: None, variant: str,
                                                      destroy: bool) -> None:
    model = net()
    assert tensor_hooks(model) == [0, 0, 0, 0]
    for cycle in range(CYCLES):
        engine_ref, optimizer_ref = one_cycle(model, variant, seed=cycle, destroy=destroy)
        gc.collect()
        assert tensor_hooks(model) == [0, 0, 0, 0], f"after cycle {cycle}"
        assert engine_ref() is None, f"engine of cycle {cycle} still alive"
        assert optimizer_ref() is None, f"optimizer of cycle {cycle} still alive"

    # the next engine, from the weights the cycles left, trains as plain torch
    reference = copy.deepcopy(model)
    data = batches(3 * ACCUMULATION, seed=99)
    engine, *_ = dsrun.initialize(model=model, optimizer=adam(model.parameters()),
                                  config=config(variant))
    try:
        losses = train_direct(engine, model, data)
        assert losses == train_torch(reference, data)
        for got, want in zip(full_values(model), reference.parameters()):
            assert torch.equal(got, want.detach()), (got - want).abs().max()
    finally:
        engine.destroy()
    assert tensor_hooks(model) == [0, 0, 0, 0]


def test_forward_of_a_destroyed_engine_hooks_nothing(solo: None) -> None:
    model = net()
    engine, *_ = dsrun.initialize(model=model, optimizer=adam(model.parameters()),
                                  config=config("0"))
    x, y = batches(1)[0]
    engine(x)
    assert tensor_hooks(model) == [0, 0, 0, 0]  # a forward hooks nothing (no module walk)
    (engine(x) - y).square().mean().backward()
    assert tensor_hooks(model) == [1, 1, 1, 1]  # hooked as the script's backward began
    engine.step()
    engine.destroy()
    engine.destroy()  # again: harmless
    (engine(x) - y).square().mean().backward()
    assert tensor_hooks(model) == [0, 0, 0, 0]
