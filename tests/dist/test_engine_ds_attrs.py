"""DeepSpeed engine attributes scripts use, on a one-rank engine in this
process: the accessors (engine_info), the switches that must not be
silently ignored (engine_controls), the throughput timer the engine
drives, ``deepspeed_io`` and ``load_module_state_dict``. The two-rank
behaviour of ``enable_backward_allreduce`` is in test_engine_dist.py."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

import dsrun
from dsrun.errors import DsrunConfigError, DsrunError

pytestmark = pytest.mark.dist

SGD = {"type": "SGD", "params": {"lr": 0.1}}


def build(config: dict, **kwargs: object) -> dsrun.DsrunEngine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine, _, _, _ = dsrun.initialize(model=model, config=config, **kwargs)
    return engine


def test_accessors_answer_as_deepspeed(solo: None) -> None:
    opt_holder: list[torch.optim.Optimizer] = []
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_holder.append(opt)
    engine, _, _, _ = dsrun.initialize(model=model, optimizer=opt, config={
        "train_batch_size": 2, "prescale_gradients": True, "gradient_predivide_factor": 2.0,
        "dump_state": True})
    assert engine.client_optimizer is opt and engine.client_lr_scheduler is None
    assert engine.mp_world_size == 1 and engine.get_model_parallel_rank() == 0
    assert engine.data_parallel_group is dist.group.WORLD
    assert engine.losses is None and engine.gradient_average
    assert not engine.postscale_gradients() and engine.gradient_predivide_factor() == 2.0
    assert engine.dump_state() and engine.get_type() == [0.0]
    assert engine.dynamic_loss_scale()  # DeepSpeed's: fp16.loss_scale == 0, fp16 on or not
    assert not engine.zero_optimization_partition_gradients()
    assert not engine.zero_optimization_partition_weights()
    assert engine.enable_backward_allreduce
    data = torch.utils.data.TensorDataset(torch.arange(6.0))
    assert engine.is_map_style_dataset(data) and not engine.is_iterable_style_dataset(data)
    static = build({"train_batch_size": 2, "optimizer": SGD,
                    "fp16": {"enabled": True, "loss_scale": 128}})
    assert not static.dynamic_loss_scale()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_refuse_disabling_backward_allreduce(solo: None, stage: int) -> None:
    engine = build({"train_batch_size": 2, "optimizer": SGD,
                    "zero_optimization": {"stage": stage}})
    assert engine.zero_optimization_partition_gradients() == (stage >= 2)
    assert engine.zero_optimization_partition_weights() == (stage == 3)
    with pytest.raises(DsrunError, match=f"at ZeRO stage {stage}"):
        engine.enable_backward_allreduce = False
    assert engine.enable_backward_allreduce
    engine.enable_backward_allreduce = True  # what it is: fine


def test_gradient_average_false_is_refused(solo: None) -> None:
    engine = build({"train_batch_size": 2, "optimizer": SGD})
    with pytest.raises(DsrunError, match="gradient_average = False"):
        engine.gradient_average = False
    engine.gradient_average = True


def test_stage0_backward_allreduce_off_one_rank(solo: None) -> None:
    """One rank: turning it off changes nothing, allreduce_gradients() too."""
    engine = build({"train_batch_size": 2, "optimizer": SGD})
    engine.enable_backward_allreduce = False
    assert not engine.enable_backward_allreduce
    engine.backward(engine(torch.ones(2, 4)).sum())
    before = [p.grad.clone() for p in engine.module.parameters()]
    engine.allreduce_gradients()
    assert all(torch.equal(a, p.grad) for a, p in zip(before, engine.module.parameters()))
    engine.step()


def test_tput_timer_is_driven_by_forward_and_step(solo: None) -> None:
    engine = build({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                    "optimizer": SGD})
    assert engine.mpu is None  # no mpu= given (DeepSpeed's attribute)
    tput = engine.tput_timer
    assert tput.batch_size == 4 and tput.avg_samples_per_sec() == -math.inf
    for _ in range(4 * 2):
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
    assert tput.global_step_count == 4 and tput.micro_step_count == 8
    assert tput.total_elapsed_time > 0 and not tput.started
    assert 0 < tput.avg_samples_per_sec() < math.inf
    timers = engine.timers
    timers("mine").start()
    timers("mine").stop()
    assert timers("mine").elapsed() >= 0.0
    off = build({"train_batch_size": 2, "optimizer": SGD,
                 "timers": {"throughput": {"enabled": False}}})
    off.backward(off(torch.ones(2, 4)).sum())
    off.step()
    assert off.tput_timer.global_step_count == 0
    with pytest.raises(DsrunConfigError, match="timers.throughput"):
        build({"train_batch_size": 2, "timers": {"throughput": {"on": True}}})


class SlowData(torch.utils.data.Dataset):
    """Each sample takes ``delay`` seconds to load."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.ones(4)


