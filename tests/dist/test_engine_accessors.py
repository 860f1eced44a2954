"""More of DeepSpeed's engine accessors (dsrun.runtime.engine_info) on a
one-rank engine in this process. The expected values are what DeepSpeed
0.19.8's engine answers for the same config (bench/.venv-ds, CPU)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import dsrun
from dsrun.errors import DsrunError

pytestmark = pytest.mark.dist


def build(config: dict, optimizer: Any = None, **kwargs: Any) -> dsrun.DsrunEngine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine, _, _, _ = dsrun.initialize(model=model, config=config, optimizer=optimizer,
                                       **kwargs)
    return engine


def test_optimizer_scheduler_fp16_and_zero_settings(solo: None) -> None:
    engine = build({
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.8, 0.9]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 50,
                 "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 2},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000,
                              "allgather_bucket_size": 2000, "overlap_comm": True,
                              "contiguous_gradients": False, "sub_group_size": 3000,
                              "stage3_max_live_parameters": 4000,
                              "stage3_prefetch_bucket_size": 5000,
                              "stage3_param_persistence_threshold": 6000}})
    assert engine.optimizer_name() == "adamw"
    params = engine.optimizer_params()
    assert params == {"lr": 0.01, "betas": [0.8, 0.9]}
    params["lr"] = 1.0  # a copy: the config keeps its value
    assert engine.optimizer_params() == {"lr": 0.01, "betas": [0.8, 0.9]}
    assert engine.scheduler_name() == "WarmupLR"
    assert engine.scheduler_params() == {"warmup_num_steps": 10}
    assert engine.initial_dynamic_scale() == 256
    assert engine.dynamic_loss_scale_args() == {
        "init_scale": 256, "scale_window": 50, "delayed_shift": 3,
        "consecutive_hysteresis": True, "min_scale": 2}
    assert isinstance(engine.dynamic_loss_scale_args()["min_scale"], int)
    assert engine.zero_allow_untested_optimizer()
    got = (engine.zero_reduce_bucket_size(), engine.zero_allgather_bucket_size(),
           engine.zero_overlap_comm(), engine.zero_contiguous_gradients(),
           engine.zero_sub_group_size(), engine.zero_max_live_parameters(),
           engine.zero_prefetch_bucket_size(), engine.zero_param_persistence_threshold())
    assert got == (1000, 2000, True, False, 3000, 4000, 5000, 6000)


def test_defaults_are_deepspeeds(solo: None) -> None:
    engine = build({"train_batch_size": 2, "optimizer": {"type": "SGD"},
                    "zero_optimization": {"stage": 1}})
    assert engine.optimizer_name() == "SGD" and engine.optimizer_params() is None
    assert engine.scheduler_name() is None and engine.scheduler_params() is None
    assert engine.initial_dynamic_scale() == 65536
    assert engine.dynamic_loss_scale_args() == {
        "init_scale": 65536, "scale_window": 1000, "delayed_shift": 2,
        "consecutive_hysteresis": False, "min_scale": 1}
    assert not engine.torch_autocast_enabled() and engine.torch_autocast_dtype() is None
    assert not engine.zero_allow_untested_optimizer()
    got = (engine.zero_reduce_bucket_size(), engine.zero_allgather_bucket_size(),
           engine.zero_overlap_comm(), engine.zero_contiguous_gradients(),
           engine.zero_sub_group_size(), engine.zero_max_live_parameters(),
           engine.zero_prefetch_bucket_size(), engine.zero_param_persistence_threshold())
    assert got == (500_000_000, 500_000_000, False, True, 1_000_000_000, 1_000_000_000,
                   50_000_000, 100_000)
    # overlap_comm defaults to on at stage 3 (DeepSpeed's)
    assert build({"train_batch_size": 2, "zero_optimization": {"stage": 3}}).zero_overlap_comm()


@pytest.mark.parametrize("dtype,expected", [("bf16", torch.bfloat16),
                                            ("torch.bfloat16", torch.bfloat16), (None, None)])
def test_torch_autocast(solo: None, dtype: Any, expected: Any) -> None:
    section: dict[str, Any] = {"enabled": True}
    if dtype is not None:
        section["dtype"] = dtype
    engine = build({"train_batch_size": 2, "torch_autocast": section,
                    "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == expected


@pytest.mark.parametrize("given,name", [("AdamW", "adamw"), ("ADAM", "adam"),
                                        ("Adagrad", "adagrad"), ("lion", "lion"),
                                        ("sgd", "SGD"), ("RMSprop", "RMSprop")])
def test_optimizer_name_is_deepspeeds_spelling(solo: None, given: str, name: str) -> None:
    """DeepSpeed lower-cases its own optimizers' names; torch.optim's keep
    torch's spelling."""
    engine = build({"train_batch_size": 2, "optimizer": {"type": given, "params": {"lr": 0.1}}})
    assert engine.optimizer_name() == name


