"""``deepspeed.runtime.<module>.X`` and ``deepspeed.dist`` after a bare
``import deepspeed`` (dsrun's alias), as DeepSpeed 0.19.8, whose
``__init__`` imports these modules eagerly; dsrun loads them on first
access (PEP 562), so ``import dsrun`` and ``dsrun.runtime`` stay torch-free.
Fresh interpreters: what a module has already imported decides these."""

from __future__ import annotations

import json
import subprocess
import sys

# The chains DeepSpeedExamples and the tutorials use, in an order where
# deepspeed.runtime.zero is already imported (by runtime.utils) when
# partition_parameters is asked for.
CHAINS = """
import json
import dsrun  # what every rank's bootstrap does: installs the deepspeed alias
import deepspeed
import torch
deepspeed.runtime.utils.set_random_seed(1138)
out = {"seed": torch.initial_seed()}
chains = {
    "runtime.utils.see_memory_usage": deepspeed.runtime.utils.see_memory_usage,
    "runtime.lr_schedules.WarmupLR": deepspeed.runtime.lr_schedules.WarmupLR,
    "runtime.zero.partition_parameters.ZeroParamStatus":
        deepspeed.runtime.zero.partition_parameters.ZeroParamStatus,
    "runtime.zero.Init": deepspeed.runtime.zero.Init,
    "runtime.engine.DeepSpeedEngine": deepspeed.runtime.engine.DeepSpeedEngine,
    "runtime.pipe.module.PipelineModule": deepspeed.runtime.pipe.module.PipelineModule,
    "runtime.pipe.topology.PipeModelDataParallelTopology":
        deepspeed.runtime.pipe.topology.PipeModelDataParallelTopology,
    "runtime.dataloader.RepeatingLoader": deepspeed.runtime.dataloader.RepeatingLoader,
    "runtime.activation_checkpointing.checkpointing.checkpoint":
        deepspeed.runtime.activation_checkpointing.checkpointing.checkpoint,
    "dist.get_rank": deepspeed.dist.get_rank,
    "moe.utils.is_moe_param": deepspeed.moe.utils.is_moe_param,
    "DeepSpeedConfig": deepspeed.DeepSpeedConfig,
}
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
import dsrun.runtime.pipe.module, dsrun.runtime.pipe.topology, dsrun.runtime.dataloader
import dsrun.runtime.lr_schedules, dsrun.runtime.utils, dsrun.checkpointing, dsrun.comm
import dsrun.moe.utils, dsrun.runtime.ds_config
expected = {
    "runtime.utils.see_memory_usage": dsrun.runtime.utils.see_memory_usage,
    "runtime.lr_schedules.WarmupLR": dsrun.runtime.lr_schedules.WarmupLR,
    "runtime.zero.partition_parameters.ZeroParamStatus": ZeroParamStatus,
    "runtime.zero.Init": dsrun.zero.Init,
    "runtime.engine.DeepSpeedEngine": dsrun.DeepSpeedEngine,
    "runtime.pipe.module.PipelineModule": dsrun.runtime.pipe.module.PipelineModule,
    "runtime.pipe.topology.PipeModelDataParallelTopology":
        dsrun.runtime.pipe.topology.PipeModelDataParallelTopology,
    "runtime.dataloader.RepeatingLoader": dsrun.runtime.dataloader.RepeatingLoader,
    "runtime.activation_checkpointing.checkpointing.checkpoint": dsrun.checkpointing.checkpoint,
    "dist.get_rank": dsrun.comm.get_rank,
    "moe.utils.is_moe_param": dsrun.moe.utils.is_moe_param,
    "DeepSpeedConfig": dsrun.runtime.ds_config.DeepSpeedConfig,
}
out["same"] = {k: chains[k] is expected[k] for k in chains}
out["split"] = split_params_into_different_moe_groups_for_optimizer.__module__
print(json.dumps(out))
"""

# An aliased import loads dsrun.runtime.zero first; before it, the
# launcher's side of dsrun (import dsrun, dsrun.runtime) must not import torch.
ALIASED = """
import json, sys
import dsrun, dsrun.runtime
out = {"torch_after_import": "torch" in sys.modules,
       "unknown": hasattr(dsrun.runtime, "no_such_module"),
       "dunder": hasattr(dsrun.runtime, "__wrapped__")}
out["torch_after_probes"] = "torch" in sys.modules
from deepspeed.runtime.zero.stage3 import ZeroStage3
import deepspeed
out["status"] = deepspeed.runtime.zero.partition_parameters.ZeroParamStatus is \\
    dsrun.zero.ZeroParamStatus
print(json.dumps(out))
"""

# dsrun's own module name imported after the alias (not through deepspeed.*
# or an attribute of dsrun): the package's __getattr__ still answers.
OWN_NAME_FIRST = """
import json
import dsrun
import deepspeed
import dsrun.runtime.engine
print(json.dumps({"init": deepspeed.runtime.zero.partition_parameters.Init is dsrun.zero.Init}))
"""


def run(code: str) -> dict:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_runtime_chains_after_import_deepspeed_reach_the_modules_deepspeed_names() -> None:
    out = run(CHAINS)
    assert out["seed"] == 1138
    assert out["same"] == {k: True for k in out["same"]}
    assert out["split"] == "dsrun.moe.utils"


def test_partition_parameters_after_an_aliased_import_and_no_torch_before() -> None:
    out = run(ALIASED)
    assert out == {"torch_after_import": False, "unknown": False, "dunder": False,
                   "torch_after_probes": False, "status": True}


def test_partition_parameters_after_importing_dsruns_own_module_name() -> None:
    assert run(OWN_NAME_FIRST) == {"init": True}
