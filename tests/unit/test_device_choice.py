"""Which backend and which GPU a rank uses (runtime/dist.py), decided by
pure functions over torch's facts; the CUDA facts are monkeypatched here,
tests/gpu/test_device_binding_gpu.py checks them on a real GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dsrun import checkpointing
from dsrun.errors import DsrunError
from dsrun.runtime import dist as rdist
from dsrun.runtime.env import DistEnv
from dsrun.runtime.zero.comm import STRATEGIES, strategy_for_config

# ------------------------------------------------ what torch reports for a group

PROBE = """
import json, sys, warnings
import torch.distributed as dist
warnings.simplefilter("ignore")
out = {}
for spec in sys.argv[1:]:
    kwargs = {} if spec == "none" else {"backend": spec}
    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    out[spec] = [str(dist.get_backend()), dist.get_backend_config()]
    dist.destroy_process_group()
print(json.dumps(out))
"""


def test_backend_names_and_configs_of_real_cpu_groups() -> None:
    """torch 2.13 on a host without CUDA: plain gloo's config names cuda too,
    a group made with no backend is "undefined" by name; none is NCCL."""
    specs = ["gloo", "none", "cpu:gloo,cuda:gloo", "cpu:gloo"]
    res = subprocess.run([sys.executable, "-c", PROBE, *specs], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    if torch.cuda.is_available():  # "none" would be cuda:nccl there
        got.pop("none")
    else:
        assert got["none"] == ["undefined", "cpu:gloo"]
    assert got["gloo"] == ["gloo", "cpu:gloo,cuda:gloo"]
    assert got["cpu:gloo,cuda:gloo"] == ["cpu:gloo,cuda:gloo", "cpu:gloo,cuda:gloo"]
    assert got["cpu:gloo"] == ["cpu:gloo", "cpu:gloo"]
    assert not any(rdist.uses_nccl(config) for _, config in got.values())


@pytest.mark.parametrize("spec, cuda, nccl", [
    ("nccl", "nccl", True), ("NCCL", "nccl", True), ("cuda:nccl", "nccl", True),
    ("cpu:gloo,cuda:nccl", "nccl", True), ("cuda:nccl,cpu:gloo", "nccl", True),
    ("gloo", "gloo", False), ("cpu:gloo,cuda:gloo", "gloo", False), ("cpu:gloo", None, False),
    ("undefined", None, False), ("", None, False), (None, None, False),
    ("mpi", "mpi", False), ("cpu:nccl", None, False),
])
def test_cuda_backend_of_a_name_or_config(spec: Any, cuda: Any, nccl: bool) -> None:
    assert rdist.cuda_backend(spec) == cuda
    assert rdist.uses_nccl(spec) is nccl


@pytest.mark.parametrize("config, device, strategy", [
    ("cuda:nccl", "cuda", "nccl"), ("cuda:nccl", None, "nccl"),
    ("cpu:gloo,cuda:nccl", "cuda", "nccl"), ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
    ("cpu:gloo,cuda:nccl", None, "gloo"), ("cpu:gloo,cuda:gloo", "cpu", "gloo"),
    ("cpu:gloo,cuda:gloo", None, "gloo"), ("cpu:gloo", "cpu", "gloo"),
    ("nccl", "cuda", "nccl"), ("cpu:mpi,cuda:mpi", "cpu", "gloo"),
])
def test_zero_strategy_from_the_backend_config(config: str, device: Any, strategy: str) -> None:
    assert strategy_for_config(config, device) == STRATEGIES[strategy]


# ------------------------------------------------ the rank's GPU


def test_local_device_index() -> None:
    assert rdist.local_device_index(0, 8, None) == 0
    assert rdist.local_device_index(3, 8, "0,1,2,3,4,5,6,7") == 3
    assert rdist.local_device_index(1, 1, "5") == 0  # srun --gpus-per-task=1
    assert rdist.local_device_index(0, 1, None) == 0
    with pytest.raises(DsrunError) as info:
        rdist.local_device_index(3, 2, "4,5", "Slurm")
    text = str(info.value)
    assert "local rank 3 (LOCAL_RANK, from Slurm)" in text
    assert "sees 2 CUDA device(s) (CUDA_VISIBLE_DEVICES='4,5')" in text
    assert "--gpus-per-task=1" in text


def test_choose_cuda_device_keeps_the_scripts_choice() -> None:
    def never() -> int:
        raise AssertionError("the local rank is not asked for")

    assert rdist.choose_cuda_device(0, 2, never) == 2  # init_process_group(device_id=2)
    assert rdist.choose_cuda_device(3, None, never) == 3  # torch.cuda.set_device(3)
    assert rdist.choose_cuda_device(0, None, lambda: 1) == 1  # nobody chose: LOCAL_RANK
    assert rdist.choose_cuda_device(0, None, lambda: 0) == 0


def test_every_rank_chooses_the_same_backend_under_per_task_binding(monkeypatch) -> None:
    """Each task sees one GPU (srun --gpus-per-task=1): local rank 1 is a GPU
    rank too, on device 0; dsrun --cpu still means gloo."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ranks = [DistEnv(rank=r, world_size=2, local_rank=r, local_world_size=2, source="Slurm",
                     cuda_visible_devices=str(r)) for r in (0, 1)]
    assert [rdist.default_backend(env) for env in ranks] == ["nccl", "nccl"]
    assert [rdist.cuda_device_index(env) for env in ranks] == [0, 0]
    rdist.check_backend("nccl", ranks[1], "x")
    assert rdist.default_backend(DistEnv(accelerator="cpu")) == "gloo"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    env = DistEnv(rank=3, world_size=4, local_rank=3, local_world_size=4,
                  cuda_visible_devices="0,1")
    with pytest.raises(DsrunError, match=r"local rank 3 .* sees 2 CUDA device\(s\) "
                                         r"\(CUDA_VISIBLE_DEVICES='0,1'\)"):
        rdist.check_backend("cpu:gloo,cuda:nccl", env, "x")
    rdist.check_backend("gloo", env, "x")


