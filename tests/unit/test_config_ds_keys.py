"""DeepSpeed 0.19.8 config keys at the edges of what dsrun implements:
ZenFlow refused, keys DeepSpeed accepts accepted,
misplaced keys sent to their section, case-insensitive enums, the
not-implemented warning only for sections that are switched on, the legacy
top-level ``curriculum_learning`` refused (even disabled), and the ``torch_autocast``
reduction difference at ZeRO logged. Pure: no process group."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from dsrun.errors import DsrunConfigError, DsrunUsageError
from dsrun.launcher.configcheck import check_config
from dsrun.runtime.config import resolve
from dsrun.runtime.precision import make_precision

BASE = {"train_batch_size": 2}


def config(**sections: Any) -> Any:
    return resolve({**BASE, **sections}, dp_size=1, dp_source="test")


def launcher_check(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data, indent=2))
    with pytest.raises(DsrunUsageError) as err:
        check_config(str(path), 1, {})
    return str(err.value)


# ------------------------------------------------------------------ ZenFlow

def test_zenflow_section_is_refused_by_name(tmp_path: Path) -> None:
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"},
            "zenflow": {"topk_ratio": 0.1, "update_interval": 4}}
    with pytest.raises(DsrunConfigError, match=r'"zero_optimization.zenflow" in .*ZenFlow.* '
                                               r"not implemented"):
        config(zero_optimization=zero)
    with pytest.raises(DsrunConfigError, match="zenflow"):
        config(zero_optimization={"stage": 1, "zenflow": {}})  # DeepSpeed: on with defaults
    message = launcher_check(tmp_path, {**BASE, "zero_optimization": zero})
    assert "ds.json:8:" in message and "ZenFlow" in message  # the "zenflow" line


def test_zenflow_must_be_a_mapping_and_null_is_off() -> None:
    with pytest.raises(DsrunConfigError, match='"zero_optimization.zenflow".*JSON object'):
        config(zero_optimization={"stage": 2, "zenflow": [0.1]})
    assert config(zero_optimization={"stage": 2, "zenflow": None}).zero_optimization.stage == 2


# --------------------------------------------------- keys DeepSpeed accepts

def test_valid_deepspeed_keys_are_accepted(caplog: pytest.LogCaptureFixture) -> None:
    c = config(checkpoint={"checkpoint_serialization": False},
               zero_optimization={"stage": 1, "save_muon_momentum_buffer_in_memory": True},
               log_level="INFO", communication_data_type="BF16",
               seq_parallel_communication_data_type="FP32")
    assert c.checkpoint.checkpoint_serialization is False
    assert c.zero_optimization.save_muon_momentum_buffer_in_memory is True
    assert (c.log_level, c.communication_data_type) == ("info", "bf16")
    assert c.seq_parallel_communication_data_type == "fp32"
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.config"):
        d = config(datastates_ckpt={"host_cache_size": 16})
    assert d.passthrough["datastates_ckpt"] == {"host_cache_size": 16}
    assert "does not implement: datastates_ckpt" in caplog.text
    with pytest.raises(DsrunConfigError, match='"log_level" in .* must be one of'):
        config(log_level="LOUD")


@pytest.mark.parametrize("key, section", [
    ("offload_optimizer", "zero_optimization"), ("offload_param", "zero_optimization"),
    ("stage", "zero_optimization"), ("stage3_max_live_parameters", "zero_optimization"),
    ("loss_scale", "fp16"), ("initial_scale_power", "fp16"),
    ("bf16_optimizer_states", "bf16"),
])
def test_misplaced_section_keys_say_where_they_belong(key: str, section: str) -> None:
    with pytest.raises(DsrunConfigError) as err:
        config(**{key: 1})
    text = str(err.value)
    assert f'unknown key "{key}"' in text and f'it belongs in "{section}"' in text
    assert "did you mean" not in text and "valid keys" not in text


# ------------------------------------- the not-implemented warning, when on

@pytest.mark.parametrize("section, value", [
    ("compile", {}), ("compile", {"deepcompile": False, "offload_activation": True}),
    ("tensor_parallel", {}), ("tensor_parallel", {"autotp_size": 1}),
    ("tensor_parallel", {"autotp_size": 0}), ("weight_quantization", {}),
    ("weight_quantization", {"enabled": True, "quantized_initialization": {}}),
    ("autotuning", {}), ("hybrid_engine", {"enabled": False}),
])
def test_switched_off_sections_are_not_warned_about(
        caplog: pytest.LogCaptureFixture, section: str, value: dict) -> None:
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.config"):
        c = config(**{section: value})
    assert section in c.passthrough and "does not implement" not in caplog.text


@pytest.mark.parametrize("section, value", [
    ("compile", {"deepcompile": True}), ("tensor_parallel", {"autotp_size": 2}),
    ("weight_quantization", {"quantized_initialization": {"num_bits": 8}}),
    ("hybrid_engine", {"enabled": True}), ("datastates_ckpt", {}),
])
def test_switched_on_sections_are_warned_about(
        caplog: pytest.LogCaptureFixture, section: str, value: dict) -> None:
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.config"):
        config(**{section: value})
    assert f"does not implement: {section}" in caplog.text


def test_legacy_top_level_curriculum_learning_is_refused_even_disabled() -> None:
    with pytest.raises(DsrunConfigError, match="data_efficiency.data_sampling.curriculum_learning"):
        config(curriculum_learning={"enabled": True, "curriculum_type": "seqlen"})
    with pytest.raises(DsrunConfigError, match="refuses this key whatever its value"):
        config(curriculum_learning={"enabled": False})  # as DeepSpeed 0.19.8


# --------------------------------------- torch_autocast's reduction at ZeRO

def autocast_notes(caplog: pytest.LogCaptureFixture, module: torch.nn.Module,
                   **extra: Any) -> str:
    c = config(torch_autocast={"enabled": True, "dtype": "bf16", **extra.pop("autocast", {})},
               zero_optimization={"stage": extra.pop("stage", 2)}, **extra)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dsrun.runtime.precision"):
        make_precision(c, module, torch.device("cpu"), masters=c.zero_optimization.stage == 0)
    return "\n".join(r.getMessage() for r in caplog.records if "torch_autocast" in r.getMessage())


def test_autocast_reduction_difference_is_logged_at_zero(
        caplog: pytest.LogCaptureFixture) -> None:
    linear = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    text = autocast_notes(caplog, linear)
    assert "ZeRO stage 2" in text and "4 parameter(s)" in text and "bfloat16" in text
    assert '"communication_data_type": "bf16" reduces as DeepSpeed does' in text
    assert autocast_notes(caplog, linear, stage=0) == ""  # stage 0 reduces as DeepSpeed
    assert autocast_notes(caplog, linear, communication_data_type="bf16") == ""
    assert autocast_notes(caplog, linear, autocast={"lower_precision_safe_modules": []}) == ""
    # DeepSpeed reduces a LayerNorm's gradients in fp32 even then
    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    text = autocast_notes(caplog, mixed, stage=3, communication_data_type="bf16")
    assert "ZeRO stage 3" in text and "other 2 in float32" in text
    assert "reduces as DeepSpeed does" not in text
