"""DeepSpeed-compatible config: batch triple, "auto", strict keys, sections."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Optional

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config import (
    AUTO_OPTIMIZER_DEFAULTS,
    DsrunConfig,
    FP16Config,
    OffloadOptimizerConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
    did_you_mean,
    load_config,
    resolve,
    resolve_batch,
)

SRC = "WORLD_SIZE=2 from the launcher"


def res(config: Any, dp: int = 2, **kwargs: Any) -> DsrunConfig:
    kwargs.setdefault("environ", {})
    return resolve(config, dp_size=dp, dp_source=SRC, **kwargs)


def base(**extra: Any) -> dict[str, Any]:
    return {"train_batch_size": 8, **extra}


def test_fp32_allreduce_says_what_it_is_now(caplog: pytest.LogCaptureFixture) -> None:
    """An old key gets its replacement, not the list of every valid key."""
    with pytest.raises(DsrunConfigError) as err:
        res(base(fp32_allreduce=True))
    assert str(err.value).startswith('unknown key "fp32_allreduce" in config dict: what it '
                                     'asked for is now "communication_data_type": "fp32"')
    assert "valid keys" not in str(err.value)
    with caplog.at_level(logging.WARNING):
        config = res(base(fp32_allreduce=True, dsrun={"allow_unknown_keys": True}))
    assert config.ignored_keys == ("fp32_allreduce",)
    assert caplog.text.count("fp32_allreduce") == 1 and "communication_data_type" in caplog.text


def test_dotted_top_level_keys_are_ignored_as_in_deepspeed(
        caplog: pytest.LogCaptureFixture) -> None:
    """TRL's prepare_deepspeed adds "zero_optimization.<field>" keys at the top
    level; DeepSpeed 0.19.8 reads none of them (its reduce_bucket_size stays
    5e8), so dsrun ignores them with one warning instead of refusing them."""
    h = 32
    trl = {"zero_optimization.reduce_bucket_size": h * h,
           "zero_optimization.stage3_param_persistence_threshold": 10 * h,
           "zero_optimization.stage3_prefetch_bucket_size": 0.9 * h * h}
    with caplog.at_level(logging.WARNING):
        config = res(base(zero_optimization={"stage": 3}, **trl))
    plain = res(base(zero_optimization={"stage": 3}))
    assert config.zero_optimization == plain.zero_optimization
    assert config.zero_optimization.reduce_bucket_size == 500_000_000
    assert config.ignored_keys == tuple(trl)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "ignoring dotted top-level keys" in text and "DeepSpeed 0.19.8 ignores" in text
    assert all(f'"{key}"' in text for key in trl)


@pytest.mark.parametrize("key", ["zero_optimizaton.stage", "zero_optimizaton", "fp16x.enabled"])
def test_misspelt_or_unknown_dotted_keys_stay_errors(key: str) -> None:
    with pytest.raises(DsrunConfigError, match=f'unknown key "{key}"'):
        res(base(**{key: 1}))


@pytest.mark.parametrize("key", ["zero_optimization.offload_optimizer.device",
                                 "bfloat16.enabled", "optimizer.params.lr", "autotuning.enabled",
                                 "zero_optimization.stage3_prefetch_bucket_size"])
def test_dotted_keys_naming_real_keys_at_any_depth_are_ignored(key: str) -> None:
    assert res(base(**{key: 1})).ignored_keys == (key,)


@pytest.mark.parametrize(("key", "says"), [
    ("zero_optimization.stgae", 'did you mean "zero_optimization.stage"?'),
    ("zero_optimization.offload_optimizer.devise",
     'did you mean "zero_optimization.offload_optimizer.device"?'),
    ("fp16.enabeld", 'did you mean "fp16.enabled"?'),
    ("zero_optimization.stage.x", '"zero_optimization.stage" takes a value'),
    ("zero_optimization.zzzzzz", 'valid keys of "zero_optimization": '),
])
def test_dotted_keys_naming_no_real_key_are_unknown_keys(key: str, says: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A misspelt sub-key is the unknown-key error (naming the whole dotted
    key, with a did-you-mean for the sub-key), not the ignored-key warning."""
    with pytest.raises(DsrunConfigError, match=f'unknown key "{key}"') as err:
        res(base(**{key: 1, "zero_optimization.reduce_bucket_size": 2}))
    assert says in str(err.value) and "allow_unknown_keys" in str(err.value)
    with caplog.at_level(logging.WARNING):
        config = res(base(**{key: 1, "zero_optimization.reduce_bucket_size": 2},
                          dsrun={"allow_unknown_keys": True}))
    assert set(config.ignored_keys) == {key, "zero_optimization.reduce_bucket_size"}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum(says in w for w in warnings) == 1
    assert not any(f'"{key}"' in w for w in warnings if "ignoring dotted top-level" in w)


# ---------------------------------------------------------------- batch triple

VALID_TRIPLES = [
    pytest.param((32, 16, 1), (32, 16, 1), id="all-three"),
    pytest.param((32, 16, None), (32, 16, 1), id="train+micro"),
    pytest.param((32, None, 2), (32, 8, 2), id="train+accum"),
    pytest.param((None, 16, 2), (64, 16, 2), id="micro+accum"),
    pytest.param((32, None, None), (32, 16, 1), id="train-only"),
    pytest.param((None, 16, None), (32, 16, 1), id="micro-only"),
    pytest.param((64, 8, 4), (64, 8, 4), id="accumulating"),
]