def test_cpu_gloo_cuda_nccl_is_refused_on_a_cpu_rank() -> None:
    with pytest.raises(DsrunError, match="asked for the NCCL backend"):
        rdist.check_backend("cpu:gloo,cuda:nccl", DistEnv(accelerator="cpu"), "x")


class FakeCuda:
    """torch.cuda's facts for a host with ``count`` GPUs, the current one ``current``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, config: str, count: int = 4,
                 current: int = 0, bound: Any = None) -> None:
        self.current, self.set_calls = current, []
        d = rdist.dist
        monkeypatch.setattr(d, "is_initialized", lambda: True)
        monkeypatch.setattr(d, "get_backend_config", lambda group=None: config)
        monkeypatch.setattr(d, "get_backend", lambda group=None: "undefined")
        monkeypatch.setattr(d, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(d.distributed_c10d, "_get_default_group",
                            lambda: SimpleNamespace(bound_device_id=bound))
        monkeypatch.setattr(rdist.torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(rdist.torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(rdist.torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(rdist.torch.cuda, "set_device", self._set)

    def _set(self, index: int) -> None:
        self.set_calls.append(index)
        self.current = index


LOCAL2 = DistEnv(rank=2, world_size=4, local_rank=2, local_world_size=4)


@pytest.mark.parametrize("config", ["cuda:nccl", "cpu:gloo,cuda:nccl"])
def test_a_scripts_nccl_group_trains_on_the_local_ranks_gpu(monkeypatch, config) -> None:
    """torchrun/srun/mpirun + the script's own init_process_group("nccl") (or
    with no backend, or "cpu:gloo,cuda:nccl") and no set_device: the rank's
    GPU, made current, as DeepSpeed's engine does."""
    cuda = FakeCuda(monkeypatch, config)
    assert rdist.compute_device(LOCAL2) == torch.device("cuda", 2)
    assert cuda.set_calls == [2]
    assert rdist.compute_device(LOCAL2) == torch.device("cuda", 2)
    assert cuda.set_calls == [2]  # once


def test_a_gloo_group_trains_on_the_cpu(monkeypatch) -> None:
    cuda = FakeCuda(monkeypatch, "cpu:gloo,cuda:gloo")
    assert rdist.compute_device(LOCAL2) == torch.device("cpu") and cuda.set_calls == []


def test_a_device_the_script_chose_is_kept(monkeypatch) -> None:
    cuda = FakeCuda(monkeypatch, "cuda:nccl", current=3)
    assert rdist.compute_device(LOCAL2) == torch.device("cuda", 3) and cuda.set_calls == []
    cuda = FakeCuda(monkeypatch, "cuda:nccl", bound=torch.device("cuda", 1))
    assert rdist.compute_device(LOCAL2) == torch.device("cuda", 1) and cuda.set_calls == [1]


def test_per_task_binding_with_a_scripts_group_uses_device_0(monkeypatch) -> None:
    cuda = FakeCuda(monkeypatch, "cuda:nccl", count=1)
    env = DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2)
    assert rdist.compute_device(env) == torch.device("cuda", 0) and cuda.set_calls == []


def test_too_few_gpus_for_a_scripts_group_is_one_error(monkeypatch) -> None:
    FakeCuda(monkeypatch, "cuda:nccl", count=2)
    env = DistEnv(rank=3, world_size=4, local_rank=3, local_world_size=4,
                  cuda_visible_devices="0,1")
    with pytest.raises(DsrunError, match="local rank 3"):
        rdist.compute_device(env)


def test_init_distributed_with_a_group_up_binds_the_gpu(monkeypatch) -> None:
    """deepspeed.init_distributed() after the script's own NCCL group."""
    cuda = FakeCuda(monkeypatch, "cuda:nccl")
    rdist.init_distributed(env=LOCAL2)
    assert cuda.set_calls == [2]


# ------------------------------------------------ cpu_checkpointing's anchors


def test_anchor_devices() -> None:
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert checkpointing.anchor_devices([None, torch.device("cpu")]) == []
    assert checkpointing.anchor_devices([cuda1, None, cuda0, cuda1]) == [cuda1, cuda0]


def test_arguments_moved_to_the_host_keep_an_anchor_per_device(monkeypatch) -> None:
    """The checkpointed function gets its arguments back on their devices and
    never sees the anchors torch's checkpoint saves the device RNG state by
    ("meta" stands in for CUDA; moving it to the host is stubbed)."""
    monkeypatch.setattr(checkpointing, "_to_host", lambda value: value)
    seen: list[Any] = []
    x = torch.empty(2, 3, device="meta")

    def function(*args: Any, scale: int = 1) -> int:
        seen.extend(args)
        return scale

    run, args = checkpointing._on_host(function, (x, 7, torch.ones(1)))
    assert len(args) == 4
    anchor = args[-1]
    assert anchor.device.type == "meta" and anchor.numel() == 0
    assert run(*args, scale=5) == 5
    assert len(seen) == 3 and seen[0].device.type == "meta" and seen[1] == 7
    assert seen[2].device.type == "cpu"
