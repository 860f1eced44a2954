"""``dsrun.utils`` at world size 1, in this process (the ``solo`` group).

* safe_get/set at ZeRO stages 0-3 with the 2-rank job's case
  (``workers/utils_cases.py``: a plain model and AdamW on the same batches;
  stage 1 with gradient accumulation), fp16 (separate fp32 masters), and
  what answers None or raises.
* zero_to_fp32 on a world-size-1 checkpoint: load into a model, another
  output dtype, and bad input (no ``latest``, a missing tag, corrupt and
  truncated files) named as dsrun's consolidation names it.
* log_dist without a process group and with one.
* safe_get on a one-stage pipeline engine (ZeRO 0 and 1) against a plain model.
* a parameter frozen after initialize() still answers at every stage; fp16
  at stage 0 on a pipeline keeps a frozen weight written after initialize().
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import dsrun
import dsrun.utils as utils
from dsrun.errors import CheckpointError, DsrunError
from dsrun.runtime.checkpoint.consolidate import to_fp32
from tests.dist.workers import utils_cases
from tests.dist.workers.utils_cases import Net, Records

pytestmark = pytest.mark.dist
TOLERANCE = 1e-5  # relative, as in test_utils_ranks.py


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_full_values_gradients_and_state_match_a_plain_model(solo: None, stage: int) -> None:
    fact = utils_cases.access(stage)
    assert not fact["problems"], fact["problems"]
    assert {"grad", "stepped_value", "stepped_exp_avg", "stepped_exp_avg_sq", "set_grad",
            "after_set_value", "after_set_exp_avg"} <= set(fact["max"])
    assert all(v <= TOLERANCE for v in fact["max"].values()), fact["max"]
    assert fact["max"]["stepped_vs_gathered"] == 0.0
    assert fact["state_before_step_is_none"]
    # after the step: stage 0 released the gradients, the flat buffers of
    # stages 1-3 at world size 1 stay bound (zeroed)
    assert fact["grad_after_step_is_none"] == (stage == 0)
    assert fact["set_value_exact"] and fact["set_model_exact"]
    if stage == 3:
        assert all(v for k, v in fact.items() if k.startswith("local_")), fact


def engine_for(stage: int, **extra: Any) -> Any:
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
              "zero_optimization": {"stage": stage}, **extra}
    engine, *_ = dsrun.initialize(model=Net(), config=config)
    return engine


def train(engine: Any, steps: int = 1) -> None:
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(2, 6, generator=gen)
        engine.backward(engine(x.half() if engine.fp16_enabled() else x))
        engine.step()


@pytest.mark.parametrize("stage", (0, 2))
def test_fp16_reads_and_writes_the_fp32_master(solo: None, stage: int) -> None:
    engine = engine_for(stage, fp16={"enabled": True, "loss_scale": 128})
    w = engine.module.mid.weight
    assert w.dtype == torch.float16
    master = utils.safe_get_full_fp32_param(w)
    assert master.dtype == torch.float32 and torch.equal(master, w.detach().float())
    engine.backward(engine(torch.randn(2, 6).half()))
    grad = utils.safe_get_full_grad(w)
    assert grad is not None and torch.equal(grad.float(), w.grad.float())  # loss-scaled
    engine.step()
    new = torch.linspace(-1, 1, 100).reshape(10, 10) / 3  # not representable in fp16
    utils.safe_set_full_fp32_param(w, new)
    assert torch.equal(utils.safe_get_full_fp32_param(w), new)  # the fp32 master keeps it all
    assert torch.equal(w.detach(), new.half())                   # the model gets its fp16 cast
    train(engine)
    assert torch.equal(w.detach(), utils.safe_get_full_fp32_param(w).half())
    engine.destroy()


@pytest.mark.parametrize("stage", (0, 2, 3))
def test_none_and_errors(solo: None, stage: int) -> None:
    engine = engine_for(stage)
    frozen, mid = engine.module.frozen, engine.module.mid.weight
    stranger = torch.nn.Parameter(torch.ones(3))
    for param in (frozen, stranger):
        assert utils.safe_get_full_fp32_param(param) is None
        assert utils.safe_get_full_grad(param) is None
        assert utils.safe_get_full_optimizer_state(param, "exp_avg") is None
        utils.safe_set_full_fp32_param(param, torch.zeros(param.shape))  # no effect, as DeepSpeed
    assert torch.equal(stranger.detach(), torch.ones(3))
    assert utils.safe_get_full_optimizer_state(mid, "exp_avg") is None  # not stepped yet
    with pytest.raises(DsrunError, match="not stepped"):
        utils.safe_set_full_optimizer_state(mid, torch.zeros(10, 10), "exp_avg")
    with pytest.raises(DsrunError, match="100 elements"):
        utils.safe_set_full_fp32_param(mid, torch.zeros(3))
    train(engine)
    with pytest.raises(DsrunError, match="no state 'momentum_buffer'.*exp_avg, exp_avg_sq"):
        utils.safe_get_full_optimizer_state(mid, "momentum_buffer")
    with pytest.raises(DsrunError, match="not one value per element"):
        utils.safe_get_full_optimizer_state(mid, "step")
    if stage == 3:
        assert utils.safe_get_local_fp32_param(frozen) is None
        assert utils.safe_get_local_fp32_param(mid).shape == (100,)
    else:
        with pytest.raises(DsrunError, match="ZeRO stage 3 parameters only"):
            utils.safe_get_local_fp32_param(mid)
    with pytest.raises(DsrunError, match="ZeRO stage 3 parameters only.*no dsrun engine"):
        utils.safe_get_local_grad(stranger)
    engine.destroy()


@pytest.mark.parametrize("stage,fp16", [(0, False), (0, True), (1, False), (2, False),
                                        (3, False)])
def test_parameter_frozen_after_initialize_still_answers(solo: None, stage: int,
                                                         fp16: bool) -> None:
    """One rule at every stage: only a parameter frozen at initialize() and
    still frozen answers None; one frozen later keeps its trained master
    and optimizer state (under fp16 at stage 0 its value is then what the
    fp16 parameter holds)."""
    extra = {"fp16": {"enabled": True, "loss_scale": 128}} if fp16 else {}
    engine = engine_for(stage, **extra)
    mid = engine.module.mid.weight
    train(engine)
    value = utils.safe_get_full_fp32_param(mid)
    mid.requires_grad_(False)
    got = utils.safe_get_full_fp32_param(mid)
    assert got is not None and torch.equal(got, value)
    assert utils.safe_get_full_optimizer_state(mid, "exp_avg") is not None
    new = torch.full((10, 10), 0.25)
    if fp16:  # written while frozen: the parameter is the value
        with torch.no_grad():
            mid.fill_(0.25)
    else:
        utils.safe_set_full_fp32_param(mid, new)
    assert torch.equal(utils.safe_get_full_fp32_param(mid), new)
    assert utils.safe_get_full_fp32_param(engine.module.frozen) is None
    engine.destroy()


# ------------------------------------------------------------ zero_to_fp32


@pytest.fixture
def checkpoint(solo: None, tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    engine = engine_for(1)
    train(engine, 2)
    engine.save_checkpoint(str(tmp_path))
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return tmp_path, state


def test_load_state_dict_from_zero_checkpoint(checkpoint: tuple[Path, Any]) -> None:
    from dsrun.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint

    root, want = checkpoint
    model = Net()
    assert load_state_dict_from_zero_checkpoint(model, str(root)) is model
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key


def test_another_output_dtype(checkpoint: tuple[Path, Any], tmp_path: Path) -> None:
    from dsrun.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    root, want = checkpoint
    convert_zero_checkpoint_to_state_dict(str(root), str(tmp_path / "o"), dtype="bf16")
    state = torch.load(tmp_path / "o" / "pytorch_model.bin")
    assert list(state) == list(want)
    for key, value in want.items():
        assert state[key].dtype == torch.bfloat16 and torch.equal(state[key],
                                                                  value.bfloat16()), key
    with pytest.raises(ValueError, match="unsupported output dtype"):
        convert_zero_checkpoint_to_state_dict(str(root), str(tmp_path / "o"), dtype="int8")


def message(fn: Any) -> str:
    with pytest.raises(CheckpointError) as info:
        fn()
    return str(info.value)


def test_bad_input_is_named_as_consolidation_names_it(checkpoint: tuple[Path, Any],
                                                      tmp_path: Path) -> None:
    from dsrun.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
    )

    root, _ = checkpoint
    out = str(tmp_path / "out")
    missing_tag = message(lambda: get_fp32_state_dict_from_zero_checkpoint(str(root), tag="nope"))
    assert "nope" in missing_tag and "global_step2" in missing_tag  # names the tags there are
    rank_file = root / "global_step2" / "rank_00000.bin"
    data = bytearray(rank_file.read_bytes())
    data[10] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    corrupt = message(lambda: get_fp32_state_dict_from_zero_checkpoint(str(root)))
    assert "is corrupt" in corrupt and str(rank_file) in corrupt
    assert corrupt == message(lambda: to_fp32(str(root), str(tmp_path / "x.pt")))
    lazy = get_fp32_state_dict_from_zero_checkpoint(str(root), lazy_mode=True)
    assert "is corrupt" in message(lambda: [v.contiguous() for v in lazy.values()])
    assert "is corrupt" in message(lambda: convert_zero_checkpoint_to_fp32_state_dict(
        str(root), out, max_shard_size="1KB"))
    assert not any(name.endswith(".tmp") for name in os.listdir(out))  # aborted, cleaned
    rank_file.write_bytes(bytes(data[:-8]))
    assert "truncated" in message(
        lambda: get_fp32_state_dict_from_zero_checkpoint(str(root), lazy_mode=True))
    (root / "latest").unlink()
    assert "no 'latest' file" in message(lambda: get_fp32_state_dict_from_zero_checkpoint(
        str(root)))
    assert "does not exist" in message(lambda: get_fp32_state_dict_from_zero_checkpoint(
        str(tmp_path / "missing")))


# ----------------------------------------------------------------- log_dist


@pytest.fixture
def records() -> Any:
    handler = Records()
    utils.logger.addHandler(handler)
    yield handler.messages
    utils.logger.removeHandler(handler)


def test_log_dist_without_a_process_group_logs_in_the_one_process(records: list[str]) -> None:
    assert not torch.distributed.is_initialized()
    utils.log_dist("a")
    utils.log_dist("b", ranks=[3])
    utils.log_dist("c", ranks=[0], level=logging.DEBUG)  # below the logger's level
    assert records == ["[Rank 0] a", "[Rank 0] b"]


def test_log_dist_with_a_process_group_filters_by_rank(solo: None, records: list[str]) -> None:
    utils.log_dist("none")
    utils.log_dist("zero", ranks=[0])
    utils.log_dist("one", ranks=[1])
    utils.log_dist("all", ranks=[-1], level=logging.WARNING)
    assert records == ["[Rank 0] zero", "[Rank 0] all"]
    assert utils.logger is logging.getLogger("dsrun.runtime")


@pytest.mark.parametrize("stage", (0, 1))
def test_safe_get_on_a_pipeline_engine(solo: None, stage: int) -> None:
    """safe_get_* on a (one-stage) pipeline's layers after train_batch:
    the values and Adam state a plain model reaches on the same data."""
    from dsrun.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    module = PipelineModule([LayerSpec(torch.nn.Linear, 6, 8), LayerSpec(torch.nn.Tanh),
                             LayerSpec(torch.nn.Linear, 8, 2)], num_stages=1,
                            loss_fn=torch.nn.MSELoss())
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    engine, *_ = dsrun.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage}})
    opt = torch.optim.AdamW(plain.parameters(), lr=0.01, weight_decay=0.0)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        batches = [(torch.randn(3, 6, generator=gen), torch.randn(3, 2, generator=gen))
                   for _ in range(2)]
        engine.train_batch(iter(batches))
        for x, y in batches:
            (torch.nn.functional.mse_loss(plain(x), y) / 2).backward()
        opt.step()
        opt.zero_grad()
    mine = [p for p in engine.module.parameters()]
    assert len(mine) == 4
    for p, ref in zip(mine, plain.parameters()):
        torch.testing.assert_close(utils.safe_get_full_fp32_param(p), ref.detach(),
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(utils.safe_get_full_optimizer_state(p, "exp_avg"),
                                   opt.state[ref]["exp_avg"], rtol=1e-5, atol=1e-7)


def test_pipeline_fp16_keeps_a_frozen_weight_written_after_initialize(solo: None) -> None:
    """fp16 at stage 0 on a pipeline: the step copies back only the stepped
    masters, so 0.5 written into a frozen layer after initialize() stays."""
    from dsrun.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    module = PipelineModule([LayerSpec(torch.nn.Linear, 6, 8), LayerSpec(torch.nn.Tanh),
                             LayerSpec(torch.nn.Linear, 8, 2)], num_stages=1,
                            loss_fn=lambda out, y: torch.nn.functional.mse_loss(out.float(), y))
    engine, *_ = dsrun.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": 3, "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "fp16": {"enabled": True, "loss_scale": 128, "auto_cast": True}})
    first, last = list(engine.module.parameters())[0], list(engine.module.parameters())[-1]
    first.requires_grad_(False)
    with torch.no_grad():
        first.fill_(0.5)
    before = last.detach().clone()
    gen = torch.Generator().manual_seed(5)
    engine.train_batch(iter([(torch.randn(3, 6, generator=gen), torch.randn(3, 2, generator=gen))]))
    assert not torch.equal(last.detach(), before)  # the step was applied
    assert torch.equal(first.detach(), torch.full_like(first, 0.5))
