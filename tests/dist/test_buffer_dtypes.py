"""Buffers under fp16 and bf16, as DeepSpeed 0.19.8 treats them, on one-rank
engines in this process: training in 16 bits casts the parameters only; a
floating buffer keeps its dtype (and its fp32 digits) unless
``data_types.buffer_dtype`` casts it, and the buffers
``data_types.keep_in_fp32_modules`` names stay fp32 - at every ZeRO stage,
for models built under ``zero.Init`` too. ``save_16bit_model`` writes the
parameters in 16 bits and the buffers as the module holds them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch

import dsrun
from dsrun.errors import DsrunConfigError

pytestmark = pytest.mark.dist

VALUES = [10.001, 10.002, 10.003, 10.004]  # fp16 rounds them to 10.0, 10.0, 10.0, 10.0078
FP16 = {"fp16": {"enabled": True, "initial_scale_power": 8}}
BF16 = {"bf16": {"enabled": True}}
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


class Tiny(torch.nn.Module):
    """A Linear, an fp32 buffer with digits fp16 loses, an fp32 buffer that
    rounds exactly, and an integer buffer; the forward does not mix the
    buffers into the activations (so fp32 buffers run under fp16)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
        self.register_buffer("offsets", torch.tensor(VALUES))
        self.register_buffer("scale", torch.full((2,), 0.5))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.fc(x)


class KeepsOffsets(Tiny):
    """A Hugging Face-style class naming its buffer for fp32."""

    _keep_in_fp32_modules_strict = ["offsets"]


