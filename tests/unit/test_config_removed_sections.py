"""Config keys dsrun does not implement, as DeepSpeed 0.19.8 treats them:
the sections DeepSpeed has removed refused with its reason (disabled too),
the passthrough sections shape-checked (a JSON object, the keys of
DeepSpeed's strict models), and the Ulysses/ALST sizes refused above 1.
Pure (the initialize() cases: a one-rank gloo group)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import dsrun
from dsrun.errors import DsrunConfigError, DsrunUsageError
from dsrun.launcher.configcheck import check_config
from dsrun.runtime.config import resolve

BASE = {"train_batch_size": 2}
SGD = {"type": "SGD", "params": {"lr": 0.1}}


def config(**sections: Any) -> Any:
    return resolve({**BASE, **sections}, dp_size=1, dp_source="test")


# ------------------------------------------------ removed in DeepSpeed 0.19.8

# (key, a value that switches it off or is empty, words of DeepSpeed's reason)
REMOVED = [
    ("compression_training", {"weight_quantization": {"shared_parameters": {"enabled": False}}},
     "compression library has been removed"),
    ("progressive_layer_drop", {"enabled": False, "theta": 0.5, "gamma": 0.001},
     "Progressive Layer Dropping has been removed"),
    ("elasticity", {"enabled": False, "max_train_batch_size": 8},
     "Set train_batch_size / train_micro_batch_size_per_gpu"),
    ("sparse_attention", {"mode": "fixed"}, "Sparse Attention has been removed"),
    ("eigenvalue", {"enabled": False}, "Eigenvalue-based Mixture-of-Quantization"),
    ("quantize_training", {"enabled": False}, "quantize_training' has been removed"),
    ("nebula", {"enabled": False}, "Nebula checkpointing has been removed"),
    ("amp", {"enabled": False}, "Use DeepSpeed 'fp16', 'bf16', or 'torch_autocast'"),
    ("curriculum_learning", {"enabled": False},
     "Use 'data_efficiency.data_sampling.curriculum_learning' instead"),
    ("sparse_gradients", True, "would be reduced dense"),
    ("graph_harvesting", True, "Graph harvesting has been removed"),
]


@pytest.mark.parametrize("key, value, reason", REMOVED)
def test_removed_sections_are_refused_with_deepspeeds_reason(key: str, value: Any,
                                                             reason: str) -> None:
    with pytest.raises(DsrunConfigError) as err:
        config(**{key: value})
    text = str(err.value)
    assert text.startswith(f'"{key}" in config dict: ') and reason in text
    assert "DeepSpeed 0.19.8 refuses this key whatever its value" in text


def test_removed_sections_are_refused_when_switched_on_too() -> None:
    with pytest.raises(DsrunConfigError, match="train unquantized"):
        config(compression_training={"weight_quantization": {"shared_parameters": {
            "enabled": True, "quantize_weight_in_forward": True}}})
    with pytest.raises(DsrunConfigError, match="Elastic training has been removed"):
        config(elasticity={"enabled": True, "max_train_batch_size": 8,
                           "micro_batch_sizes": [1, 2]})


def test_false_flags_that_dsrun_writes_itself_still_resolve() -> None:
    # DsrunConfig.to_dict() writes these two as false: such a dict must resolve again
    assert config(sparse_gradients=False, graph_harvesting=False).to_dict()["sparse_gradients"] \
        is False


@pytest.mark.parametrize("key, value", [("mics_shard_size", 2), ("mics_shard_size", -1),
                                        ("mics_hierarchical_params_gather", False),
                                        ("zeropp_loco_param", {"err_beta": 0.8})])
@pytest.mark.parametrize("stage", [0, 2])
def test_removed_zero_keys_are_refused_at_every_stage(key: str, value: Any, stage: int) -> None:
    with pytest.raises(DsrunConfigError) as err:
        config(zero_optimization={"stage": stage, key: value})
    assert str(err.value).startswith(f'"zero_optimization.{key}" in config dict: ')
    assert "has been removed" in str(err.value)


def test_the_launchers_config_check_names_the_removed_keys_line(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BASE, "zero_optimization": {"stage": 0},
                                "progressive_layer_drop": {"enabled": True}}, indent=2))
    with pytest.raises(DsrunUsageError) as err:
        check_config(str(path), 1, {})
    assert "ds.json:6:" in str(err.value) and "Progressive Layer Dropping" in str(err.value)


# --------------------------------------------- the passthrough sections' shape

@pytest.mark.parametrize("key, value", [
    ("tensor_parallel", []), ("tensor_parallel", None), ("autotuning", "yes"), ("aio", 5),
    ("aio", False), ("compile", True), ("hybrid_engine", 1), ("data_efficiency", []),
    ("weight_quantization", "on"), ("expert_parallel", True),
])
def test_passthrough_sections_must_be_objects(key: str, value: Any) -> None:
    with pytest.raises(DsrunConfigError, match=f'^"{key}" in config dict must be a JSON object'):
        config(**{key: value})


@pytest.mark.parametrize("key, value", [("aio", None), ("expert_parallel", None),
                                        ("expert_parallel", False), ("aio", {"block_size": 1}),
                                        ("use_data_before_expert_parallelism", True)])
def test_what_deepspeed_takes_for_off_is_taken(key: str, value: Any) -> None:
    assert config(**{key: value}).passthrough[key] == value


@pytest.mark.parametrize("key, typo, right", [
    ("tensor_parallel", "autotp_szie", "autotp_size"), ("compile", "deepcompil", "deepcompile"),
    ("hybrid_engine", "max_out_token", "max_out_tokens"),
    ("weight_quantization", "quantized_initialisation", "quantized_initialization"),
])
def test_misspelled_keys_of_strict_sections_get_a_did_you_mean(key: str, typo: str,
                                                               right: str) -> None:
    with pytest.raises(DsrunConfigError, match=f'unknown key "{typo}" in "{key}" of config dict; '
                                               f'did you mean "{right}"'):
        config(**{key: {typo: 2}})


def test_unknown_keys_allowed_are_dropped_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.config"):
        c = config(tensor_parallel={"autotp_szie": 2, "tp": {"tp_size": 1}},
                   dsrun={"allow_unknown_keys": True})
    assert c.passthrough["tensor_parallel"] == {"tp": {"tp_size": 1}}
    assert "tensor_parallel.autotp_szie" in c.ignored_keys and "autotp_szie" in caplog.text


def test_autotp_size_must_be_an_integer() -> None:
    with pytest.raises(DsrunConfigError, match='"tensor_parallel.autotp_size" in config dict '
                                               'must be an integer >= 0, got "2"'):
        config(tensor_parallel={"autotp_size": "2"})
    assert config(tensor_parallel={"autotp_size": 1}).passthrough["tensor_parallel"] == \
        {"autotp_size": 1}


# ------------------------------------------------------ Ulysses / ALST sizes

@pytest.mark.parametrize("extra", [{"sequence_parallel_size": 2},
                                   {"sequence_parallel_size": 4, "data_parallel_size": 1}])
def test_sequence_parallelism_is_refused_by_name(extra: dict) -> None:
    with pytest.raises(DsrunConfigError) as err:
        config(**extra)
    text = str(err.value)
    assert text.startswith('"sequence_parallel_size" in config dict is ')
    assert "sequence parallelism (DeepSpeed's Ulysses / ALST) is not implemented" in text
    assert "unknown key" not in text and "did you mean" not in text


@pytest.mark.parametrize("extra", [{"sequence_parallel_size": 1}, {"data_parallel_size": 1},
                                   {"data_parallel_size": 1, "sequence_parallel_size": 1}])
def test_sizes_of_one_are_the_no_op_they_are_in_deepspeed(
        caplog: pytest.LogCaptureFixture, extra: dict) -> None:
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.config"):
        c = config(**extra)
    assert dict(c.passthrough) == extra and "does not implement" not in caplog.text


@pytest.mark.parametrize("key, value", [("sequence_parallel_size", "1"),
                                        ("data_parallel_size", 0)])
def test_sizes_must_be_positive_integers(key: str, value: Any) -> None:
    with pytest.raises(DsrunConfigError, match=f'"{key}" in config dict must be an integer >= 1'):
        config(**{key: value})


LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "DSRUN_CONFIG")


def test_a_data_parallel_size_other_than_the_engines_is_refused(
        solo: None, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": SGD,
           "data_parallel_size": 2, "sequence_parallel_size": 1}
    with pytest.raises(DsrunConfigError, match=r'"data_parallel_size" in config dict is 2, but '
                                               r"the data-parallel size is 1 .*Ulysses"):
        dsrun.initialize(model=torch.nn.Linear(2, 1), config=cfg)
    engine, *_ = dsrun.initialize(model=torch.nn.Linear(2, 1),
                                  config={**cfg, "data_parallel_size": 1})
    engine.backward(engine(torch.ones(1, 2)).sum())
    engine.step()
    assert engine.train_batch_size() == 1
