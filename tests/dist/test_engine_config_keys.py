"""Config keys that act on the engine itself, in a one-rank engine (the
``solo`` group): ``log_level``, ``disable_python_gc``, the default
``gradient_clipping`` of 1.0 (DeepSpeed 0.19.8's), and DeepSpeed's
``get_data_types()``."""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch

import dsrun
from dsrun.runtime.progress import LOGGER_NAME

pytestmark = pytest.mark.dist


def engine_for(**extra: Any) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, **extra}
    engine, *_ = dsrun.initialize(model=model, config=config)
    return engine


def test_log_level_sets_the_runtime_loggers_level(solo: None) -> None:
    runtime = logging.getLogger(LOGGER_NAME)
    before = runtime.level
    try:
        engine = engine_for(log_level="error")
        assert runtime.level == logging.ERROR and engine.log_level() == "error"
    finally:
        runtime.setLevel(before)


def test_disable_python_gc_holds_the_collector_until_destroy(solo: None) -> None:
    assert gc.isenabled()
    try:
        engine = engine_for(disable_python_gc=True)
        other = engine_for(disable_python_gc=True)
        assert not gc.isenabled()
        assert isinstance(engine.collect_python_gc(), int)
        engine.destroy()
        assert not gc.isenabled()  # the other engine still holds it
        other.destroy()
        other.destroy()  # twice: no second release
        assert gc.isenabled()
    finally:
        gc.enable()
    engine_for().destroy()
    assert gc.isenabled()


def test_gradient_clipping_defaults_to_one(solo: None) -> None:
    """DeepSpeed 0.19.8 clips at 1.0 when the config says nothing: one SGD
    step moves the weights by lr * g / |g| (the norm here is well above 1)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)) * 10
    moved = {}
    for name, extra in (("default", {}), ("off", {"gradient_clipping": 0.0})):
        engine = engine_for(**extra)
        before = [p.detach().clone() for p in engine.module.parameters()]
        engine.backward(engine(x).square().mean())
        engine.step()
        moved[name] = torch.linalg.vector_norm(torch.cat(
            [(p.detach() - b).flatten() for p, b in zip(engine.module.parameters(), before)]))
        norm = engine.get_global_grad_norm()
        assert (norm is not None) == (name == "default")
    assert float(moved["default"]) == pytest.approx(0.01, rel=1e-4)
    assert float(moved["off"]) > 0.05


def test_get_data_types_is_model_and_accumulation_dtype(solo: None) -> None:
    assert engine_for().get_data_types() == (torch.float32, torch.float32)
    engine = engine_for(bf16={"enabled": True}, communication_data_type="fp16",
                        data_types={"grad_accum_dtype": "fp32"})
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    assert engine.communication_data_type == torch.float16
    assert engine_for(bf16={"enabled": True}).get_data_types() == (torch.bfloat16,) * 2
    assert engine.managed_gradient_accumulation()


def test_the_configs_leaf_module_section_reaches_zero_stage3(solo: None) -> None:
    """``zero_optimization.leaf_module`` flags the modules it names when the
    engine builds its ZeRO-3 optimizer (an MoE block then is one unit)."""
    from dsrun.utils import z3_leaf_module

    engine = engine_for(zero_optimization={"stage": 3, "leaf_module": {"names": ["2"]}},
                        optimizer={"type": "AdamW", "params": {"lr": 0.01}})
    assert z3_leaf_module(engine.module[2]) and not z3_leaf_module(engine.module[0])
    engine.backward(engine(torch.randn(4, 8)).square().mean())
    engine.step()