def test_tput_timer_counts_the_engine_dataloaders_loading_time(solo: None) -> None:
    delay = 0.05  # the own loader's bound (0.2 s of wall time) must outlast a preemption
    engine = build({"train_micro_batch_size_per_gpu": 2, "optimizer": SGD},
                   training_data=SlowData(12, delay))
    loader = engine.training_dataloader
    for batch in loader:
        engine.backward(engine(batch).sum())
        engine.step()
    tput = engine.tput_timer
    assert tput.global_step_count == 6 and not tput.started
    # 4 timed steps (the first 2 are left out), each waiting 2 samples' load
    assert tput.total_elapsed_time >= 4 * 2 * delay * 0.9
    eval_loader = engine.deepspeed_io(SlowData(4, 0.0), route="eval")
    next(iter(eval_loader))
    assert not tput.started  # only the training route drives it
    own = build({"train_micro_batch_size_per_gpu": 2, "optimizer": SGD})
    slow = torch.utils.data.DataLoader(SlowData(12, delay), batch_size=2)
    for batch in slow:  # the script's own loader: forward starts it
        own.backward(own(batch).sum())
        own.step()
    assert own.tput_timer.global_step_count == 6
    assert own.tput_timer.total_elapsed_time < 4 * 2 * delay * 0.5


def test_deepspeed_io_routes(solo: None) -> None:
    engine = build({"train_micro_batch_size_per_gpu": 3, "optimizer": SGD})
    data = torch.utils.data.TensorDataset(torch.arange(7.0))
    train = engine.deepspeed_io(data)
    batches = [b[0].tolist() for b in train]
    assert len(train) == 3 and [len(b) for b in batches] == [3, 3, 1]
    assert sorted(sum(batches, [])) == list(range(7)) and batches[0] != [0.0, 1.0, 2.0]
    evaluated = engine.deepspeed_io(data, batch_size=4, route="eval")
    assert [b[0].tolist() for b in evaluated] == [[0, 1, 2, 3], [4, 5, 6]]
    sampler = torch.utils.data.SequentialSampler(data)
    given = engine.deepspeed_io(data, batch_size=7, data_sampler=sampler)
    assert [b[0].tolist() for b in given] == [list(range(7))]
    # DeepSpeed's data_sampler on every loader (loader.data_sampler.set_epoch)
    assert given.data_sampler is sampler and train.data_sampler is not None
    assert isinstance(evaluated.data_sampler, torch.utils.data.DistributedSampler)
    with pytest.raises(ValueError, match="must be a torch Dataset"):
        engine.deepspeed_io([1, 2, 3].__iter__())


