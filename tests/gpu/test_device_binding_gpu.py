"""The GPU a rank trains on when dsrun did not make its process group: a
script started by torchrun, ``srun`` or ``mpirun`` that calls
``torch.distributed.init_process_group`` itself and never
``torch.cuda.set_device`` (runtime/dist.py's module docstring).

Each case is a plain ``python`` process (no dsrun launcher) with the
variables such a launcher sets, world size 1 (one GPU host), and trains one
ZeRO-3 step with ``zero.Init``: the engine, ``zero.Init``'s shards and the
current device must agree on the rank's GPU.

* no backend (``get_backend()`` is ``"undefined"``, the config ``cuda:nccl``)
  and ``"cpu:gloo,cuda:nccl"``: NCCL groups, so the GPU (they trained on the
  CPU before);
* per-task binding (one visible device, ``LOCAL_RANK=1``): device 0, for a
  script's NCCL group and for the group ``dsrun.init_distributed()`` makes
  (which chose gloo on such a rank before);
* ``LOCAL_RANK=1`` seeing two GPUs (needs a host with two): cuda:1, and
  nothing on cuda:0 (every rank trained on cuda:0 before).

What this cannot show: several NCCL ranks (see the README's "On a GPU host").
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.gpu

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "DSRUN_CONFIG", "DSRUN_JOB_ID", "CUDA_VISIBLE_DEVICES",
                 "DSRUN_ACCELERATOR", "DSRUN_DIST_BACKEND")

WORKER = '''
import json, sys
import torch, torch.distributed as dist
import dsrun, dsrun.zero

mode = sys.argv[1]
if mode == "dsrun":
    dsrun.init_distributed()
elif mode == "none":
    dist.init_process_group(init_method="env://")
else:
    dist.init_process_group(mode, init_method="env://")
cfg = {"train_batch_size": 4, "steps_per_print": 10000,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
with dsrun.zero.Init(config_dict_or_path=cfg):
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
shards = sorted({str(p.ds_tensor.device) for p in model.parameters()})
engine, *_ = dsrun.initialize(model=model, config=cfg)
x = torch.randn(4, 16, device=engine.device)
loss = engine(x).square().mean()
engine.backward(loss)
engine.step()
torch.cuda.synchronize()
print("RESULT " + json.dumps({
    "backend": str(dist.get_backend()), "config": dist.get_backend_config(),
    "engine_device": str(engine.device), "current_device": torch.cuda.current_device(),
    "shard_devices": shards, "loss_device": str(loss.device),
    "allocated": [torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())]}))
engine.destroy()
dist.destroy_process_group()
'''

#: name -> (how the group is made, LOCAL_RANK, one visible device?, GPUs needed)
CASES = {
    "no_backend": ("none", 0, False, 1),
    "cpu_gloo_cuda_nccl": ("cpu:gloo,cuda:nccl", 0, False, 1),
    "per_task_script_group": ("nccl", 1, True, 1),
    "per_task_dsrun_group": ("dsrun", 1, True, 1),
    "local_rank_1": ("nccl", 1, False, 2),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case at once (each its own process): CUDA start-up dominates."""
    import torch

    script = tmp_path_factory.mktemp("binding") / "binding.py"
    script.write_text(WORKER)
    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = visible.split(",")[0] if visible else "0"
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")]))
    procs = {}
    for name, (mode, local_rank, one, needs) in CASES.items():
        if count < needs:
            continue
        env = {**base, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": str(local_rank),
               "LOCAL_WORLD_SIZE": str(local_rank + 1), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(_free_port())}
        if one:
            env["CUDA_VISIBLE_DEVICES"] = first
        elif visible:
            env["CUDA_VISIBLE_DEVICES"] = visible
        procs[name] = subprocess.Popen([sys.executable, str(script), mode], env=env,
                                       cwd=str(ROOT), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
    out: dict[str, Any] = {}
    for name, proc in procs.items():
        text, _ = proc.communicate(timeout=300)
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        out[name] = json.loads(lines[-1][7:]) if proc.returncode == 0 and lines else \
            {"error": f"rc {proc.returncode}:\n{text[-4000:]}"}
    return out


def facts(results: dict[str, Any], name: str) -> dict[str, Any]:
    if name not in results:
        pytest.skip(f"needs {CASES[name][3]} GPUs")
    got = results[name]
    assert "error" not in got, got.get("error")
    return got


@pytest.mark.parametrize("name", ["no_backend", "cpu_gloo_cuda_nccl"])
def test_a_nccl_group_by_another_name_trains_on_the_gpu(results, name):
    got = facts(results, name)
    assert "cuda:nccl" in got["config"]
    assert got["engine_device"] == "cuda:0" and got["loss_device"] == "cuda:0"
    assert got["shard_devices"] == ["cuda:0"]


@pytest.mark.parametrize("name", ["per_task_script_group", "per_task_dsrun_group"])
def test_per_task_binding_uses_the_one_visible_device(results, name):
    got = facts(results, name)
    assert got["backend"] == "nccl"
    assert got["engine_device"] == "cuda:0" and got["current_device"] == 0
    assert got["shard_devices"] == ["cuda:0"] and len(got["allocated"]) == 1


def test_a_scripts_group_trains_on_the_local_ranks_gpu(results):
    got = facts(results, "local_rank_1")
    assert got["engine_device"] == "cuda:1" and got["current_device"] == 1
    assert got["shard_devices"] == ["cuda:1"] and got["loss_device"] == "cuda:1"
    assert got["allocated"][0] == 0 and got["allocated"][1] > 0
