"""dsrun: a launcher and ZeRO training runtime for DeepSpeed-style scripts.

The public runtime API is loaded lazily (PEP 562) so that importing
``dsrun`` - which the launcher and node agents do - never imports torch.
``import dsrun as deepspeed`` gives DeepSpeed scripts the names they use;
where DeepSpeed itself is not installed, ``deepspeed.<name>`` imports
resolve to ``dsrun.<name>`` (:mod:`dsrun._alias`).
"""

from __future__ import annotations

import importlib
from typing import Any

from dsrun import _alias
from dsrun._absent import module_getattr_error

#: dsrun's own release (pyproject, ``dsrun --version``, checkpoints, doctor)
DSRUN_VERSION = "0.1.0"
#: DeepSpeed's attributes, for scripts that ``import dsrun as deepspeed`` and
#: gate on them: the DeepSpeed release whose API dsrun follows, then dsrun's
#: own (the same string as the ``deepspeed`` alias's package metadata).
__version__ = f"{_alias.DEEPSPEED_API_VERSION}+dsrun.{DSRUN_VERSION}"
__version_major__, __version_minor__, __version_patch__ = (
    int(part) for part in _alias.DEEPSPEED_API_VERSION.split("."))
__git_hash__ = __git_branch__ = "[none]"  # DeepSpeed's value where it was not built from git

# public name -> "module:attribute" it lives in
_LAZY = {
    "init_distributed": "dsrun.comm.init_dist:init_distributed",  # DeepSpeed's signature
    "DistEnv": "dsrun.runtime.env:DistEnv",
    "initialize": "dsrun.runtime.initialize:initialize",
    "add_config_arguments": "dsrun.runtime.initialize:add_config_arguments",
    "DsrunEngine": "dsrun.runtime.engine:DsrunEngine",
    "DeepSpeedEngine": "dsrun.runtime.engine:DsrunEngine",
    "DsrunConfigError": "dsrun.errors:DsrunConfigError",
    "DeepSpeedConfigError": "dsrun.errors:DsrunConfigError",
    "PipelineModule": "dsrun.pipe:PipelineModule",
    "PipelineEngine": "dsrun.runtime.pipe.engine:PipelineEngine",
    "get_accelerator": "dsrun.accelerator:get_accelerator",
    "log_dist": "dsrun.utils:log_dist",
    "logger": "dsrun.utils:logger",
    "OnDevice": "dsrun.utils.init_on_device:OnDevice",
    "DeepSpeedConfig": "dsrun.runtime.ds_config:DeepSpeedConfig",
    # DeepSpeed's is None until initialize() sets it to deepspeed.comm;
    # dsrun's is deepspeed.comm (dsrun.comm) from the start
    "dist": "dsrun:comm",
}
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500  # DeepSpeed's (and torch's) default master port

__all__ = ["DSRUN_VERSION", "TORCH_DISTRIBUTED_DEFAULT_PORT", "__version__", *_LAZY]


# dsrun.zero.Init, dsrun.pipe.PipelineModule, dsrun.comm.get_rank, ... as deepspeed.*
# (deepspeed.runtime.<module>.X: dsrun.runtime loads its submodules the same way)
_SUBMODULES = ("zero", "pipe", "comm", "checkpointing", "accelerator", "ops", "utils",
               "profiling", "runtime", "monitor", "moe", "constants")

_alias.install()  # "from deepspeed.pipe import ..." after "import dsrun as deepspeed"


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"dsrun.{name}")
    target = _LAZY.get(name)
    if target is None:
        raise module_getattr_error("dsrun", name)  # init_inference & co: what to do instead
    module_name, attr = target.split(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