@pytest.mark.parametrize(("given_", "expected"), VALID_TRIPLES)
def test_resolve_batch_valid(given_: tuple, expected: tuple) -> None:
    assert resolve_batch(*given_, 2, SRC) == expected


@pytest.mark.parametrize(("given_", "expected"), VALID_TRIPLES)
def test_resolve_batch_valid_through_config(given_: tuple, expected: tuple) -> None:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    config = res({k: v for k, v in zip(keys, given_) if v is not None})
    got = (config.train_batch_size, config.train_micro_batch_size_per_gpu,
           config.gradient_accumulation_steps)
    assert got == expected
    assert config.dp_size == 2 and config.dp_size_source == SRC


INVALID_TRIPLES = [
    pytest.param((33, 17, 1), "17 x 1 x 2 = 34", id="all-three-mismatch"),
    pytest.param((32, 16, 2), "16 x 2 x 2 = 64", id="all-three-too-big"),
    pytest.param((33, 17, None), "not divisible", id="train+micro-not-divisible"),
    pytest.param((30, 4, None), "not divisible", id="train+micro-floor-would-hide"),
    pytest.param((33, None, 2), "not divisible", id="train+accum-not-divisible"),
    pytest.param((33, None, None), "not divisible", id="train-only-odd"),
    pytest.param((None, None, None), "set train_batch_size or", id="none"),
    pytest.param((None, None, 4), "set train_batch_size or", id="accum-only"),
]


@pytest.mark.parametrize(("given_", "fragment"), INVALID_TRIPLES)
def test_resolve_batch_invalid_names_values_and_dp_source(given_: tuple, fragment: str) -> None:
    with pytest.raises(DsrunConfigError) as err:
        resolve_batch(*given_, 2, SRC)
    text = str(err.value)
    assert fragment in text
    assert SRC in text and "data-parallel size 2" in text
    for key, value in zip(("train_batch_size", "train_micro_batch_size_per_gpu",
                           "gradient_accumulation_steps"), given_):
        assert f"{key}={'not set' if value is None else value}" in text


@pytest.mark.parametrize("bad", [0, -4, 2.5, "32", True])
def test_resolve_batch_rejects_non_positive_integers(bad: Any) -> None:
    with pytest.raises(DsrunConfigError, match="train_batch_size"):
        resolve_batch(bad, None, None, 1, SRC)


@pytest.mark.parametrize("dp", [0, -1, 1.5, None])
def test_resolve_batch_rejects_bad_dp_size(dp: Any) -> None:
    with pytest.raises(DsrunConfigError, match="data-parallel size .* launcher"):
        resolve_batch(8, None, None, dp, SRC)


@given(micro=st.integers(1, 64), accum=st.integers(1, 16), dp=st.integers(1, 16),
       mask=st.tuples(st.booleans(), st.booleans(), st.booleans()))
def test_resolve_batch_property(micro: int, accum: int, dp: int, mask: tuple) -> None:
    train = micro * accum * dp
    given_ = [v if keep else None for v, keep in zip((train, micro, accum), mask)]
    if given_[0] is None and given_[1] is None:
        with pytest.raises(DsrunConfigError):
            resolve_batch(*given_, dp, SRC)
        return
    got = resolve_batch(*given_, dp, SRC)
    assert got[0] == got[1] * got[2] * dp
    if sum(mask) >= 2 or accum == 1:  # two values pin the third
        assert got == (train, micro, accum)


def test_direct_construction_checks_the_batch_equation() -> None:
    DsrunConfig(32, 16, 1, dp_size=2)
    with pytest.raises(DsrunConfigError, match="34"):
        DsrunConfig(33, 17, 1, dp_size=2, dp_size_source=SRC)


# ------------------------------------------------------------------ "auto"


def test_auto_micro_batch_takes_the_dataloader_hint() -> None:
    config = res({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                  "gradient_accumulation_steps": "auto"}, micro_batch_hint=4)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps) == (8, 4, 1)


def test_auto_accumulation_is_derived() -> None:
    config = res({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto",
                  "gradient_accumulation_steps": "auto"}, micro_batch_hint=4)
    assert config.gradient_accumulation_steps == 4


