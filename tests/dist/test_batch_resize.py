"""set_train_batch_size / set_train_micro_batch_size on one-rank engines
in this process: training after the change equals plain torch with the new
accumulation (every ZeRO stage, both directions), the counters and the
progress/monitor batch follow, a pipeline's train_batch takes the new
number of micro-batches, and a change mid-accumulation is refused."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

import dsrun
from dsrun.errors import DsrunError

pytestmark = pytest.mark.dist

MICRO = 2


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))


def batches() -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    while True:
        yield torch.randn(MICRO, 5, generator=g)


def reference(accumulations: list[int]) -> list[torch.Tensor]:
    """Plain torch SGD: one step per entry, that many micro-batches averaged."""
    net, data = model(), batches()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for accum in accumulations:
        for _ in range(accum):
            (net(next(data)).square().mean() / accum).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def engine_params(engine: dsrun.DsrunEngine) -> list[torch.Tensor]:
    from dsrun.utils import safe_get_full_fp32_param

    return [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(("first", "then"), [(2, 4), (1, 3), (3, 1)])
def test_training_follows_the_new_accumulation(solo: None, stage: int, first: int,
                                               then: int) -> None:
    engine, _, _, _ = dsrun.initialize(model=model(), config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": first,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage}})
    data = batches()
    plan = [first, first, then, then, then]
    for step, accum in enumerate(plan):
        if step == 2:
            engine.set_train_batch_size(MICRO * then)
            assert engine.get_batch_info() == (MICRO * then, MICRO, then)
            assert engine.progress.samples_per_step == MICRO * then
        for _ in range(accum):
            engine.backward(engine(next(data)).square().mean())
            engine.step()
    assert engine.global_steps == len(plan)
    assert engine.global_samples == MICRO * sum(plan)
    for got, want in zip(engine_params(engine), reference(plan)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_micro_batch_size_and_refusals(solo: None, caplog: pytest.LogCaptureFixture) -> None:
    engine, _, _, _ = dsrun.initialize(model=model(), config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    with caplog.at_level(logging.INFO, logger="dsrun.runtime.engine"):
        engine.set_train_micro_batch_size(5)
    assert engine.get_batch_info() == (10, 5, 2) and engine.train_batch_size() == 10
    assert engine.monitor._batch == 10
    assert "batch size: train 10 = micro 5 x accumulation 2 x data-parallel 1" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dsrun.runtime.engine"):
        engine.set_train_batch_size(10)  # Megatron sets it before every iteration
    assert "batch size" not in caplog.text and engine.get_batch_info() == (10, 5, 2)
    with pytest.raises(ValueError, match="not a multiple of micro-batch size 5"):
        engine.set_train_batch_size(12)
    assert engine.get_batch_info() == (10, 5, 2)  # unchanged by the refusal
    engine.backward(engine(torch.randn(5, 5)).sum())
    engine.step()  # the first of two micro-batches
    with pytest.raises(DsrunError, match="1 of this step's 2 micro-batches have run"):
        engine.set_train_batch_size(20)


def test_pipeline_takes_the_new_number_of_micro_batches(solo: None) -> None:
    from dsrun.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    module = PipelineModule([LayerSpec(torch.nn.Linear, 3, 1)], num_stages=1,
                            loss_fn=torch.nn.MSELoss())
    engine, _, _, _ = dsrun.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    taken = []

    def data() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            taken.append(1)
            yield torch.randn(2, 3), torch.randn(2, 1)

    source = data()
    engine.train_batch(source)
    assert len(taken) == 2
    engine.set_train_batch_size(6)
    engine.train_batch(source)
    assert len(taken) == 5 and engine.micro_batches == 3 and engine.global_samples == 4 + 6


def test_resume_with_other_accumulation_starts_a_full_round(solo: None, tmp_path: object) -> None:
    """A checkpoint saved after 3 micro-steps (accumulation 3) loaded into an
    engine with accumulation 2: its next step takes 2 micro-batches, not 1
    (the round is not counted from micro-step 0)."""
    def build(accum: int) -> dsrun.DsrunEngine:
        engine, _, _, _ = dsrun.initialize(model=model(), config={
            "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accum,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        return engine

    data = batches()
    first = build(3)
    for _ in range(3):
        first.backward(first(next(data)).square().mean())
        first.step()
    assert first.global_steps == 1 and first.micro_steps == 3
    first.save_checkpoint(str(tmp_path))
    second = build(2)
    second.load_checkpoint(str(tmp_path))
    assert second.micro_steps == 3 and second.micro_in_round() == 0
    second.backward(second(next(data)).square().mean())
    second.step()
    assert second.global_steps == 1  # not a boundary yet
    second.backward(second(next(data)).square().mean())
    second.step()
    assert second.global_steps == 2
