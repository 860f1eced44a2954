"""dsrun.initialize(): config selection, argument handling, errors it surfaces.

Config selection and argument parsing need no process group. Tests that go
through resolve() and the engine use a world-size-1 gloo group over an
in-memory store (no ports, no subprocess), created once for this module.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dsrun
from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.runtime.env import DistEnv
from dsrun.runtime.initialize import add_config_arguments, select_config

CFG = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "DSRUN_CONFIG", "DSRUN_JOB_ID", "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture(scope="module")
def solo() -> Iterator[None]:
    """A world-size-1 process group for this module (HashStore: no ports)."""
    created = not dist.is_initialized()
    if created:
        dsrun.init_distributed(env=DistEnv(accelerator="cpu"))
    yield
    if created:
        dist.destroy_process_group()


def write(tmp_path: Path, data: Any, name: str = "ds.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


# ------------------------------------------------------------ arguments


def test_add_config_arguments_matches_deepspeed_flags(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    assert add_config_arguments(parser) is parser
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "a.json", "--local_rank", "0"])
    assert args.deepspeed is True and args.deepspeed_config == "a.json"
    assert args.dsrun_config is None and args.deepscale_config is None
    assert parser.parse_args([]).deepspeed is False
    assert "--deepscale" not in parser.format_help()  # deprecated spellings are hidden


def test_config_from_args_and_from_dsrun_flag(tmp_path: Path) -> None:
    path = write(tmp_path, CFG)
    args = argparse.Namespace(deepspeed_config=path, dsrun_config=None)
    choice = select_config(args=args)
    assert choice.value == path and "--deepspeed_config" in choice.origin
    choice = select_config(args=argparse.Namespace(dsrun_config=path))
    assert choice.value == path and "--dsrun_config" in choice.origin
    assert select_config(config_params=CFG).value == CFG  # the older alias


def test_launcher_config_used_when_the_script_passes_none(tmp_path: Path) -> None:
    path = write(tmp_path, CFG)
    choice = select_config(args=argparse.Namespace(deepspeed_config=None), launcher_config=path)
    assert choice.value == path and "DSRUN_CONFIG" in choice.origin
    assert DistEnv.detect({"DSRUN_CONFIG": path}).config_path == path
    assert DistEnv.detect({}).config_path is None


def test_cpu_ranks_use_gloo_even_where_cuda_is_available(monkeypatch, solo) -> None:
    from dsrun.runtime import dist as rdist
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cpu = DistEnv.detect({"DSRUN_ACCELERATOR": "cpu"})
    assert cpu.accelerator == "cpu" and rdist.default_backend(cpu) == "gloo"
    assert rdist.default_backend(DistEnv.detect({})) == "nccl"
    deepspeeds = DistEnv.detect({"DS_ACCELERATOR": "CPU"})  # DeepSpeed's spelling
    assert deepspeeds.accelerator == "cpu" and rdist.default_backend(deepspeeds) == "gloo"
    assert rdist.default_backend(DistEnv.detect({"DS_ACCELERATOR": "cuda"})) == "nccl"
    assert rdist.compute_device().type == "cpu"  # this module's group is gloo


def test_launcher_and_script_config_conflict_names_both(tmp_path: Path) -> None:
    launcher = write(tmp_path, {**CFG, "train_batch_size": 8}, "launcher.json")
    mine = write(tmp_path, CFG, "mine.json")
    with pytest.raises(DsrunConfigError) as err:
        select_config(args=argparse.Namespace(deepspeed_config=mine), launcher_config=launcher)
    text = str(err.value)
    assert f"--deepspeed_config {mine}" in text and f"DSRUN_CONFIG={launcher}" in text
    with pytest.raises(DsrunConfigError, match="config= passed to dsrun.initialize"):
        select_config(config=CFG, launcher_config=launcher)


def test_identical_configs_are_fine(tmp_path: Path) -> None:
    # same JSON written differently (key order, spacing, 0.1 vs 1e-1); a dict with a tuple
    launcher = write(tmp_path, '{"optimizer": {"params": {"lr": 1e-1}, "type": "SGD"},'
                               ' "train_batch_size": 4}', "launcher.json")
    mine = write(tmp_path, CFG, "mine.json")
    assert select_config(config=mine, launcher_config=launcher).value == mine
    assert select_config(config=CFG, launcher_config=launcher).value == CFG
    with_tuple = {**CFG, "optimizer": {"type": "Adam", "params": {"betas": (0.9, 0.99)}}}
    as_list = {**CFG, "optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.99]}}}
    assert select_config(config=with_tuple, config_params=as_list).value == with_tuple


def test_config_and_args_config_that_differ(tmp_path: Path) -> None:
    path = write(tmp_path, {**CFG, "train_batch_size": 2})
    with pytest.raises(DsrunConfigError, match="two different training configs"):
        select_config(config=CFG, args=argparse.Namespace(deepspeed_config=path))


def test_no_config_anywhere() -> None:
    with pytest.raises(DsrunConfigError, match="--deepspeed_config PATH"):
        select_config(args=argparse.Namespace(deepspeed_config=None))


def test_missing_model_needs_no_process_group() -> None:
    with pytest.raises(DsrunConfigError, match="needs model="):
        dsrun.initialize(config=CFG)
    with pytest.raises(DsrunConfigError, match="torch.nn.Module"):
        dsrun.initialize(model="not a model", config=CFG)


def test_bad_json_reports_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, '{\n  "train_batch_size": 4,\n  oops\n}')
    with pytest.raises(DsrunConfigError, match=r"line 3, column 3"):
        select_config(config=path, launcher_config=path.replace("ds.json", "other.json"))


# ------------------------------------------------- through the engine (world size 1)


@pytest.mark.parametrize("config,match", [
    ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 3,
      "gradient_accumulation_steps": 1}, "train_batch_size must equal"),
    ({"train_batch_size": 4, "optimizer": {"type": "Adamm"}}, 'did you mean "Adam"'),
    ({"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"betas1": 0.9}}},
     'unknown parameter "betas1"'),
    ({"train_batch_size": 4, "optimizer": {"type": "Adam"}, "scheduler": {"type": "WarmupLRR"}},
     'did you mean "WarmupLR"'),
    ({"train_batch_size": 4, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "enable at most one"),
    ({"train_batch_size": 4, "zero_optimization": {"stage": 2}},
     "ZeRO stage 2 needs an optimizer"),
    ({"train_batch_size": 4, "zero_optimization": {"stage": 4}},
     "zero_optimization.stage"),
    ({"train_batch_size": 4, "optimizer": {"type": "Adam"},
      "zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
     r"zero_quantized_weights \(ZeRO\+\+\) is not implemented"),
])
def test_initialize_surfaces_config_errors(solo: None, config: dict, match: str) -> None:
    with pytest.raises(DsrunConfigError, match=match):
        dsrun.initialize(model=net(), config=config)


def test_initialize_bad_json_file(solo: None, tmp_path: Path) -> None:
    path = write(tmp_path, '{"train_batch_size": 4,}')
    with pytest.raises(DsrunConfigError, match=rf"{path}: line 1, column 24"):
        dsrun.initialize(model=net(), config=path)


def test_initialize_uses_the_launcher_config(solo: None, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, CFG)
    monkeypatch.setenv("DSRUN_CONFIG", path)
    engine, optimizer, loader, scheduler = dsrun.initialize(model=net())
    assert engine.config.source == path and isinstance(optimizer, torch.optim.SGD)
    assert loader is None and scheduler is None
    assert engine.config.dp_size_source == "single process"
    with pytest.raises(DsrunConfigError, match="DSRUN_CONFIG="):
        dsrun.initialize(model=net(), config={**CFG, "train_batch_size": 8})


def test_args_config_dataloader_and_collate_fn(solo: None, tmp_path: Path) -> None:
    path = write(tmp_path, {**CFG, "train_micro_batch_size_per_gpu": 2})
    data = torch.utils.data.TensorDataset(torch.randn(10, 4), torch.arange(10))
    seen: list[int] = []

    def collate(items: list) -> Any:
        seen.append(len(items))
        return torch.utils.data.default_collate(items)

    parser = add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", path])
    engine, _, loader, _ = dsrun.initialize(args=args, model=net(), training_data=data,
                                            collate_fn=collate)
    assert engine.gradient_accumulation_steps() == 2  # 4 = 2 x 2 x 1
    assert [len(y) for _, y in loader] == [2] * 5 and seen == [2] * 5
    epoch0 = [y.tolist() for _, y in loader]
    assert sorted(sum(epoch0, [])) == list(range(10))


def test_engine_accumulation_no_sync_and_counters(solo: None) -> None:
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 1e-3}
    engine, *_ = dsrun.initialize(model=net(), config=config)
    before = [p.detach().clone() for p in engine.module.parameters()]
    x = torch.randn(2, 4)
    for micro in range(4):
        assert engine.is_gradient_accumulation_boundary() == (micro == 3)
        loss = engine(x).sum()
        returned = engine.backward(loss)  # as DeepSpeed: divided by the accumulation steps
        assert torch.equal(returned, loss / 4)
        engine.step()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
        assert unchanged == (micro < 3)
    assert (engine.global_steps, engine.global_samples, engine.micro_steps) == (1, 8, 4)
    assert engine.get_global_grad_norm() is not None and engine.get_lr() == [0.1]
    assert all(p.grad is None for p in engine.module.parameters())  # cleared after the step
    with engine.no_sync(), pytest.raises(DsrunError, match="no_sync"):
        engine.step()
    assert isinstance(engine, dsrun.DeepSpeedEngine) and engine.device.type == "cpu"


def test_fp16_overflow_at_world_size_one(solo: None, caplog: pytest.LogCaptureFixture) -> None:
    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 1,
                       "auto_cast": True}}
    engine, *_ = dsrun.initialize(model=net(), config=config)
    assert next(engine.module.parameters()).dtype == torch.float16
    first = engine.module[0].weight
    hook = first.register_hook(lambda g: g * float("inf"))
    x = torch.randn(2, 4)
    with caplog.at_level("INFO", logger="dsrun.runtime"):
        for _ in range(2):
            before = first.detach().clone()
            engine.backward(engine(x).float().sum())
            engine.step()
            assert torch.equal(before, first) and not engine.was_step_applied()
    hook.remove()
    assert engine.skipped_steps == 2 and engine.precision.loss_scale == 256.0
    assert engine.global_steps == 2
    assert engine.loss_scale() == 0.0  # DeepSpeed's: the config's static scale, 0 = dynamic
    lines = [r.getMessage() for r in caplog.records if "overflow" in r.getMessage()]
    assert len(lines) == 1 and "0.weight" in lines[0]  # rate-limited, names the parameter
    engine.backward(engine(x).float().sum())
    engine.step()
    assert engine.was_step_applied() and engine.skipped_steps == 2


def test_import_dsrun_stays_torch_free() -> None:
    code = ("import sys, dsrun, dsrun.runtime.config; names = set(dir(dsrun)); "
            "assert {'initialize', 'add_config_arguments', 'DsrunEngine', 'DeepSpeedEngine', "
            "'DsrunConfigError', 'init_distributed'} <= names, names; "
            "assert dsrun.DsrunConfigError.__name__ == 'DsrunConfigError'; "
            "print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert res.stdout.strip() == "False", res.stderr


def test_auto_micro_batch_from_a_dataloader(solo: None) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(12, 4), torch.arange(12))
    loader = torch.utils.data.DataLoader(data, batch_size=3)
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    engine, _, returned, _ = dsrun.initialize(model=net(), config=config, training_data=loader)
    assert returned is loader  # a DataLoader is used as given
    assert (engine.train_micro_batch_size_per_gpu(), engine.train_batch_size()) == (3, 3)
    assert engine.get_lr() == [1e-3]  # "auto" lr without a client optimizer: DeepSpeed's default


@pytest.mark.parametrize("section", ["offload_optimizer", "offload_param"])
def test_cpu_offload_on_cpu_ranks_is_a_reported_no_op(solo: None, section: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    config = {"train_batch_size": 4, "optimizer": {"type": "Adam"},
              "zero_optimization": {"stage": 3, section: {"device": "cpu",
                                                          "pin_memory": True}}}
    with caplog.at_level(logging.INFO, logger="dsrun.runtime"):
        engine, _, _, _ = dsrun.initialize(model=net(), config=config)
    assert engine.zero_optimization_stage() == 3
    assert any(f"{section}.device=cpu" in r.getMessage() and "no-op" in r.getMessage()
               for r in caplog.records)
    # the optimizer took the offload path all the same (host memory is the CPU's)
    assert getattr(engine.optimizer.settings, section) is True
    assert not engine.optimizer.placement.offloads
    x = torch.randn(4, 4)
    engine.backward(engine(x).square().mean())
    engine.step()
    config["zero_optimization"][section] = {"device": "nvme", "nvme_path": "/tmp"}
    with pytest.raises(DsrunConfigError, match=f"{section}.device='nvme' .*NVMe offload "
                                               "\\(ZeRO-Infinity\\) is not implemented"):
        dsrun.initialize(model=net(), config=config)


@pytest.mark.parametrize(("stage", "section"), [(0, "offload_optimizer"),
                                                (2, "offload_param")])
def test_offload_a_stage_ignores_is_warned_about(solo: None, stage: int, section: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    config = {"train_batch_size": 4, "optimizer": {"type": "Adam"},
              "zero_optimization": {"stage": stage, section: {"device": "cpu"}}}
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime"):
        dsrun.initialize(model=net(), config=config)
    assert any(f"zero_optimization.{section}" in r.getMessage() and
               f"at stage {stage} it is ignored" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("given", "used", "optimizer"), [
    (None, None, "Adam"), (1_000_000_000, None, "Adam"), (5, 5, "Adam"),
    (None, 1 << 20, "SGD")])
def test_sub_group_size_reaches_the_zero_optimizer(solo: None, given: Any, used: Any,
                                                   optimizer: str) -> None:
    """DeepSpeed's default (1e9: the partition in one piece) counts as
    unset: dsrun steps whole masters with a fused optimizer (Adam) and
    pieces of 2^20 elements otherwise on the CPU (foreach SGD); a value the
    config sets is used."""
    section: dict[str, Any] = {"stage": 2}
    if given is not None:
        section["sub_group_size"] = given
    params = {"lr": 0.1} if optimizer == "SGD" else {}
    config = {"train_batch_size": 4, "optimizer": {"type": optimizer, "params": params},
              "zero_optimization": section}
    engine, _, _, _ = dsrun.initialize(model=net(), config=config)
    assert engine.optimizer.settings.sub_group_size == (5 if given == 5 else None)
    assert engine.optimizer.inner_impl == ("fused" if optimizer == "Adam" else "foreach")
    pieces = [p.numel() for g in engine.optimizer.optimizer.param_groups for p in g["params"]]
    if used is None:
        assert pieces == [m.numel() for m in engine.optimizer.masters]
        return
    assert max(pieces) <= used and sum(pieces) == sum(m.numel() for m in engine.optimizer.masters)
