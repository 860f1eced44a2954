"""``data_types.param_dtype`` / ``buffer_dtype`` / ``keep_in_fp32_modules``
(DeepSpeed 0.19.8): the config keys are accepted and checked, and the names
kept in fp32 are DeepSpeed's (``runtime/keep_in_fp32.py``); the zero.Init
constructor tags. The engines that apply them: tests/dist/test_buffer_dtypes.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsrun.errors import DsrunConfigError
from dsrun.runtime.buffer_dtypes import (
    ConstructorTags,
    cast_new_buffers,
    keep_pattern,
    kept_buffers,
)
from dsrun.runtime.config import DsrunConfig, inert_settings, resolve


def res(**data_types: Any) -> DsrunConfig:
    extra = data_types.pop("extra", {})
    return resolve({"train_batch_size": 2, "data_types": data_types, **extra}, dp_size=1,
                   dp_source="test", environ={})


FP16 = {"fp16": {"enabled": True}}
BF16 = {"bf16": {"enabled": True}}


def test_the_three_keys_are_accepted_in_deepspeed_spellings() -> None:
    config = res(param_dtype="half", buffer_dtype="torch.float32",
                 keep_in_fp32_modules=["router.*bias"], extra=FP16)
    types = config.data_types
    assert (types.param_dtype, types.buffer_dtype) == ("half", "torch.float32")
    assert types.keep_in_fp32_modules == ("router.*bias",)
    assert res().data_types.keep_in_fp32_modules == "auto"
    assert res(keep_in_fp32_modules=[]).data_types.keep_in_fp32_modules == ()
    assert res(param_dtype="bf16", extra=BF16).data_types.param_dtype == "bf16"
    assert res(param_dtype="fp32").data_types.param_dtype == "fp32"


@pytest.mark.parametrize("precision,asked", [(FP16, "bf16"), (BF16, "fp16"), ({}, "half"),
                                             (FP16, "fp32")])
def test_a_param_dtype_other_than_the_precisions_is_refused(precision: dict[str, Any],
                                                            asked: str) -> None:
    with pytest.raises(DsrunConfigError, match=rf'data_types.param_dtype "{asked}" in config '
                                               r"dict conflicts with"):
        res(param_dtype=asked, extra=precision)


@pytest.mark.parametrize("key", ["param_dtype", "buffer_dtype", "grad_accum_dtype"])
def test_a_bad_dtype_is_refused_naming_the_key_with_a_guess(key: str) -> None:
    with pytest.raises(DsrunConfigError, match=rf'"data_types.{key}" must be one of .*got '
                                               r'"fp61"; did you mean "fp16"\?.*config dict'):
        res(**{key: "fp61"}, extra=FP16)
    with pytest.raises(DsrunConfigError, match=rf"data_types.{key}"):
        res(**{key: 16}, extra=FP16)


@pytest.mark.parametrize("value", ["atuo", 5, ["ok", 3], {"a": 1}, None])
def test_a_bad_keep_in_fp32_modules_is_refused_naming_the_key(value: Any) -> None:
    with pytest.raises(DsrunConfigError, match="data_types.keep_in_fp32_modules"):
        res(keep_in_fp32_modules=value, extra=FP16)
    if value == "atuo":
        with pytest.raises(DsrunConfigError, match='did you mean "auto"'):
            res(keep_in_fp32_modules=value)


def test_under_fp32_the_buffer_keys_are_named_as_not_acted_on() -> None:
    note = "data_types.buffer_dtype/keep_in_fp32_modules without fp16 or bf16"
    assert any(note in n for n in inert_settings(res(buffer_dtype="fp16")))
    assert any(note in n for n in inert_settings(res(keep_in_fp32_modules=[])))
    assert inert_settings(res(buffer_dtype="fp16", extra=FP16)) == []


class Router(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("e_score_correction_bias", torch.zeros(3))
        self.register_buffer("other", torch.zeros(3))


class Block(torch.nn.Module):
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]
    _keep_in_fp32_modules = ["other"]

    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.register_buffer("scale", torch.ones(2))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.register_buffer("other", torch.ones(1))  # not under a Block: its names do not apply


def kept_names(module: torch.nn.Module, setting: Any, dtype: torch.dtype) -> list[str]:
    kept = {id(b) for b in kept_buffers(module, keep_pattern(module, setting, dtype))}
    return [n for n, b in module.named_buffers() if id(b) in kept]


def test_auto_reads_the_strict_list_under_bf16_and_both_under_fp16() -> None:
    model = Model()
    assert kept_names(model, "auto", torch.bfloat16) == [
        "layers.0.router.e_score_correction_bias", "layers.1.router.e_score_correction_bias"]
    assert kept_names(model, "auto", torch.float16) == [
        "layers.0.router.e_score_correction_bias", "layers.0.router.other",
        "layers.1.router.e_score_correction_bias", "layers.1.router.other"]
    assert kept_names(model, "auto", torch.float32) == []  # fp32 training keeps nothing
    assert kept_names(model, [], torch.float16) == []


def test_a_list_gives_glob_patterns_matched_anywhere_in_the_name() -> None:
    model = Model()
    assert kept_names(model, ["layers.1.*bias"], torch.bfloat16) == [
        "layers.1.router.e_score_correction_bias"]
    assert kept_names(model, ["other"], torch.bfloat16) == [
        "other", "layers.0.router.other", "layers.1.router.other"]


def test_zero_init_tags_cast_constructor_buffers_only_and_spare_the_kept() -> None:
    tags = ConstructorTags()
    tags.install()
    try:
        block = Block()
        block.register_buffer("inv_freq", 1.0 / (10 ** (torch.arange(0, 4, 2).float() / 4)))
        block.register_buffer("exact", torch.tensor([10.001, 10.002]))
        block.router.e_score_correction_bias.add_(10.001)
        cast_new_buffers(block, tags, torch.bfloat16, "auto")
    finally:
        tags.remove()
    assert torch.zeros is not None and not hasattr(torch.zeros, "__wrapped__")
    assert block.inv_freq.dtype == torch.float32  # computed, not made by a constructor
    assert block.exact.dtype == torch.bfloat16 and block.scale.dtype == torch.bfloat16
    assert block.router.other.dtype == torch.bfloat16  # the non-strict list: fp16 only
    bias = block.router.e_score_correction_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, torch.full((3,), 10.001))
