"""On a one-rank gloo group in this process: what DeepSpeed 0.19.8 files
where, and its per-parameter functions.

* ``all_reduce_coalesced`` and ``inference_all_reduce`` are logged under
  ``all_reduce`` (their log name in DeepSpeed), so ``prof_ops:
  ["all_reduce"]`` counts them; sizes read as DeepSpeed writes them.
* ``inference_all_reduce`` returns its tensor.
* ``deepspeed.utils.get_full_hp_param`` and the rest are the ``safe_*``
  calls; the parameters carry none of DeepSpeed's links.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import dsrun
import dsrun.utils as utils
from dsrun import comm
from dsrun.runtime.commlog import LOGGER
from tests.dist.workers.utils_cases import Net

pytestmark = pytest.mark.dist


@pytest.fixture
def only_all_reduce() -> Iterator[None]:
    """The logger on for the log name ``all_reduce`` only, off and empty after."""
    LOGGER.reset()
    LOGGER.configure(enabled=True, prof_all=False, prof_ops=["all_reduce"], verbose=False,
                     debug=False)
    try:
        yield
    finally:
        LOGGER.configure(enabled=False, prof_all=True, prof_ops=[], verbose=False, debug=False)
        LOGGER.reset()


def test_coalesced_and_inference_all_reduce_are_filed_as_all_reduce(
        solo: None, only_all_reduce: None) -> None:
    t = torch.ones(4)
    assert comm.inference_all_reduce(t) is t  # DeepSpeed returns the tensor on one rank
    comm.all_reduce_coalesced([torch.ones(2), torch.ones(3)])
    comm.all_reduce_coalesced([torch.ones(2)], log_name="mine")  # not profiled: not asked for
    assert comm.get_logged_comm_ops() == ["all_reduce"]
    summary = comm.log_summary(return_dict=True)
    assert summary is not None
    rows = summary["summary"]["all_reduce"]
    assert {size: row["count"] for size, row in rows.items()} == {16: 1, 20: 1}
    assert rows[20]["msg_size_str"] == "20.0 B"  # DeepSpeed's convert_size


def test_inference_all_reduce_returns_its_tensor_unprofiled(solo: None) -> None:
    t = torch.arange(3.0)
    assert comm.inference_all_reduce(t, async_op=True) is t
    assert torch.equal(t, torch.arange(3.0))


def bf16_stage1() -> Any:
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "bf16": {"enabled": True}, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 1}}
    engine, *_ = dsrun.initialize(model=Net(), config=config)
    return engine


def test_hp_functions_are_the_safe_calls(solo: None) -> None:
    engine = bf16_stage1()
    p = engine.module.mid.weight
    # dsrun keeps none of DeepSpeed's links on parameters (README)
    assert not any(hasattr(p, name) for name in ("_hp_mapping", "get_full_hp_param",
                                                 "_z3_optimizer"))
    loss = engine(torch.randn(2, 6, generator=torch.Generator().manual_seed(3)))
    engine.backward(loss)
    grad = utils.get_full_hp_grad(p)
    assert grad is not None and torch.equal(grad, utils.safe_get_full_grad(p))
    utils.set_full_hp_grad(p, torch.full_like(grad, 0.5))
    assert torch.equal(utils.safe_get_full_grad(p), torch.full_like(grad, 0.5))
    engine.step()
    master = utils.get_full_hp_param(p)
    assert master is not None and master.dtype == torch.float32
    assert torch.equal(master, utils.safe_get_full_fp32_param(p))
    exp_avg = utils.get_full_hp_param(p, optim_state_key="exp_avg")
    assert torch.equal(exp_avg, utils.safe_get_full_optimizer_state(p, "exp_avg"))
    # after set_full_hp_grad's 0.5 everywhere, AdamW's first moment is 0.1 * 0.5
    assert torch.allclose(exp_avg, torch.full_like(exp_avg, 0.05))
    value = torch.linspace(-1, 1, p.numel()).reshape(p.shape)
    utils.set_full_hp_param(p, value)
    assert torch.equal(utils.safe_get_full_fp32_param(p), value)
    utils.set_full_hp_param(p, torch.zeros_like(value), "exp_avg")
    assert torch.equal(utils.safe_get_full_optimizer_state(p, "exp_avg"),
                       torch.zeros_like(value))
    assert utils.get_full_hp_param(engine.module.frozen) is None  # as safe_* answers