def test_auto_micro_without_hint_is_derived_or_an_error() -> None:
    assert res({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto"}
               ).train_micro_batch_size_per_gpu == 16
    with pytest.raises(DsrunConfigError, match="dataloader"):
        res({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"})


def test_bad_micro_batch_hint_is_named() -> None:
    with pytest.raises(DsrunConfigError, match="dataloader batch size"):
        res({"train_micro_batch_size_per_gpu": "auto"}, micro_batch_hint=0)


def test_auto_optimizer_values_use_deepspeed_defaults() -> None:
    config = res(base(optimizer={"type": "AdamW", "params": {
        "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}))
    assert config.optimizer is not None
    assert dict(config.optimizer.params) == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                             "weight_decay": 0.0}


def test_auto_optimizer_values_prefer_client_hints() -> None:
    config = res(base(optimizer={"type": "adam", "params": {"lr": "auto", "eps": 1e-6}}),
                 optimizer_hints={"lr": 3e-4, "eps": 1.0})
    assert config.optimizer is not None
    assert dict(config.optimizer.params) == {"lr": 3e-4, "eps": 1e-6}  # only "auto" is replaced


def test_auto_for_a_param_the_optimizer_lacks_is_an_error() -> None:
    with pytest.raises(DsrunConfigError, match='"optimizer.params.momentum".*"auto"'):
        res(base(optimizer={"type": "SGD", "params": {"momentum": "auto"}}))


def test_auto_scheduler_values() -> None:
    config = res(base(
        optimizer={"type": "AdamW", "params": {"lr": 5e-4}},
        scheduler={"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
            "total_num_steps": "auto"}}), total_num_steps=500, warmup_num_steps=50)
    assert config.scheduler is not None
    assert dict(config.scheduler.params) == {"warmup_min_lr": 0.0, "warmup_max_lr": 5e-4,
                                             "warmup_num_steps": 50, "total_num_steps": 500}


def test_auto_scheduler_defaults_and_errors() -> None:
    config = res(base(optimizer={"type": "sgd"},
                      scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto"}}))
    assert config.scheduler is not None
    assert dict(config.scheduler.params) == {"warmup_max_lr": 1e-3, "warmup_num_steps": 1000}
    with pytest.raises(DsrunConfigError, match="total_num_steps.*no total step count"):
        res(base(scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}}))
    with pytest.raises(DsrunConfigError, match="no optimizer lr"):
        res(base(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}))
    client = res(base(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}),
                 optimizer_hints={"lr": 0.02})
    assert client.scheduler is not None and client.scheduler.params["warmup_max_lr"] == 0.02


def test_auto_clipping_precision_and_zero_sizes() -> None:
    config = res(base(gradient_clipping="auto", fp16={"enabled": "auto"},
                      bf16={"enabled": "auto"},
                      zero_optimization={"stage": 3, "reduce_bucket_size": "auto",
                                         "stage3_prefetch_bucket_size": "auto",
                                         "stage3_param_persistence_threshold": "auto"}))
    assert config.gradient_clipping == 1.0
    assert not config.fp16.enabled and not config.bf16.enabled
    zero = config.zero_optimization
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size,
            zero.param_persistence_threshold) == (500_000_000, 50_000_000, 100_000)


@pytest.mark.parametrize(("section", "key"), [("fp16", "loss_scale"),
                                              ("zero_optimization", "stage")])
def test_auto_where_it_cannot_be_resolved_names_the_key(section: str, key: str) -> None:
    with pytest.raises(DsrunConfigError, match=f'"{section}.{key}" in config dict is "auto"'):
        res(base(**{section: {key: "auto"}}))


# ------------------------------------------------------------- strict keys


def test_top_level_typo_message(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "grandient_accumulation_steps": 1}))
    with pytest.raises(DsrunConfigError) as err:
        res(str(path))
    assert str(err.value).startswith(
        f'unknown key "grandient_accumulation_steps" in {path}; '
        'did you mean "gradient_accumulation_steps"?')


@pytest.mark.parametrize(("config", "fragment"), [
    (base(zero_optimization={"stgae": 2}),
     'unknown key "stgae" in "zero_optimization" of config dict; did you mean "stage"?'),
    (base(zero_optimization={"offload_optimizer": {"pin_memroy": True}}),
     'in "zero_optimization.offload_optimizer" of config dict; did you mean "pin_memory"?'),
    (base(fp16={"loss_scale_windw": 10}), 'did you mean "loss_scale_window"?'),
    (base(bf16={"enabeld": True}), 'did you mean "enabled"?'),
    (base(scheduler={"type": "WarmupLR", "params": {"warmup_num_step": 3}}),
     'in "scheduler.params" of config dict; did you mean "warmup_num_steps"?'),
    (base(optimizer={"type": "adam", "parms": {}}), 'did you mean "params"?'),
    (base(optimizer={"type": "adam", "lr": 0.1}), 'it belongs in "optimizer.params"'),
    (base(scheduler={"type": "WarmupLR", "warmup_num_steps": 3}),
     'it belongs in "scheduler.params"'),
    (base(dsrun={"allow_unknown_key": True}), 'did you mean "allow_unknown_keys"?'),
    (base(xyzzy=1), "valid keys: "),
])
def test_nested_unknown_keys_are_errors_with_suggestions(config: dict, fragment: str) -> None:
    with pytest.raises(DsrunConfigError) as err:
        res(config)
    assert fragment in str(err.value)
    assert "allow_unknown_keys" in str(err.value)  # the message names the escape hatch


def test_allow_unknown_keys_in_config_only_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.config"):
        config = res(base(dsrun={"allow_unknown_keys": True}, grandient_accumulation_steps=1,
                          zero_optimization={"stage": 1, "stgae": 2}))
    assert config.ignored_keys == ("grandient_accumulation_steps", "zero_optimization.stgae")
    assert config.zero_optimization.stage == 1
    assert 'did you mean "gradient_accumulation_steps"' in caplog.text
    assert "grandient" not in json.dumps(config.to_dict())


@pytest.mark.parametrize(("value", "allowed"), [("1", True), ("true", True), ("0", False),
                                                ("", False)])
def test_allow_unknown_keys_from_environment(value: str, allowed: bool) -> None:
    config = base(stray=1)
    env = {"DSRUN_ALLOW_UNKNOWN_CONFIG_KEYS": value}
    if allowed:
        assert res(config, environ=env).ignored_keys == ("stray",)
    else:
        with pytest.raises(DsrunConfigError, match="stray"):
            res(config, environ=env)