def test_deepspeed_io_falls_back_to_initializes_collate_fn(solo: None) -> None:
    def as_dict(items: list[tuple[torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {"x": torch.stack([item[0] for item in items])}

    data = torch.utils.data.TensorDataset(torch.arange(4.0))
    engine, *_ = dsrun.initialize(model=torch.nn.Linear(1, 1), training_data=data,
                                  collate_fn=as_dict, config={
                                      "train_micro_batch_size_per_gpu": 2, "optimizer": SGD})
    for route in ("train", "eval"):
        batch = next(iter(engine.deepspeed_io(data, route=route)))
        assert set(batch) == {"x"}, route
    mine = next(iter(engine.deepspeed_io(data, route="eval", collate_fn=lambda b: len(b))))
    assert mine == 2


def test_deepspeed_names_for_loader_and_routes() -> None:
    from dsrun.runtime import constants, dataloader

    assert dataloader.DeepSpeedDataLoader is dataloader.DsrunDataLoader
    assert (constants.ROUTE_TRAIN, constants.ROUTE_EVAL) == ("train", "eval")


FP16 = {"enabled": True, "loss_scale": 1.0}  # static: no overflow-skipped first step


@pytest.mark.parametrize("config", [
    {"fp16": FP16},  # stage 0 with fp32 masters
    {"fp16": FP16, "zero_optimization": {"stage": 2}},
    {"fp16": FP16, "zero_optimization": {"stage": 3}},
], ids=["fp16", "fp16-zero2", "fp16-zero3"])
def test_load_module_state_dict_trains_from_the_loaded_weights(solo: None,
                                                                config: dict) -> None:
    """The masters take the loaded values: with lr 0 a step keeps them."""
    engine = build({"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
                    **config})
    dtype = torch.float16 if "fp16" in config else torch.float32
    wanted = {k: torch.full_like(v, 0.5, dtype=dtype) if v.numel() else v
              for k, v in _full_state(engine).items()}
    engine.load_module_state_dict({"module": wanted})
    engine.backward(engine(torch.ones(2, 4, dtype=dtype)).float().sum())
    engine.step()
    assert engine.was_step_applied()
    got = _full_state(engine)
    assert all(torch.equal(got[k].float(), torch.full(got[k].shape, 0.5)) for k in wanted)
    with pytest.raises(RuntimeError, match="Missing key"):
        engine.load_module_state_dict({"module": {}})


def _full_state(engine: dsrun.DsrunEngine) -> dict[str, torch.Tensor]:
    params = list(engine.module.parameters())
    with dsrun.zero.GatheredParameters(params):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def test_feature_switches_of_sections_dsrun_does_not_act_on(solo: None) -> None:
    """DeepSpeed's ``*_enabled()`` for autotuning, elasticity and the like
    answer False even when the (passthrough) section is on (sections
    DeepSpeed 0.19.8 has removed, elasticity and the legacy top-level
    ``curriculum_learning`` among them, are refused, as DeepSpeed refuses
    them; ``data_efficiency_enabled()`` reports its section), and tag
    validation always fails on different tags."""
    model = torch.nn.Linear(4, 2)
    engine, _, _, _ = dsrun.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "hybrid_engine": {"enabled": True}, "autotuning": {"enabled": True},
        "checkpoint": {"tag_validation": "Ignore"}})
    assert not any(getattr(engine, f"{name}_enabled")() for name in (
        "curriculum_learning", "data_efficiency", "random_ltd", "autotuning", "elasticity",
        "pld", "eigenvalue"))
    assert engine.checkpoint_tag_validation_enabled() and engine.checkpoint_tag_validation_fail()


def test_a_module_added_after_initialize_at_stage3_is_refused_by_name(solo: None) -> None:
    """It failed at step() with "'Parameter' object has no attribute 'ds_status'"."""
    engine = build({"train_batch_size": 2, "optimizer": SGD, "zero_optimization": {"stage": 3}})
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    with dsrun.zero.Init(config_dict_or_path={"train_batch_size": 2,
                                              "zero_optimization": {"stage": 3}}):
        engine.module.extra = torch.nn.Linear(2, 2)  # partitioned, but unknown to the engine
    with pytest.raises(DsrunError, match="parameter 'extra.weight' was added to the model "
                                         r"after dsrun.initialize\(\)"):
        engine.step()
