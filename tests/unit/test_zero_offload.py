"""ZeRO-Offload plumbing and optimizer sub-groups, without processes: which
settings a config gives, what the engine says about each offload section,
where things are placed, how host bytes are counted, how masters are cut
for the inner optimizer. (The CPU-rank training runs with offload on
are in tests/dist and tests/unit/test_initialize.py.)"""

from __future__ import annotations

import logging

import pytest
import torch

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config_schema import Ctx
from dsrun.runtime.config_sections import parse_zero
from dsrun.runtime.zero.comm import CommStrategy
from dsrun.runtime.zero.masters import split_master
from dsrun.runtime.zero.memory import StateBytes, count_bytes
from dsrun.runtime.zero.offload import HOST, Placement, host_copy, to_device
from dsrun.runtime.zero.sharded import ZeroSettings
from dsrun.runtime.zero.stage3 import Stage3Settings
from dsrun.runtime.zero.stepping import comm_volume, memory_lines, offload_notes

CUDA = torch.device("cuda", 0)


def zero(**section: object) -> object:
    return parse_zero(section, Ctx("test.json"))


def test_settings_read_the_offload_sections() -> None:
    cfg = zero(stage=3, offload_optimizer={"device": "cpu", "pin_memory": True},
               offload_param={"device": "cpu"})
    s3 = Stage3Settings.from_config(cfg)
    assert (s3.offload_optimizer, s3.offload_param, s3.pin_memory) == (True, True, True)
    s12 = ZeroSettings.from_config(cfg)
    assert (s12.offload_optimizer, s12.pin_memory) == (True, True)
    plain = Stage3Settings.from_config(zero(stage=3, offload_param={"device": "none"}))
    assert (plain.offload_optimizer, plain.offload_param, plain.pin_memory) == \
        (False, False, False)


def test_legacy_cpu_offload_key_turns_on_optimizer_offload() -> None:
    assert ZeroSettings.from_config(zero(stage=2, cpu_offload=True)).offload_optimizer


