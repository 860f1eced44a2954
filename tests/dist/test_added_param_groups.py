"""Stage 0: parameters put into the optimizer after initialize() with
``optimizer.add_param_group`` train as with DDP and a torch optimizer, on 2
gloo ranks (workers/added_groups.py runs every case in one job): averaged
over the ranks, clipped and counted in ``get_global_grad_norm()``, and
under fp16 stepped through fp32 masters from unscaled gradients, with an
inf gradient of theirs skipping the step, and a checkpoint saved then
resuming exactly; a tensor that is no model parameter, or one already
there, is refused and leaves the groups as they were. At ZeRO 1-3 the ZeRO optimizer
has no ``add_param_group`` (an AttributeError, as in DeepSpeed 0.19.8).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dsrun
from dsrun.errors import DsrunConfigError
from tests.conftest import ROOT, rank_results

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "added_groups.py"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("added_groups")
    return rank_results(WORKER, out, 2, timeout=180, env={"OMP_NUM_THREADS": "1"})


def test_fp32_added_groups_are_averaged_and_clipped_as_torch_does(
        job: list[dict[str, Any]]) -> None:
    for result in job:
        case = result["fp32"]
        assert "error" not in case, case
        assert case["norm_diff"] < 1e-5, case["norm_diff"]
        assert case["weight_diff"] < 1e-6, case["weight_diff"]
    assert job[0]["fp32"]["weights"] == job[1]["fp32"]["weights"]


def test_fp16_added_groups_get_masters_and_unscaled_gradients(
        job: list[dict[str, Any]]) -> None:
    for result in job:
        case = result["fp16"]
        assert "error" not in case, case
        assert case["skipped"] == 0
        assert case["norm_diff"] < 5e-3, case["norm_diff"]
        assert case["weight_diff"] < 5e-3, case["weight_diff"]
        assert case["overflow"] == {"skipped": 1, "moved": 0.0}
    assert job[0]["fp16"]["weights"] == job[1]["fp16"]["weights"]


def test_fp16_checkpoint_after_add_param_group_resumes_exactly(
        job: list[dict[str, Any]]) -> None:
    for result in job:
        assert result["resume"] == 0.0, result["resume"]


@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_zero_optimizers_have_no_add_param_group(job: list[dict[str, Any]], stage: str) -> None:
    for result in job:
        assert result["zero"][stage].startswith("AttributeError"), result["zero"][stage]
        assert "add_param_group" in result["zero"][stage]


def test_fp16_refuses_a_foreign_or_repeated_tensor_and_keeps_its_groups(solo: None) -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    m[0].requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "fp16": {"enabled": True}}
    _, opt, *_ = dsrun.initialize(model=m, config=config, model_parameters=m[1].parameters())
    extra = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(DsrunConfigError, match=r"add_param_group: param group 1, parameter 0 "
                                               r"\(shape \(3,\)\) is not a parameter of the model"):
        opt.add_param_group({"params": [extra]})
    with pytest.raises(DsrunConfigError, match=r"add_param_group: param group 1, parameter 1 .* "
                                               "in the optimizer already"):
        opt.add_param_group({"params": [m[0].weight, m[1].weight]})
    assert [len(g["params"]) for g in opt.param_groups] == [2]
    opt.add_param_group({"params": [m[0].weight]})
    assert [p.dtype for g in opt.param_groups for p in g["params"]] == [torch.float32] * 3


def test_fp32_warns_of_an_added_tensor_that_is_not_a_module_parameter(
        solo: None, caplog: pytest.LogCaptureFixture) -> None:
    """As initialize() warns of such tensors: each rank steps them with its
    own gradient. A module parameter added the same way gets no warning."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    m[0].requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    _, opt, *_ = dsrun.initialize(model=m, config=config, model_parameters=m[1].parameters())
    with caplog.at_level("WARNING", logger="dsrun"):
        m[0].requires_grad_(True)
        opt.add_param_group({"params": list(m[0].parameters())})
        assert "not parameters of the module" not in caplog.text
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    assert "1 tensor(s) added to the optimizer's param groups are not parameters" in caplog.text