def build(stage: int, precision: dict[str, Any], model: Optional[torch.nn.Module] = None,
          **data_types: Any) -> Any:
    torch.manual_seed(0)
    config: dict[str, Any] = {
        "train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        **precision}
    if data_types:
        config["data_types"] = data_types
    engine, *_ = dsrun.initialize(model=model if model is not None else Tiny(), config=config)
    return engine


def train(engine: Any, steps: int = 2) -> list[float]:
    losses = []
    dtype = next(engine.module.parameters()).dtype
    for _ in range(steps):
        x = torch.linspace(-1, 1, 8).reshape(2, 4).to(dtype)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        assert engine.was_step_applied()
        losses.append(loss.item())
    return losses


def offsets_exact(module: torch.nn.Module) -> bool:
    buf = module.offsets
    return buf.dtype == torch.float32 and torch.equal(buf, torch.tensor(VALUES))


STAGES = [0, 1, 2, 3]


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_casts_parameters_only_and_training_works(solo: None, stage: int) -> None:
    model = Tiny()
    weight = model.fc.weight
    engine = build(stage, FP16, model)
    assert engine.module.fc.weight is weight  # parameters keep their identity
    assert all(p.dtype == torch.float16 for p in engine.module.parameters())
    assert offsets_exact(engine.module) and engine.module.scale.dtype == torch.float32
    assert engine.module.steps.dtype == torch.long
    losses = train(engine)
    assert all(map(torch.isfinite, map(torch.tensor, losses))) and losses[1] < losses[0]
    assert offsets_exact(engine.module) and int(engine.module.steps) == 2


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_buffer_dtype_casts_the_floating_buffers(solo: None, stage: int, precision: str) -> None:
    engine = build(stage, FP16 if precision == "fp16" else BF16, buffer_dtype=precision)
    half = HALF[precision]
    module = engine.module
    assert module.offsets.dtype == half and torch.equal(module.offsets,
                                                        torch.tensor(VALUES).to(half))
    assert module.scale.dtype == half and module.steps.dtype == torch.long
    train(engine)


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_leaves_buffers_alone_by_default(solo: None, stage: int) -> None:
    model = Tiny()
    model.scale.data = model.scale.data.bfloat16()  # a buffer the model holds in bf16 stays so
    engine = build(stage, BF16, model)
    assert offsets_exact(engine.module) and engine.module.scale.dtype == torch.bfloat16
    train(engine)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_keep_in_fp32_modules_patterns_keep_and_upcast(solo: None, stage: int,
                                                       precision: str) -> None:
    model = Tiny()
    model.scale.data = model.scale.data.to(HALF[precision])  # arrives 16-bit: upcast
    engine = build(stage, FP16 if precision == "fp16" else BF16, model,
                   buffer_dtype=precision, keep_in_fp32_modules=["offs*", "scal"])
    assert offsets_exact(engine.module) and engine.module.scale.dtype == torch.float32
    train(engine)


@pytest.mark.parametrize("stage", STAGES)
def test_keep_in_fp32_modules_auto_reads_the_models_strict_list(solo: None, stage: int) -> None:
    engine = build(stage, FP16, KeepsOffsets(), buffer_dtype="fp16")
    assert offsets_exact(engine.module) and engine.module.scale.dtype == torch.float16
    engine = build(stage, FP16, KeepsOffsets(), buffer_dtype="fp16", keep_in_fp32_modules=[])
    assert engine.module.offsets.dtype == torch.float16  # [] keeps nothing


def test_param_dtype_must_match_the_precision(solo: None) -> None:
    with pytest.raises(DsrunConfigError, match='data_types.param_dtype "bf16" in config dict '
                                               "conflicts with fp16.enabled"):
        build(0, FP16, param_dtype="bf16")
    build(0, FP16, param_dtype="torch.float16")
    with pytest.raises(DsrunConfigError, match='"data_types.buffer_dtype" must be one of.*'
                                               'did you mean "bf16"'):
        build(0, BF16, buffer_dtype="bf61")


class Rotary(torch.nn.Module):
    """Buffers made as Hugging Face models make them: ``inv_freq`` computed
    from an integer ``arange`` (fp32 under DeepSpeed's zero.Init), a
    routing bias made by ``torch.zeros`` (16-bit there, unless kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
        self.register_buffer("e_score_correction_bias", torch.zeros(4))
        self.register_buffer("offsets", torch.tensor(VALUES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class KeepsBias(Rotary):
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_zero_init_casts_constructor_made_buffers_and_keeps_named_ones(solo: None,
                                                                       precision: str) -> None:
    half = HALF[precision]
    with dsrun.zero.Init(dtype=half):
        model = KeepsBias()
    assert model.fc.weight.dtype == half
    assert model.inv_freq.dtype == torch.float32
    assert model.offsets.dtype == half and model.e_score_correction_bias.dtype == torch.float32
    expected_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    engine = build(3, FP16 if precision == "fp16" else BF16, model)
    module = engine.module
    assert torch.equal(module.inv_freq, expected_freq)
    assert module.offsets.dtype == half and module.e_score_correction_bias.dtype == torch.float32
    train(engine)


def test_zero_init_takes_the_configs_keep_list(solo: None) -> None:
    config = {"train_batch_size": 2, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3},
              "data_types": {"keep_in_fp32_modules": ["offsets"]}}
    with dsrun.zero.Init(config_dict_or_path=config):
        model = KeepsBias()
    assert offsets_exact(model)  # never rounded
    assert model.e_score_correction_bias.dtype == torch.bfloat16  # the list replaces "auto"
    prebuilt = KeepsBias()
    prebuilt.e_score_correction_bias.data = prebuilt.e_score_correction_bias.data.bfloat16()
    dsrun.zero.Init(module=prebuilt, dtype=torch.bfloat16)  # built outside: only kept ones change
    assert prebuilt.e_score_correction_bias.dtype == torch.float32
    assert offsets_exact(prebuilt)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_save_16bit_model_writes_buffers_in_the_modules_dtype(solo: None, tmp_path: Path,
                                                              stage: int, precision: str) -> None:
    engine = build(stage, FP16 if precision == "fp16" else BF16)
    train(engine, 1)
    assert engine.save_16bit_model(str(tmp_path), "model.bin")
    saved = torch.load(tmp_path / "model.bin")
    half = HALF[precision]
    assert saved["fc.weight"].dtype == half and saved["fc.bias"].dtype == half
    assert saved["offsets"].dtype == torch.float32
    assert torch.equal(saved["offsets"], torch.tensor(VALUES))
    assert saved["scale"].dtype == torch.float32 and saved["steps"].dtype == torch.long
    engine = build(stage, FP16 if precision == "fp16" else BF16, buffer_dtype=precision)
    assert engine.save_16bit_model(str(tmp_path), "cast.bin")
    assert torch.load(tmp_path / "cast.bin")["offsets"].dtype == half