def test_offload_notes_per_stage_and_device() -> None:
    both = zero(stage=3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    assert offload_notes(both, 3, CUDA, "c.json") == []  # real offload: nothing to say
    notes = offload_notes(both, 3, HOST, "c.json")
    assert len(notes) == 2 and all(level == logging.INFO and "no-op" in text
                                   for level, text in notes)
    notes = offload_notes(both, 2, CUDA, "c.json")
    assert notes == [(logging.WARNING, "zero_optimization.offload_param (c.json) needs stage "
                                       "3; at stage 2 it is ignored")]
    notes = offload_notes(both, 0, CUDA, "c.json")
    assert len(notes) == 2 and all(level == logging.WARNING for level, _ in notes)
    assert "needs ZeRO stage 1, 2 or 3" in notes[0][1]
    assert offload_notes(zero(stage=3), 3, CUDA, "c.json") == []


def test_nvme_offload_is_refused_naming_the_section_and_source() -> None:
    cfg = zero(stage=3, offload_param={"device": "nvme", "nvme_path": "/local"})
    with pytest.raises(DsrunConfigError, match=r"offload_param.device='nvme' \(c.json\)"):
        offload_notes(cfg, 3, CUDA, "c.json")


def test_an_unused_section_is_ignored_whatever_its_device() -> None:
    """As DeepSpeed: stage 1/2 do not read offload_param, stage 0 neither
    section, so "nvme" there is warned about like "cpu", not refused."""
    nvme = {"device": "nvme", "nvme_path": "/local"}
    for stage in (1, 2):
        notes = offload_notes(zero(stage=stage, offload_param=nvme), stage, CUDA, "c.json")
        assert notes == [(logging.WARNING, "zero_optimization.offload_param (c.json) needs "
                                           f"stage 3; at stage {stage} it is ignored")]
    notes = offload_notes(zero(stage=0, offload_optimizer=nvme, offload_param=nvme), 0,
                          HOST, "c.json")
    assert [level for level, _ in notes] == [logging.WARNING] * 2
    with pytest.raises(DsrunConfigError, match=r"offload_optimizer.device='nvme' \(c.json\)"):
        offload_notes(zero(stage=2, offload_optimizer=nvme), 2, CUDA, "c.json")


@pytest.mark.parametrize("device", [CUDA, HOST])
def test_partial_offload_and_super_offload_get_one_warning(device: torch.device) -> None:
    cfg = zero(stage=3, offload_optimizer={"device": "cpu", "ratio": 0.25,
                                           "super_offload": True, "cpuadam_cores_perc": 0.5})
    warned = [text for level, text in offload_notes(cfg, 3, device, "c.json")
              if level == logging.WARNING]
    assert len(warned) == 1
    for part in ("(c.json)", "ratio=0.25", "keeps 75%", "super_offload=true",
                 "cpuadam_cores_perc=0.5", "offloads all of the optimizer state",
                 "no partial offload and no SuperOffload"):
        assert part in warned[0], part


def test_offload_keys_deepspeed_ignores_too_are_not_warned_about() -> None:
    quiet = [zero(stage=3, offload_optimizer={"device": "cpu", "cpuadam_cores_perc": 0.5}),
             zero(stage=2, offload_optimizer={"device": "cpu", "super_offload": True}),
             zero(stage=3, offload_optimizer={"device": "none", "ratio": 0.5}),
             zero(stage=3, offload_optimizer={"device": "cpu", "ratio": 1.0, "fast_init": True,
                                              "buffer_count": 8})]
    for cfg in quiet:
        assert offload_notes(cfg, cfg.stage, CUDA, "c.json") == []
    sole = offload_notes(zero(stage=3, offload_optimizer={"device": "cpu", "super_offload": True}),
                         3, CUDA, "c.json")
    assert len(sole) == 1 and "SuperOffload optimizer)" in sole[0][1]
    assert "cpuadam" not in sole[0][1] and "ratio" not in sole[0][1]


def test_placement() -> None:
    gpu = Placement(CUDA, offload_optimizer=True)
    assert (gpu.master_device, gpu.offloads) == (HOST, True)
    assert Placement(CUDA, offload_param=True).offloads
    assert Placement(CUDA, offload_param=True).master_device == CUDA
    assert Placement(CUDA).master_device == CUDA and not Placement(CUDA).offloads
    assert not Placement(HOST, offload_optimizer=True, offload_param=True).offloads


def test_host_copy_is_a_separate_tensor_and_to_device_keeps_what_is_there() -> None:
    t = torch.arange(6.0)
    copy = host_copy(t, pin_memory=True, dtype=torch.float64)
    assert copy.dtype == torch.float64 and torch.equal(copy, t.double())
    assert copy.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert copy.is_pinned() == torch.cuda.is_available()  # pinning needs CUDA
    assert to_device(t, HOST) is t
    assert to_device(t, HOST, torch.float16).dtype == torch.float16


def test_count_bytes_reports_host_model_state_but_not_buffers() -> None:
    p, g, o, b = (torch.zeros(n) for n in (10, 20, 30, 40))
    counted = count_bytes(params=[p], grads=[g], optimizer=[o, o], buffers=[b])
    assert (counted.params, counted.grads, counted.optimizer, counted.buffers) == \
        (40, 80, 120, 160)
    assert counted.host == counted.model_state == 240


def test_split_master_views_cover_the_master_once() -> None:
    master = torch.nn.Parameter(torch.arange(23.0))
    assert split_master(master, 23) == [master] and split_master(master, 100) == [master]
    pieces = split_master(master, 7)
    assert [p.numel() for p in pieces] == [7, 7, 7, 2]
    assert all(p.is_leaf and p.requires_grad for p in pieces)
    with torch.no_grad():
        for p in pieces:
            p.add_(1000.0)  # writes land in the master
    assert torch.equal(master.detach(), torch.arange(23.0) + 1000.0)
    with pytest.raises(ValueError, match="sub_group_size"):
        split_master(master, 0)



def test_memory_report_names_the_bytes_in_host_memory() -> None:
    class Offloaded:
        placement = Placement(CUDA, offload_optimizer=True)

        def state_bytes(self) -> StateBytes:
            return StateBytes(params=400, grads=200, optimizer=3 * 2**20, host=3 * 2**20)

    lines = memory_lines(torch.nn.Linear(10, 10), Offloaded(), 2, 2, "fp32")
    assert lines[-1] == ("  offloaded to host memory: 3.0 MiB (offload_optimizer=True, "
                         "offload_param=False)")
    Offloaded.placement = Placement(CUDA)
    assert not any("offloaded" in line
                   for line in memory_lines(torch.nn.Linear(10, 10), Offloaded(), 2, 2, "fp32"))


GLOO = CommStrategy()
NCCL = CommStrategy(reduce="reduce_scatter", owner_reduce="reduce", gather="all_gather")


@pytest.mark.parametrize(("stage", "strategy", "gas", "paper", "ours"), [
    (0, None, 4, 2, 2),
    (1, NCCL, 1, 2, 2), (1, GLOO, 1, 2, 3), (1, GLOO, 4, 2, 3),  # stage 1: once per step
    (2, NCCL, 1, 2, 2), (2, GLOO, 3, 2, 7),                        # stage 2: every micro-step
    (3, NCCL, 1, 3, 3), (3, GLOO, 1, 3, 4), (3, NCCL, 2, 3, 6),
])
def test_communication_volume_per_step(stage: int, strategy: CommStrategy | None, gas: int,
                                       paper: int, ours: int) -> None:
    assert comm_volume(stage, strategy, gas)[:2] == (paper, ours)


def test_memory_report_has_the_communication_line() -> None:
    class Sharded:
        strategy = GLOO
        comm_dtype = torch.float32

        def state_bytes(self) -> StateBytes:
            return StateBytes()

    model = torch.nn.Linear(1024, 1024, bias=False)  # Ψ = 2^20: 4 MiB of fp32
    line = memory_lines(model, Sharded(), 3, 2, "fp32", 1)[3]
    assert line == ("  communication per step: paper 3Ψ (12.0 MiB of float32); dsrun 4Ψ "
                    "(16.0 MiB): broadcast from owners of parameters in forward and backward "
                    "(2Ψ) + all-reduce of gradients (2Ψ)")
    assert not any("communication" in x for x in memory_lines(model, Sharded(), 3, 1, "fp32"))