def test_documented_deepspeed_sections_pass_through(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.config"):
        config = res(base(autotuning={"enabled": True, "fast": True},
                          hybrid_engine={"enabled": False}, zero_allow_untested_optimizer=True))
    assert dict(config.passthrough)["autotuning"]["fast"] is True
    assert "autotuning" in caplog.text and "hybrid_engine" not in caplog.text
    assert config.zero_allow_untested_optimizer is True
    assert config.to_dict()["autotuning"] == {"enabled": True, "fast": True}


def test_the_pipeline_section_is_checked(caplog: pytest.LogCaptureFixture) -> None:
    config = res(base(pipeline={"activation_checkpoint_interval": 2, "use_reentrant": False}))
    assert (config.pipeline.activation_checkpoint_interval, config.pipeline.use_reentrant) == \
        (2, False)
    assert res(base()).pipeline.use_reentrant is None
    with pytest.raises(DsrunConfigError, match='did you mean "activation_checkpoint_interval"'):
        res(base(pipeline={"activation_checkpoint_intervals": 2}))
    with pytest.raises(DsrunConfigError, match='pipeline.use_reentrant" in config dict must be '
                                               "true or false"):
        res(base(pipeline={"use_reentrant": "yes"}))
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.config"):
        res(base(pipeline={"stages": 2, "partition": "uniform"}))
    assert "pipeline.stages/partition (as in DeepSpeed: pass num_stages=" in caplog.text
    assert config.to_dict()["pipeline"]["activation_checkpoint_interval"] == 2


def test_config_warnings_are_said_by_the_first_rank_only(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()  # the rank then comes from RANK, as a launcher sets it
    for rank, said in (("1", 0), ("0", 1), (None, 1)):
        if rank is None:
            monkeypatch.delenv("RANK", raising=False)
        else:
            monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dsrun.runtime.config"):
            res(base(disable_allgather=True, autotuning={"enabled": True}))
        assert caplog.text.count("dsrun accepts but does not") == 2 * said, (rank, caplog.text)


def test_inert_settings_are_named_once(caplog: pytest.LogCaptureFixture) -> None:
    from dsrun.runtime.config import inert_settings

    assert inert_settings(res(base())) == []
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.config"):
        config = res(base(disable_allgather=True, vocabulary_size=50257,
                          seq_parallel_communication_data_type="bf16",
                          gradient_predivide_factor=4.0,
                          zero_optimization={"stage": 2}))
    notes = inert_settings(config)
    assert notes[:3] == ["disable_allgather", "vocabulary_size",
                         "seq_parallel_communication_data_type"]
    assert notes[3].startswith("gradient_predivide_factor (ZeRO stages")
    assert caplog.text.count("does not act on") == 1 and "vocabulary_size" in caplog.text
    # stage 0 applies the predivide factor; defaults set explicitly are not notes
    assert inert_settings(res(base(gradient_predivide_factor=4.0, disable_allgather=False))) == []


def test_did_you_mean_ignores_case_and_gives_up_on_nonsense() -> None:
    assert did_you_mean("ADAMW", ["Adam", "AdamW"]) == '; did you mean "AdamW"?'
    assert did_you_mean("qqqq", ["stage"]) == ""


# -------------------------------------------------------------------- types


@pytest.mark.parametrize(("config", "fragment"), [
    ({"train_batch_size": "32"}, '"train_batch_size" in config dict must be an integer >= 1, '
                                 'got "32"'),
    ({"train_batch_size": 2.5}, 'got 2.5'),
    (base(gradient_clipping=-1), '"gradient_clipping" in config dict must be a number >= 0'),
    (base(fp16={"enabled": "yes"}), '"fp16.enabled" in config dict must be true or false'),
    (base(zero_optimization={"stage": "2"}), '"zero_optimization.stage"'),
    (base(zero_optimization={"stage": 4}), "in [0, 3], got 4"),
    (base(zero_optimization={"offload_param": {"device": "gpu"}}), 'one of "none", "cpu"'),
    (base(steps_per_print=0), '"steps_per_print"'),
    (base(communication_data_type="fp64"), '"communication_data_type"'),
    (base(fp16=[1]), '"fp16" in config dict must be a JSON object, got [1]'),
    (base(optimizer={"type": "adam", "params": [1]}), '"optimizer.params"'),
    (base(scheduler={"type": "WarmupLR", "params": {"warmup_type": "cosine"}}),
     'one of "log", "linear"'),
    (base(scheduler={"type": "OneCycle", "params": {"cycle_min_lr": "0.1", "cycle_max_lr": 1}}),
     '"scheduler.params.cycle_min_lr"'),
])
def test_wrong_types_name_key_and_value(config: dict, fragment: str) -> None:
    with pytest.raises(DsrunConfigError) as err:
        res(config)
    assert fragment in str(err.value)


@pytest.mark.parametrize(("fp16", "fragment"), [
    ({"min_loss_scale": 0}, "fp16.min_loss_scale=0 must be > 0 with dynamic loss scaling"),
    ({"initial_scale_power": 128}, '"fp16.initial_scale_power" in config dict must be an '
                                   "integer in [0, 127], got 128"),
    ({"initial_scale_power": 2, "min_loss_scale": 8},
     "fp16.min_loss_scale=8 is above the initial loss scale 2**fp16.initial_scale_power = 4"),
])
def test_dynamic_loss_scale_settings_that_cannot_work(fp16: dict, fragment: str) -> None:
    with pytest.raises(DsrunConfigError) as err:
        res(base(fp16={"enabled": True, **fp16}))
    assert fragment in str(err.value)
    # as DeepSpeed, the dynamic keys are checked only where they act
    res(base(fp16={"enabled": True, "loss_scale": 128, "min_loss_scale": 0}))
    res(base(fp16={"enabled": False, "min_loss_scale": 0}))


def test_integral_floats_are_accepted_as_integers() -> None:
    zero = res(base(zero_optimization={"stage": 2.0, "reduce_bucket_size": 5e8,
                                       "allgather_bucket_size": 2e8})).zero_optimization
    assert zero.stage == 2 and isinstance(zero.stage, int)
    assert zero.reduce_bucket_size == 500_000_000 and isinstance(zero.reduce_bucket_size, int)


# ------------------------------------------------------------------ sections


def test_fp16_and_bf16_together_are_rejected() -> None:
    with pytest.raises(DsrunConfigError, match="fp16.enabled and bf16.enabled are both true"):
        res(base(fp16={"enabled": True}, bf16={"enabled": True}))


def test_bfloat16_legacy_alias() -> None:
    assert res(base(bfloat16={"enabled": True})).bf16.enabled
    assert res(base(bfloat16={"enabled": True})).precision == "bf16"
    with pytest.raises(DsrunConfigError, match="bfloat16"):
        res(base(bf16={"enabled": True}, bfloat16={"enabled": True}))
    with pytest.raises(DsrunConfigError, match="fp16.enabled and bf16.enabled"):
        res(base(fp16={"enabled": True}, bfloat16={"enabled": True}))


def test_fp16_defaults_and_values() -> None:
    fp16 = res(base(fp16={"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                          "min_loss_scale": 0.5})).fp16
    assert fp16.enabled and fp16.dynamic_loss_scale and fp16.initial_dynamic_scale == 4096.0
    assert (fp16.loss_scale_window, fp16.hysteresis, fp16.min_loss_scale) == (1000, 2, 0.5)
    assert FP16Config().initial_scale_power == 16 and not FP16Config().enabled
    assert not FP16Config(loss_scale=128).dynamic_loss_scale


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_accepted_and_overlap_default(stage: int) -> None:
    zero = res(base(zero_optimization={"stage": stage})).zero_optimization
    assert zero.stage == stage
    assert zero.overlap_comm is (stage == 3)  # DeepSpeed's dynamic default


def test_zero_documented_keys_and_stage3_aliases() -> None:
    raw = {"stage": 3, "contiguous_gradients": False, "reduce_scatter": False,
           "reduce_bucket_size": 1, "allgather_partitions": False, "allgather_bucket_size": 2,
           "overlap_comm": False, "round_robin_gradients": True, "sub_group_size": 3,
           "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "pin_memory": True,
                                 "buffer_count": 8, "ratio": 0.5},
           "offload_param": {"device": "cpu", "pin_memory": True, "max_in_cpu": 7},
           "stage3_prefetch_bucket_size": 4, "stage3_param_persistence_threshold": 5,
           "stage3_max_live_parameters": 6, "max_reuse_distance": 9,
           "stage3_gather_16bit_weights_on_model_save": True, "elastic_checkpoint": True,
           "ignore_unused_parameters": False, "load_from_fp32_weights": False,
           "zero_quantized_weights": True, "leaf_module": {"names": ["experts"]}}
    zero = res(base(zero_optimization=raw)).zero_optimization
    assert (zero.prefetch_bucket_size, zero.param_persistence_threshold,
            zero.max_live_parameters, zero.max_reuse_distance) == (4, 5, 6, 9)
    assert zero.gather_16bit_weights_on_model_save and not zero.overlap_comm
    assert zero.offload_optimizer == OffloadOptimizerConfig(
        device="nvme", nvme_path="/x", pin_memory=True, buffer_count=8, ratio=0.5)
    assert zero.offload_param is not None and zero.offload_param.max_in_cpu == 7
    assert zero.leaf_module == {"names": ("experts",)}
    with pytest.raises(DsrunConfigError, match="given twice"):
        res(base(zero_optimization={"stage3_max_reuse_distance": 1, "max_reuse_distance": 2}))


def test_zero_flags_deepspeed_refuses() -> None:
    """DeepSpeed 0.19.8's rules: legacy_stage1 refused; compute_grad_norm
    false only at stages 1-2 without clipping (dsrun computes the norm
    anyway); parameter_alignment accepted (a layout knob)."""
    zero = res(base(zero_optimization={"stage": 2, "compute_grad_norm": False,
                                       "parameter_alignment": True},
                    gradient_clipping=0)).zero_optimization
    assert zero.compute_grad_norm is False and zero.parameter_alignment is True
    with pytest.raises(DsrunConfigError, match="legacy_stage1 in .*not supported"):
        res(base(zero_optimization={"stage": 1, "legacy_stage1": True}))
    with pytest.raises(DsrunConfigError, match=r"compute_grad_norm=false .*stage 1 or 2 \(stage 3"):
        res(base(zero_optimization={"stage": 3, "compute_grad_norm": False},
                 gradient_clipping=0))
    with pytest.raises(DsrunConfigError, match="requires gradient_clipping 0 .it is 1."):
        res(base(zero_optimization={"stage": 1, "compute_grad_norm": False}))


def test_zero_legacy_forms() -> None:
    zero = res(base(zero_optimization={"stage": 2, "cpu_offload": True,
                                       "cpu_offload_use_pin_memory": True})).zero_optimization
    assert zero.offload_optimizer == OffloadOptimizerConfig(device="cpu", pin_memory=True)
    assert zero.cpu_offload is None  # folded into offload_optimizer
    assert res(base(zero_optimization=True)).zero_optimization.stage == 1
    assert res(base(zero_optimization=False)).zero_optimization.stage == 0


def test_zero_partial_offload_needs_stage_3() -> None:
    with pytest.raises(DsrunConfigError, match="needs ZeRO stage 3, got stage 2"):
        res(base(zero_optimization={"stage": 2, "offload_optimizer": {"ratio": 0.3}}))


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("section,flag", [("fp16", "fp16_master_weights_and_grads"),
                                          ("bf16", "bf16_master_weights_and_grads"),
                                          ("bf16", "bf16_optimizer_states")])
def test_16bit_master_weights_and_states_are_refused(stage: int, section: str, flag: str) -> None:
    """Not silently trained in fp32: dsrun keeps fp32 masters and states."""
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    with pytest.raises(DsrunConfigError, match=f"{section}.{flag} in .*not implemented in dsrun"):
        res(base(**{section: {"enabled": True, flag: True}}, zero_optimization=zero))
    off = res(base(**{section: {"enabled": True, flag: False}}, zero_optimization=zero))
    assert not getattr(getattr(off, section), flag)


@pytest.mark.parametrize(("given_", "canonical"), [("Adam", "adam"), ("ADAMW", "adamw"),
                                                   ("lamb", "lamb"), ("SGD", "sgd"),
                                                   ("adagrad", "adagrad")])
def test_optimizer_type_is_case_insensitive(given_: str, canonical: str) -> None:
    config = res(base(optimizer={"type": given_, "params": {"lr": 0.1}}))
    assert config.optimizer == OptimizerConfig(canonical, {"lr": 0.1})


@pytest.mark.parametrize(("section", "value", "fragment"), [
    ("optimizer", {"type": "AdamWW"}, 'unknown optimizer type "AdamWW"; did you mean "AdamW"?'),
    ("optimizer", {"type": "OneBitAdam"}, "DeepSpeed has removed: DeepSpeed 0.19.8 refuses"),
    ("optimizer", {"type": "Muon"}, 'optimizer type "Muon" is not available in dsrun: '
                                    "DeepSpeed's Muon (MuonWithAuxAdam"),
    ("optimizer", {"type": "SparseAdam"}, "pass it as optimizer= (ZeRO stage 0)"),
    ("optimizer", {"params": {}}, 'needs a "type"'),
    ("optimizer", {"type": "adam", "params": {"max_grad_norm": 1.0}}, "gradient_clipping"),
    ("scheduler", {"type": "WarmupDecay"}, 'did you mean "WarmupDecayLR"?'),
    ("scheduler", {"type": "Cosine"}, "valid: WarmupLR, WarmupDecayLR, WarmupCosineLR"),
    ("scheduler", {"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}, '"cycle_max_lr"'),
    ("scheduler", {"type": "WarmupDecayLR", "params": {}}, '"total_num_steps"'),
])
def test_optimizer_and_scheduler_type_errors(section: str, value: dict, fragment: str) -> None:
    with pytest.raises(DsrunConfigError) as err:
        res(base(**{section: value}))
    assert fragment in str(err.value)
    if "type" in fragment:
        assert "valid: Adam, AdamW, Lamb, SGD" in str(err.value)


def test_scheduler_type_is_case_insensitive_and_canonical() -> None:
    config = res(base(scheduler={"type": "warmupcosinelr",
                                 "params": {"total_num_steps": 10, "warmup_num_steps": 2}}))
    assert config.scheduler == SchedulerConfig("WarmupCosineLR",
                                               {"total_num_steps": 10, "warmup_num_steps": 2})


def test_scheduler_per_group_lists_become_tuples() -> None:
    config = res(base(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, 0.2]}}))
    assert config.scheduler is not None
    assert config.scheduler.params["warmup_max_lr"] == (0.1, 0.2)


def test_auto_defaults_cover_every_optimizer_type() -> None:
    for kind, defaults in AUTO_OPTIMIZER_DEFAULTS.items():
        # torch's Rprop is the one without weight decay
        assert "lr" in defaults and ("weight_decay" in defaults or kind == "rprop"), kind


# --------------------------------------------------------- frozen, validated


def test_configs_are_frozen_and_params_read_only() -> None:
    config = res(base(optimizer={"type": "adam", "params": {"lr": 0.1, "betas": [0.8, 0.9]}}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.train_batch_size = 4  # type: ignore[misc]
    assert config.optimizer is not None
    with pytest.raises(TypeError):
        config.optimizer.params["lr"] = 1.0  # type: ignore[index]
    assert config.optimizer.params["betas"] == (0.8, 0.9)


@pytest.mark.parametrize(("build", "fragment"), [
    (lambda: ZeroConfig(stage=5), "ZeroConfig.stage must be an integer in [0, 3], got 5"),
    (lambda: FP16Config(loss_scale=-1.0), "FP16Config.loss_scale"),
    (lambda: OffloadOptimizerConfig(ratio=2.0), "OffloadOptimizerConfig.ratio"),
    (lambda: OptimizerConfig("adamx"), "unknown optimizer type"),
    (lambda: SchedulerConfig("WarmupLR", {"warmup_num_steps": 0}), "warmup_num_steps"),
    (lambda: DsrunConfig(8, 4, 1, zero_optimization={"stage": 1}), "must be a ZeroConfig"),
])
def test_direct_construction_is_validated(build: Any, fragment: str) -> None:
    with pytest.raises(DsrunConfigError) as err:
        build()
    assert fragment in str(err.value)


# ---------------------------------------------------------------- JSON files


def test_json_file_loads_and_source_is_carried(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    config = resolve(path, dp_size=3, dp_source=SRC, environ={})
    assert (config.train_batch_size, config.source) == (6, str(path))
    assert load_config(path) == ({"train_micro_batch_size_per_gpu": 2}, str(path))


def test_invalid_json_reports_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {enabled: true}\n}\n')
    with pytest.raises(DsrunConfigError) as err:
        res(str(path))
    assert str(err.value).startswith(f"{path}: line 3, column 12: invalid JSON")


@pytest.mark.parametrize(("text", "fragment"), [
    ('{"train_batch_size": 8, "train_batch_size": 4}', 'duplicate key "train_batch_size"'),
    ("[1, 2]", "must hold a JSON object"),
])
def test_json_content_errors(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(DsrunConfigError, match=fragment):
        res(str(path))


def test_missing_file_and_wrong_input_type(tmp_path: Path) -> None:
    with pytest.raises(DsrunConfigError, match="cannot read config file .*nope.json"):
        res(str(tmp_path / "nope.json"))
    with pytest.raises(DsrunConfigError, match="got int"):
        res(3)


def test_type_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"train_batch_size": "32"}')
    with pytest.raises(DsrunConfigError, match=f'"train_batch_size" in {path}'):
        res(str(path))


# ------------------------------------------------------- to_dict, summary


FULL: dict[str, Any] = {
    "train_batch_size": 64, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95]}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100,
                                                       "warmup_num_steps": 10}},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "steps_per_print": 5, "wall_clock_breakdown": True, "communication_data_type": "fp32",
    "wandb": {"enabled": True},
}


def test_to_dict_round_trips_and_is_json() -> None:
    config = res(FULL)
    data = json.loads(json.dumps(config.to_dict()))
    assert data["train_micro_batch_size_per_gpu"] == 16
    assert data["optimizer"] == {"type": "adamw", "params": {"lr": 1e-4, "betas": [0.9, 0.95]},
                                 "legacy_fusion": False}
    assert data["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    assert data["wandb"] == {"enabled": True, "project": "deepspeed"}
    assert "dp_size" not in data and "source" not in data
    assert res(data) == config


def test_summary_mentions_the_resolved_choices() -> None:
    text = res(FULL).summary()
    for fragment in ("train 64 = micro 16 x accumulation 2 x data-parallel 2", SRC,
                     "precision: fp16 (dynamic loss scale, initial 2^8)", "zero: stage 2",
                     "offload optimizer to cpu", "gradient clipping: 0.5", "AdamW(lr=0.0001",
                     "WarmupCosineLR(total_num_steps=100", "wandb"):
        assert fragment in text, fragment
    bf16 = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}
    assert "precision: bf16\n" in res(bf16, dp=1).summary() + "\n"
    assert res(bf16, dp=1).bf16.check_grad_overflow  # DeepSpeed's default
    off = res({**bf16, "bf16": {"enabled": True, "check_grad_overflow": False}}, dp=1)
    assert "precision: bf16 (check_grad_overflow false: a non-finite gradient is stepped)" \
        in off.summary()


def test_defaults() -> None:
    config = res({"train_micro_batch_size_per_gpu": 1}, dp=1)
    # gradient_clipping 1.0: DeepSpeed 0.19.8's default (its constants.py); 0 turns it off
    assert (config.steps_per_print, config.gradient_clipping, config.precision) == (10, 1.0, "fp32")
    assert res({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0}, dp=1
               ).gradient_clipping == 0.0
    assert config.optimizer is None and config.scheduler is None
    assert config.zero_optimization == ZeroConfig()
    assert config.communication_data_type is None and config.gradient_predivide_factor == 1.0


def _opt_lr(config: DsrunConfig) -> Optional[float]:
    return None if config.optimizer is None else config.optimizer.params.get("lr")


def test_optimizer_absent_params_is_empty_mapping() -> None:
    config = res(base(optimizer={"type": "sgd"}))
    assert config.optimizer is not None and dict(config.optimizer.params) == {}
    assert _opt_lr(config) is None


def test_resolve_does_not_mutate_its_input() -> None:
    raw = base(gradient_clipping="auto", fp16={"enabled": "auto"},
               optimizer={"type": "adam", "params": {"lr": "auto"}},
               zero_optimization={"stage": 1, "reduce_bucket_size": "auto"})
    snapshot = json.dumps(raw, sort_keys=True)
    res(raw)
    assert json.dumps(raw, sort_keys=True) == snapshot


def test_nested_mappings_are_frozen_and_predivide_must_be_positive() -> None:
    checkpoint = res(base(checkpoint={"writer": {"type": "fast"}})).checkpoint
    with pytest.raises(TypeError):
        checkpoint.writer["type"] = "slow"  # type: ignore[index]
    with pytest.raises(DsrunConfigError, match="gradient_predivide_factor .* must be > 0"):
        res(base(gradient_predivide_factor=0))


# DeepSpeed 0.19.8's newer top-level keys: taken, applied or refused by name


@pytest.mark.parametrize("extra, attr, value", [
    ({"gradient_allreduce_op": "mean"}, "gradient_allreduce_op", "mean"),
    ({"managed_gradient_accumulation": True}, "managed_gradient_accumulation", True),
    ({"disable_python_gc": True}, "disable_python_gc", True),
    ({"log_level": "warning"}, "log_level", "warning"),
    ({"seq_parallel_communication_data_type": "bf16"}, "seq_parallel_communication_data_type",
     "bf16"),
])
def test_newer_deepspeed_keys_are_taken(extra: dict, attr: str, value: object) -> None:
    assert getattr(res(base(**extra)), attr) == value


@pytest.mark.parametrize("extra, message", [
    ({"gradient_allreduce_op": "sum"}, 'gradient_allreduce_op "sum" in config dict is not '
                                       "implemented"),
    ({"gradient_allreduce_op": "max"}, '"gradient_allreduce_op" in config dict must be one of'),
    ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation false in config "
                                               "dict is not implemented"),
    ({"log_level": "verbose"}, '"log_level" in config dict must be one of'),
    ({"amp": {"enabled": True}}, '"amp" in config dict: NVIDIA Apex AMP integration has been '
                                 "removed"),
    # dsrun's old spelling of the key was never DeepSpeed's
    ({"seq_parallel_comm_data_type": "bf16"},
     'did you mean "seq_parallel_communication_data_type"'),
])
def test_newer_deepspeed_keys_refused_by_name(extra: dict, message: str) -> None:
    with pytest.raises(DsrunConfigError, match=message):
        res(base(**extra))