def test_client_optimizer_wins_the_name_not_the_params(solo: None) -> None:
    model = torch.nn.Linear(4, 2)
    client = torch.optim.RMSprop(model.parameters(), lr=0.1)
    engine, _, _, _ = dsrun.initialize(model=model, optimizer=client, config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.5}}})
    assert engine.optimizer_name() == "RMSprop"
    assert engine.optimizer_params() == {"lr": 0.5}  # DeepSpeed's: the config's


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_basic_optimizer_is_the_torch_optimizer_that_steps(solo: None, stage: int) -> None:
    model = torch.nn.Linear(4, 2)
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, _, _, _ = dsrun.initialize(model=model, optimizer=client, config={
        "train_batch_size": 2, "zero_optimization": {"stage": stage}})
    basic = engine.basic_optimizer
    assert isinstance(basic, torch.optim.SGD)
    if stage == 0:
        assert basic is client and basic is engine.optimizer
    else:  # DeepSpeed's relation: its ZeRO optimizer's .optimizer
        assert basic is engine.optimizer.optimizer
    assert [g["lr"] for g in basic.param_groups] == engine.get_lr()


def test_no_basic_optimizer_without_an_optimizer(solo: None) -> None:
    assert build({"train_batch_size": 2}).basic_optimizer is None
    partition_only = build({"train_batch_size": 2, "zero_optimization": {"stage": 3}})
    assert partition_only.basic_optimizer is None


def test_groups_and_parallelism(solo: None) -> None:
    engine = build({"train_batch_size": 2})
    assert engine.get_data_parallel_rank() == 0 and engine.get_tensor_parallel_rank() == 0
    assert engine.get_sequence_parallel_group() is None
    assert engine.has_moe_layers is False and engine.pipeline_parallelism is False
    assert engine.dist_backend == "gloo"
    engine.mpu = SimpleNamespace(get_tensor_model_parallel_rank=lambda: 3,
                                 get_model_parallel_rank=lambda: 5)
    assert engine.get_tensor_parallel_rank() == 3
    engine.mpu = SimpleNamespace(get_model_parallel_rank=lambda: 5)
    assert engine.get_tensor_parallel_rank() == 5
    engine.mpu = SimpleNamespace(get_slice_parallel_rank=lambda: 2)  # a pipeline grid's name
    assert engine.get_tensor_parallel_rank() == 2


