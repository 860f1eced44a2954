"""The ZeRO memory estimators at DeepSpeed's import paths, with dsrun's
numbers (pure: no process group)."""

from __future__ import annotations

import pytest
import torch

import dsrun  # noqa: F401 - the deepspeed import alias
from dsrun.runtime.zero.estimate import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs,
    model_to_params,
)
from dsrun.runtime.zero.memory import zero_model_state_bytes
from dsrun.runtime.zero.sharded import ZeroOptimizer
from dsrun.runtime.zero.stage3 import ZeroStage3

PSI, LAYER = 1_000_000, 250_000


@pytest.mark.parametrize("ranks_per_node, nodes", [(1, 1), (8, 1), (4, 2)])
def test_device_bytes_without_offload_are_the_engines_formula(ranks_per_node: int,
                                                               nodes: int) -> None:
    n = ranks_per_node * nodes
    mixed = {"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12}
    _, device2 = estimate_zero2_model_states_mem_needs(PSI, ranks_per_node, nodes,
                                                        cpu_offload=False)
    assert device2 == int(zero_model_state_bytes(PSI, n, 2, **mixed))
    _, device3, layer = estimate_zero3_model_states_mem_needs(
        PSI, LAYER, ranks_per_node, nodes, cpu_offload=False, cpu_offload_params=False)
    assert layer == 2 * LAYER
    assert device3 == int(zero_model_state_bytes(PSI, n, 3, **mixed) + layer)


def test_offload_moves_state_to_the_host() -> None:
    host, device = estimate_zero2_model_states_mem_needs(PSI, 4, 1, cpu_offload=True,
                                                         additional_buffer_factor=1.0)
    assert (host, device) == (16 * PSI, 2 * PSI + 2 * PSI // 4)
    host, device, _ = estimate_zero3_model_states_mem_needs(
        PSI, LAYER, 4, 1, cpu_offload=True, cpu_offload_params=True, zero_init=True,
        additional_buffer_factor=1.0)
    assert (host, device) == (18 * PSI, 2 * PSI // 4 + 2 * LAYER)
    # without zero.Init every rank of the node builds the fp32 model on the host first
    host, _, _ = estimate_zero3_model_states_mem_needs(
        PSI, LAYER, 4, 1, cpu_offload=False, cpu_offload_params=False, zero_init=False,
        additional_buffer_factor=1.5)
    assert host == int(4 * PSI * 4 * 1.5)
    with pytest.raises(ValueError, match="at least one rank"):
        estimate_zero2_model_states_mem_needs(PSI, 0)


def test_deepspeed_paths_and_the_printed_tables(capsys: pytest.CaptureFixture[str]) -> None:
    from deepspeed.runtime.zero.stage3 import (
        DeepSpeedZeroOptimizer_Stage3,
        estimate_zero3_model_states_mem_needs_all_live,
    )
    from deepspeed.runtime.zero.stage_1_and_2 import (
        DeepSpeedZeroOptimizer,
        estimate_zero2_model_states_mem_needs_all_live,
    )

    assert DeepSpeedZeroOptimizer is ZeroOptimizer and DeepSpeedZeroOptimizer_Stage3 is ZeroStage3
    model = torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 100))
    model[1].weight = model[0].weight  # tied: counted once
    assert model_to_params(model) == (100 * 8 + 100, 800 + 100)  # the Linear: weight + bias
    estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    out = capsys.readouterr().out
    assert out.count("per CPU  |  per GPU |   Options") == 2
    assert out.count("zero_init=") == 6 and out.count("offload_optimizer=") == 8


def test_deepspeeds_zero_enums() -> None:
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    assert ZeroStageEnum.weights == 3 and ZeroStageEnum.max_stage is ZeroStageEnum.weights
    assert ZeroStageEnum(2) is ZeroStageEnum.gradients
    assert OffloadDeviceEnum("cpu") is OffloadDeviceEnum.cpu and OffloadDeviceEnum.cpu == "cpu"
