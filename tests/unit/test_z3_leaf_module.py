"""ZeRO-3 leaf-module helpers (DeepSpeed's deepspeed.utils.z3_leaf_module)
and the zero_optimization.leaf_module config section; pure, no processes.
Training with leaves is in tests/dist/test_zero3_dynamic.py."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import dsrun.utils as utils
from dsrun.errors import DsrunConfigError
from dsrun.runtime.config_sections import ZeroConfig
from dsrun.runtime.zero.fetch import hooked_modules
from dsrun.utils import z3_leaf_module as leaf


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(2, 2)
        self.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Block()
        self.second = Block()
        self.head = nn.Linear(2, 1)


def test_set_get_unset_by_class_and_name() -> None:
    model = Model()
    found = utils.set_z3_leaf_modules(model, [Block])
    assert found == [model.first, model.second] == utils.get_z3_leaf_modules(model)
    assert utils.z3_leaf_module(model.first) and not utils.z3_leaf_module(model.head)
    assert utils.unset_z3_leaf_modules(model, ["Block"]) == found
    assert utils.get_z3_leaf_modules(model) == []
    qualified = f"{Block.__module__}.{Block.__qualname__}"
    assert utils.set_z3_leaf_modules(model, [qualified]) == found
    utils.set_z3_leaf_module(model.second, False)
    assert utils.get_z3_leaf_modules(model) == [model.first]


def test_not_found_and_bad_entries() -> None:
    model = Model()
    with pytest.raises(ValueError, match="no module of class"):
        utils.set_z3_leaf_modules(model, [nn.Conv2d])
    assert utils.set_z3_leaf_modules(model, ["Conv2d"], raise_if_not_found=False) == []
    with pytest.raises(TypeError, match="classes or class names"):
        utils.set_z3_leaf_modules(model, [3])  # type: ignore[list-item]


def test_by_name_and_suffix() -> None:
    model = Model()
    found, missing = utils.set_z3_leaf_modules_by_name(model, ["first", "nope"],
                                                       raise_if_not_found=False)
    assert found == [model.first] and missing == ["nope"]
    with pytest.raises(ValueError, match="no module named"):
        utils.set_z3_leaf_modules_by_name(model, ["nope"])
    found, missing = utils.set_z3_leaf_modules_by_suffix(model, ["experts", "zzz"],
                                                         raise_if_not_found=False)
    assert found == [model.first.experts, model.second.experts] and missing == ["zzz"]


def test_config_section_is_checked_and_applied(caplog: pytest.LogCaptureFixture) -> None:
    section = ZeroConfig(stage=3, leaf_module={"names": "second", "name_suffixes": ["head"]}
                         ).leaf_module
    assert dict(section) == {"names": ("second",), "name_suffixes": ("head",)}
    with pytest.raises(DsrunConfigError, match="leaf_module.nmes.*did you mean \"names\""):
        ZeroConfig(stage=3, leaf_module={"nmes": ["x"]})
    with pytest.raises(DsrunConfigError, match="leaf_module.classes must be a list of strings"):
        ZeroConfig(stage=3, leaf_module={"classes": [1]})
    model = Model()
    assert leaf.apply_zero_leaf_module_config(model, section) == [model.second, model.head]
    assert leaf.apply_zero_leaf_module_config(Model(), None) == []
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.zero"):
        assert leaf.apply_zero_leaf_module_config(Model(), {"names": ["nope"]}) == []
    assert "no module named ['nope']" in caplog.text
    assert "matched no module" in caplog.text
    assert leaf.leaf_config_lists({})["classes"] == leaf.DEFAULT_LEAF_MODULE_CLASSES


def test_hooked_modules_stop_at_leaves() -> None:
    model = Model()
    utils.set_z3_leaf_modules(model, [Block])
    assert [name for name, _ in hooked_modules(model)] == ["", "first", "second", "head"]
    utils.set_z3_leaf_module(model, True)
    assert [name for name, _ in hooked_modules(model)] == [""]


def test_leaf_parameter_marks_follow_the_module() -> None:
    model = Model()
    leaf.mark_leaf_parameters(model.first)
    assert utils.z3_leaf_parameter(model.first.experts[1].weight)
    assert not utils.z3_leaf_parameter(model.head.weight)
    leaf.unmark_leaf_parameters(model.first)
    assert not utils.z3_leaf_parameter(model.first.gate.bias)
    assert isinstance(model.first.gate.weight, torch.nn.Parameter)
