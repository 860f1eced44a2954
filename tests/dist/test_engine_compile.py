"""DeepSpeed's engine.compile() on one-rank engines in this process: the
forward goes through torch.compile (a recording backend sees the graphs),
training equals the uncompiled engine's, engine.module stays the plain
module, and what is refused says why."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dsrun
from dsrun.errors import DsrunError

pytestmark = pytest.mark.dist


def engine_for(stage: int, **extra: Any) -> dsrun.DsrunEngine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 1))
    engine, _, _, _ = dsrun.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage}, **extra})
    return engine


def train(engine: dsrun.DsrunEngine, steps: int = 3) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps * 2):
        loss = engine(torch.randn(4, 6, generator=g)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_compiled_forward_trains_like_the_plain_one(solo: None, stage: int) -> None:
    graphs: list[int] = []

    def recording(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    plain = train(engine_for(stage))
    engine = engine_for(stage)
    module = engine.module
    assert not engine.is_compiled and not engine.is_pipe_parallel
    keys = list(engine.state_dict())
    engine.compile(backend=recording)
    assert engine.is_compiled and engine.module is module
    assert list(engine.state_dict()) == keys  # the compiled wrapper is not a submodule
    compiled = train(engine)
    assert graphs, "torch.compile never captured the forward"
    assert compiled == pytest.approx(plain, rel=1e-6, abs=1e-7)
    engine.compile(backend=recording)  # a second call: a warning, no second wrapper
    assert engine.is_compiled


def test_refusals(solo: None) -> None:
    with pytest.raises(DsrunError, match="ZeRO stage 3 is not supported"):
        engine_for(3).compile()
    with pytest.raises(DsrunError, match="DeepCompile"):
        engine_for(0).compile(schedule=[(0, ["pass"])])
    with pytest.raises(DsrunError, match=r"compile_kwargs=\.\.\.\) must be a dict"):
        engine_for(0).compile(compile_kwargs=["fullgraph"])
    from dsrun.pipe import LayerSpec, PipelineModule

    pipe, _, _, _ = dsrun.initialize(
        model=PipelineModule([LayerSpec(torch.nn.Linear, 2, 2)], num_stages=1,
                             loss_fn=torch.nn.MSELoss()),
        config={"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert pipe.is_pipe_parallel
    with pytest.raises(DsrunError, match=r"pipeline engine: compile its layers with "
                                         r"engine.module.compile\(\)"):
        pipe.compile()


def test_the_profiled_step_runs_the_plain_module(solo: None, tmp_path: Any) -> None:
    graphs: list[int] = []

    def recording(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(1)
        return gm.forward

    out = tmp_path / "flops.txt"
    engine = engine_for(0, flops_profiler={"enabled": True, "profile_step": 0,
                                           "output_file": str(out)})
    engine.compile(backend=recording)
    train(engine, steps=1)
    macs = next(x for x in out.read_text().splitlines() if x.startswith("fwd MACs per rank:"))
    assert macs.split(":")[1].strip() == "672 MACs"  # 2 micro-batches x 4 x (6*12 + 12)
    assert graphs == []  # the first step was the profiled one: not compiled
    train(engine, steps=1)
    assert graphs  # then compiled


def test_accelerator_compile_backend() -> None:
    from dsrun.accelerator import get_accelerator

    acc = get_accelerator()
    assert acc.get_compile_backend() == "inductor"
    with pytest.raises(ValueError, match="not one of torch's"):
        acc.set_compile_backend("no-such-backend")
    try:
        acc.set_compile_backend("aot_eager")
        assert acc.get_compile_backend() == "aot_eager"
    finally:
        acc.set_compile_backend("inductor")
