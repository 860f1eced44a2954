"""Torch's boolean optimizer flags (``maximize``, ``amsgrad``, ``nesterov``
...) given as strings or numbers are refused by name: a string ``"false"``
is truthy, so torch turned the flag ON (``maximize``: gradient ascent)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsrun.errors import DsrunConfigError, DsrunUsageError
from dsrun.launcher.configcheck import check_config
from dsrun.runtime.config import OptimizerConfig, resolve
from dsrun.runtime.optimizers import build_optimizer, optimizer_class_and_kwargs

FLAGS = [("Adam", "maximize"), ("AdamW", "amsgrad"), ("SGD", "nesterov"),
         ("RMSprop", "centered"), ("RAdam", "decoupled_weight_decay"), ("Adam", "capturable"),
         ("SGD", "differentiable"), ("Adam", "foreach"), ("Lamb", "eps_inside_sqrt"),
         ("Adam", "adam_w_mode")]


def _config(kind: str, **params: object) -> dict:
    return {"train_batch_size": 2, "optimizer": {"type": kind, "params": {"lr": 0.1, **params}}}


@pytest.mark.parametrize("kind,flag", FLAGS)
@pytest.mark.parametrize("value", ["false", "no", 0, 1])
def test_a_non_bool_flag_is_refused_naming_key_and_value(kind: str, flag: str,
                                                         value: object) -> None:
    with pytest.raises(DsrunConfigError) as err:
        resolve(_config(kind, **{flag: value}), dp_size=1, dp_source="test")
    text = str(err.value)
    assert f"optimizer.params.{flag}" in text and json.dumps(value) in text
    assert "true or false" in text


def test_a_string_bool_gets_the_quotes_hint() -> None:
    with pytest.raises(DsrunConfigError, match="without quotes"):
        resolve(_config("Adam", maximize="false"), dp_size=1, dp_source="test")


def test_real_bools_and_null_defaults_pass() -> None:
    c = resolve(_config("SGD", nesterov=True, momentum=0.9, maximize=False, foreach=None),
                dp_size=1, dp_source="test")
    optimizer = build_optimizer(c.optimizer, [torch.nn.Parameter(torch.ones(2))])
    assert optimizer.param_groups[0]["nesterov"] is True
    assert optimizer.param_groups[0]["maximize"] is False


def test_a_config_built_without_resolve_is_checked_too() -> None:
    with pytest.raises(DsrunConfigError, match='"maximize" must be true or false'):
        optimizer_class_and_kwargs(OptimizerConfig("adamw", {"maximize": "false"}))


def test_the_launcher_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_config("Adam", maximize="false"), indent=2))
    with pytest.raises(DsrunUsageError, match=rf'{path}:7: .*optimizer\.params\.maximize.*'
                                              r'"false"'):
        check_config(str(path), 1, {})
