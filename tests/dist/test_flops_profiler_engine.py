"""The ``flops_profiler`` config section on a one-rank engine in this
process: which step is profiled, what the report holds (counts worked out
by hand, with gradient accumulation and at ZeRO stage 3), that it is
written once and the hooks are gone afterwards, and the errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dsrun
from dsrun.errors import DsrunConfigError
from dsrun.profiling.flops_profiler import (
    FlopsProfiler,
    get_module_macs,
    macs_to_string,
    number_to_string,
)

pytestmark = pytest.mark.dist

# Linear(6, 10) -> Tanh -> Linear(10, 3) on 4 samples per micro-batch
FWD_FLOPS = (2 * 4 * 6 * 10 + 40) + 40 + (2 * 4 * 10 * 3 + 12)
FWD_MACS = 4 * 6 * 10 + 4 * 10 * 3


def build(stage: int, **profiler: Any) -> dsrun.DsrunEngine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage},
              "flops_profiler": {"enabled": True, **profiler}}
    engine, _, _, _ = dsrun.initialize(model=model, config=config)
    return engine


def train(engine: dsrun.DsrunEngine, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps * engine.gradient_accumulation_steps()):
        loss = engine(torch.randn(4, 6, generator=g)).square().mean()
        engine.backward(loss)
        engine.step()


def value(report: str, label: str) -> str:
    line = next(x for x in report.splitlines() if x.startswith(label + ":"))
    return line.split(":", 1)[1].strip()


@pytest.mark.parametrize("stage", [0, 3])
def test_profiles_the_configured_step_once(solo: None, tmp_path: Path, stage: int) -> None:
    out = tmp_path / "flops.txt"
    engine = build(stage, profile_step=2, output_file=str(out), module_depth=1, top_modules=2)
    assert isinstance(engine.flops_profiler, FlopsProfiler)
    train(engine, 2)
    assert not out.exists()  # global_steps reaches 2 only after two steps
    model = engine.module
    assert not hasattr(model, "__flops__")
    g = torch.Generator().manual_seed(1)
    for micro in (1, 2):  # the profiled step: DeepSpeed's attributes on the modules
        loss = engine(torch.randn(4, 6, generator=g)).square().mean()
        assert model[0].__macs__ == micro * 4 * 6 * 10 and model.__params__ == 103
        assert get_module_macs(model) == micro * FWD_MACS
        engine.backward(loss)
        engine.step()
    assert not any(hasattr(m, "__flops__") or hasattr(m, "__params__")
                   for m in model.modules())  # removed with the report (end_profile)
    report = out.read_text()
    assert "Profile Summary at step 2:" in report
    assert value(report, "micro-batches profiled") == "2"
    assert value(report, "samples per rank") == "8"
    assert value(report, "params per rank") == str(6 * 10 + 10 + 10 * 3 + 3)  # whole, at stage 3
    assert value(report, "fwd flops per rank") == number_to_string(2 * FWD_FLOPS) == "1.62 K"
    assert value(report, "fwd MACs per rank") == macs_to_string(2 * FWD_MACS) == "720 MACs"
    # backward counted: both Linear layers' gradient products at least (inputs need no grad)
    bwd = value(report, "bwd flops per rank (counted)")
    assert float(bwd.split()[0]) * 1000 >= 2 * (2 * 4 * 10 * 3 * 2 + 2 * 4 * 6 * 10)
    for label in ("fwd latency", "bwd latency", "step latency", "iter latency = fwd + bwd + step"):
        assert value(report, label).endswith(("s", "ms", "us")), label
    assert "depth 1:" in report and "Linear: 103, Tanh: 0" in report
    assert "  0: Linear(70 = 67.96% Params, 480 MACs = 66.67% MACs" in report
    hooks = [h for m in model.modules() for h in (*m._forward_pre_hooks.values(),
                                                  *m._forward_hooks.values())
             if getattr(h, "__self__", None) is engine.flops_profiler]
    assert hooks == []  # the profiler's hooks are removed after its step
    out.unlink()
    train(engine, 2)
    assert not out.exists()  # one profile per run


def test_printed_to_stdout_without_output_file(solo: None,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    engine = build(0, profile_step=0, detailed=False)
    train(engine, 1)
    printed = capsys.readouterr().out
    assert printed.count("DeepSpeed Flops Profiler") == 1 and "detailed profile" not in printed
    assert "Profile Summary at step 0:" in printed


def test_disabled_leaves_no_profiler(solo: None) -> None:
    torch.manual_seed(0)
    engine, _, _, _ = dsrun.initialize(model=torch.nn.Linear(2, 2), config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert engine.flops_profiler is None and engine._step_profiler is None
    assert not engine.flops_profiler_enabled()


def test_accessors(solo: None, tmp_path: Path) -> None:
    engine = build(0, profile_step=5, module_depth=2, top_modules=3, detailed=False,
                   output_file=str(tmp_path / "p.txt"), recompute_fwd_factor=1.0)
    assert engine.flops_profiler_enabled() and engine.flops_profiler_profile_step() == 5
    assert engine.flops_profiler_module_depth() == 2 and engine.flops_profiler_top_modules() == 3
    assert not engine.flops_profiler_detailed()
    assert engine.flops_profiler_output_file() == str(tmp_path / "p.txt")
    assert engine.flops_profiler_recompute_fwd_factor() == 1.0


@pytest.mark.parametrize(("section", "fragment"), [
    ({"enabled": True, "profile_stepp": 1}, 'did you mean "profile_step"'),
    ({"enabled": True, "top_modules": 0}, "top_modules"),
    ({"enabled": "yes"}, "enabled"),
    ({"enabled": True, "output_file": "/nonexistent-dir/x.txt"}, "does not exist"),
])
def test_bad_sections_are_config_errors(solo: None, section: dict, fragment: str) -> None:
    with pytest.raises(DsrunConfigError, match=fragment):
        dsrun.initialize(model=torch.nn.Linear(2, 2), config={
            "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "flops_profiler": section})


def test_output_file_that_is_a_directory(solo: None, tmp_path: Path) -> None:
    with pytest.raises(DsrunConfigError, match="is a directory"):
        build(0, output_file=str(tmp_path))


def test_a_one_stage_pipeline_is_profiled(solo: None, tmp_path: Path) -> None:
    """train_batch's micro-batches through the same hooks (the multi-stage
    case, one report per stage, is in test_pipe_monitor.py)."""
    from dsrun.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    model = PipelineModule([LayerSpec(torch.nn.Linear, 6, 10), LayerSpec(torch.nn.Tanh),
                            LayerSpec(torch.nn.Linear, 10, 3)], num_stages=1,
                           loss_fn=torch.nn.MSELoss())
    out = tmp_path / "flops.txt"
    engine, _, _, _ = dsrun.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "flops_profiler": {"enabled": True, "profile_step": 0, "output_file": str(out)}})
    g = torch.Generator().manual_seed(2)
    batches = iter([(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g))
                    for _ in range(4)])
    engine.train_batch(batches)
    report = out.read_text()
    assert value(report, "pipeline stage (its layers only)") == "0 of 1"
    assert value(report, "micro-batches profiled") == "2"
    assert value(report, "fwd flops per rank") == number_to_string(2 * FWD_FLOPS)
    assert value(report, "step latency").endswith(("s", "ms", "us"))
    engine.train_batch(batches)  # once only
    assert out.read_text() == report


def test_forwards_without_gradients_in_the_profiled_step_are_not_counted(
        solo: None, tmp_path: Path) -> None:
    out = tmp_path / "flops.txt"
    engine = build(0, profile_step=1, output_file=str(out))
    train(engine, 1)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # the profiled step, with evaluation passes amid it
        loss = engine(torch.randn(4, 6, generator=g)).square().mean()
        with torch.no_grad():
            engine(torch.randn(5, 6, generator=g))
        with torch.inference_mode():
            engine(torch.randn(7, 6, generator=g))
        engine.backward(loss)
        engine.step()
    report = out.read_text()
    assert value(report, "micro-batches profiled") == "2"
    assert value(report, "samples per rank") == "8"
    assert value(report, "fwd MACs per rank") == macs_to_string(2 * FWD_MACS)