def test_expert_parallel_and_aio_pass_through(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.config"):
        config = res(base(expert_parallel={"enabled": True}))
    assert set(config.passthrough) == {"expert_parallel"}
    assert "does not implement: expert_parallel" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.config"):
        # Lightning's DeepSpeedStrategy writes DeepSpeed's NVMe I/O section into every config
        config = res(base(aio={"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
                               "single_submit": False, "overlap_events": True}))
    assert "aio" in config.passthrough and "does not implement" not in caplog.text


def test_timers_section_is_read_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """``timers.throughput`` drives the engine's tput_timer: no "does not
    implement" warning, not listed as "not acted on"."""
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.config"):
        config = res(base(timers={"throughput": {"enabled": True, "synchronized": False}}))
    assert "does not implement" not in caplog.text
    assert config.timers.throughput.synchronized is False and "timers" not in config.passthrough
    assert "not acted on" not in config.summary()
    assert "not acted on: autotuning" in res(base(autotuning={"enabled": True})).summary()


def test_data_types_is_checked_and_named_when_not_what_dsrun_accumulates_in() -> None:
    from dsrun.runtime.config import inert_settings

    # DeepSpeed's DtypeEnum spellings; fp32 under bf16 is what dsrun does anyway
    for name in ("fp32", "float", "torch.float32"):
        assert inert_settings(res(base(bf16={"enabled": True},
                                       data_types={"grad_accum_dtype": name}))) == []
    assert inert_settings(res(base(fp16={"enabled": True},
                                   data_types={"grad_accum_dtype": "half"}))) == []
    notes = inert_settings(res(base(bf16={"enabled": True},
                                    data_types={"grad_accum_dtype": "bf16"})))
    assert notes == ["data_types.grad_accum_dtype 'bf16' (dsrun accumulates gradients in the "
                     "trained parameters' dtype, float32 here)"]
    notes = inert_settings(res(base(fp16={"enabled": True},
                                    data_types={"grad_accum_dtype": "fp32"})))
    assert notes == ["data_types.grad_accum_dtype 'fp32' (dsrun accumulates gradients in the "
                     "trained parameters' dtype, float16 here; ZeRO 2-3 sum reduced micro-steps "
                     "in float32 with float16's overflow rule)"]
    with pytest.raises(DsrunConfigError, match="data_types.grad_accum_dtype"):
        res(base(data_types={"grad_accum_dtype": "int8"}))
    with pytest.raises(DsrunConfigError, match="grad_accum_dtype"):
        res(base(data_types={"grad_acum_dtype": "fp32"}))


def test_steps_per_print_infinity_or_null_means_never(
        caplog: pytest.LogCaptureFixture) -> None:
    """Accelerate's DeepSpeedPlugin always sets steps_per_print to Infinity."""
    from dsrun.runtime.progress import LOGGER_NAME, Progress

    for never in (float("inf"), None):
        config = res(base(steps_per_print=never))
        assert config.steps_per_print is None
        again = res(json.loads(json.dumps(config.to_dict())))
        assert again == config
    with pytest.raises(DsrunConfigError, match="steps_per_print"):
        res(base(steps_per_print=0))
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        for every, lines in ((None, 0), (1, 3)):
            caplog.clear()
            progress = Progress(every, 8, enabled=True)
            for step in range(1, 4):
                progress.step(step, 0, [0.1])
            assert sum("step=" in r.getMessage() for r in caplog.records) == lines