def test_a_pipeline_engine_says_pipeline_parallelism(solo: None) -> None:
    from dsrun.pipe import LayerSpec, PipelineModule

    pipe, _, _, _ = dsrun.initialize(
        model=PipelineModule([LayerSpec(torch.nn.Linear, 2, 2)], num_stages=1,
                             loss_fn=torch.nn.MSELoss()),
        config={"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert pipe.pipeline_parallelism is True


def test_offload_and_reload_states_are_refused(solo: None) -> None:
    engine = build({"train_batch_size": 2, "zero_optimization": {"stage": 3},
                    "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    with pytest.raises(DsrunError, match="offload_states.*not supported"):
        engine.offload_states()
    with pytest.raises(DsrunError, match="reload_states.*not supported"):
        engine.reload_states(non_blocking=True)


def test_training_data_and_collate_fn_as_given(solo: None) -> None:
    data = [torch.randn(4) for _ in range(4)]

    def collate(batch: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(batch)

    engine = build({"train_batch_size": 2}, training_data=data, collate_fn=collate)
    assert engine.training_data is data and engine.collate_fn is collate
    plain = build({"train_batch_size": 2})
    assert plain.training_data is None and plain.collate_fn is None


# ------------------------------------- fp16_auto_cast, the zero_* knobs, DeepSpeed's
# attributes. Expected values: DeepSpeed 0.19.8's engine for the same config
# (bench/.venv-ds, CPU, one rank).

def _knobs(engine: dsrun.DsrunEngine) -> tuple:
    return (engine.fp16_auto_cast(), engine.zero_reduce_scatter(),
            engine.zero_allgather_partitions(), engine.zero_ignore_unused_parameters(),
            engine.zero_round_robin_gradients(), engine.zero_elastic_checkpoint(),
            engine.zero_multi_rank_bucket_allreduce())


def test_zero_and_fp16_switches_as_configured(solo: None) -> None:
    engine = build({
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "fp16": {"enabled": True, "auto_cast": True},
        "zero_optimization": {"stage": 2, "reduce_scatter": False, "allgather_partitions": False,
                              "ignore_unused_parameters": False, "round_robin_gradients": True,
                              "elastic_checkpoint": True,
                              "use_multi_rank_bucket_allreduce": False}})
    assert _knobs(engine) == (True, False, False, False, True, True, False)
    assert (engine.zero_compute_grad_norm(), engine.zero_parameter_alignment()) == (True, False)
    tuned = build({"train_batch_size": 2, "gradient_clipping": 0,
                   "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                   "zero_optimization": {"stage": 1, "compute_grad_norm": False,
                                         "parameter_alignment": True}})
    assert (tuned.zero_compute_grad_norm(), tuned.zero_parameter_alignment()) == (False, True)
    assert engine.optimizer.dynamic_loss_scale is True


def test_stage3_knobs_as_configured(solo: None) -> None:
    engine = build({
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 123,
                              "stage3_model_persistence_threshold": 456,
                              "stage3_module_granularity_threshold": 7,
                              "stage3_allgather_sequential": True,
                              "log_trace_cache_warnings": True, "enable_sanity_checks": True}})
    got = (engine.zero_max_reuse_distance(), engine.zero_model_persistence_threshold(),
           engine.zero_module_granularity_threshold(), engine.zero_allgather_sequential(),
           engine.zero_log_trace_cache_warnings(), engine.is_sanity_checks_enabled())
    assert got == (123, 456, 7, True, True, True)


def test_more_defaults_are_deepspeeds(solo: None) -> None:
    engine = build({"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                    "zero_optimization": {"stage": 1}})
    assert _knobs(engine) == (False, True, True, True, False, False, True)
    got = (engine.zero_legacy_stage1(), engine.zero_max_reuse_distance(),
           engine.zero_model_persistence_threshold(), engine.zero_module_granularity_threshold(),
           engine.zero_allgather_sequential(), engine.zero_log_trace_cache_warnings(),
           engine.is_sanity_checks_enabled(), engine.zero_force_ds_cpu_optimizer())
    assert got == (False, 1_000_000_000, 9223372036854775807, 0, False, False, False, True)
    assert (engine.zero_hpz_partition_size(), engine.zero_quantized_weights(),
            engine.zero_quantized_nontrainable_weights(),
            engine.zero_quantized_gradients()) == (1, False, False, False)
    assert (engine.fp16_master_weights_and_gradients(),
            engine.bf16_master_weights_and_gradients(),
            engine.bf16_optimizer_states()) == (False, False, False)
    assert engine.autotp_size() == 0
    assert engine.torch_autocast_lower_precision_safe_modules() == [
        "torch.nn.modules.linear.Linear", "torch.nn.modules.conv.Conv1d",
        "torch.nn.modules.conv.Conv2d", "torch.nn.modules.conv.Conv3d"]
    assert engine.sequence_parallel_size == 1
    assert engine.seq_dp_world_size == engine.dp_world_size == 1
    assert engine.warn_unscaled_loss is True and engine.inside_no_sync_ctxt is False


def test_lower_precision_safe_modules_as_configured(solo: None) -> None:
    engine = build({"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                    "torch_autocast": {"enabled": True, "dtype": "bf16",
                                       "lower_precision_safe_modules": ["torch.nn.Linear"]}})
    assert engine.torch_autocast_lower_precision_safe_modules() == ["torch.nn.Linear"]


ADAMW = {"type": "AdamW", "params": {"lr": 0.01}}


@pytest.mark.parametrize("stage,precision,dynamic", [
    (1, {"fp16": {"enabled": True}}, True),
    (3, {"fp16": {"enabled": True}}, True),
    (2, {"fp16": {"enabled": True, "loss_scale": 128}}, False),
    (3, {"fp16": {"enabled": True, "loss_scale": 64}}, False),
    (1, {"bf16": {"enabled": True}}, False),
    (2, {"bf16": {"enabled": True}}, False),
    (3, {"bf16": {"enabled": True}}, False),
    (2, {}, False),
    (3, {}, False),
    # fp32 weights: the GradScaler-style scale is not the ZeRO optimizer's
    (2, {"torch_autocast": {"enabled": True, "dtype": "fp16"}}, False),
])
def test_zero_optimizer_dynamic_loss_scale(solo: None, stage: int, precision: dict,
                                           dynamic: bool) -> None:
    engine = build({"train_batch_size": 2, "optimizer": ADAMW,
                    "zero_optimization": {"stage": stage}, **precision})
    assert engine.optimizer.dynamic_loss_scale is dynamic
    engine.optimizer.dynamic_loss_scale = dynamic  # apex-era scripts set it: same value is fine
    with pytest.raises(DsrunError, match="dynamic_loss_scale.*set by the config"):
        engine.optimizer.dynamic_loss_scale = not dynamic
    assert engine.optimizer.dynamic_loss_scale is dynamic


def test_inside_no_sync_ctxt(solo: None) -> None:
    engine = build({"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert engine.inside_no_sync_ctxt is False
    with engine.no_sync():
        assert engine.inside_no_sync_ctxt is True
    assert engine.inside_no_sync_ctxt is False
    with pytest.raises(DsrunError, match="inside_no_sync_ctxt.*engine.no_sync"):
        engine.inside_no_sync_ctxt = True
    assert engine.inside_no_sync_ctxt is False


def test_train_and_eval_reset_warn_unscaled_loss(solo: None) -> None:
    engine = build({"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.warn_unscaled_loss = False
    assert engine.eval() is engine and engine.warn_unscaled_loss is True
    assert engine.module.training is False
    engine.warn_unscaled_loss = False
    assert engine.train() is engine and engine.warn_unscaled_loss is True
    assert engine.module.training is True
