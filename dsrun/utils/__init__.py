"""``dsrun.utils``: what DeepSpeed scripts use as ``deepspeed.utils``.

* :mod:`.logging` - ``logger`` (dsrun's runtime logger) and ``log_dist``
  (and in the module: ``print_json_dist``, ``LoggerFactory``,
  ``set_log_level_from_string``, ``get_current_level``, ``should_log_le``);
* :mod:`.init_on_device` - ``OnDevice`` (build modules on a device, in a dtype);
* :mod:`.nvtx` - ``instrument_w_nvtx`` (an NVTX range per call on CUDA);
* :mod:`.zero_to_fp32` - ``get_fp32_state_dict_from_zero_checkpoint``,
  ``convert_zero_checkpoint_to_fp32_state_dict``,
  ``load_state_dict_from_zero_checkpoint`` and
  ``python -m dsrun.utils.zero_to_fp32`` over dsrun checkpoints;
* :mod:`.tensor_fragment` - ``safe_get_full_fp32_param``,
  ``safe_get_full_grad``, ``safe_get_full_optimizer_state``, their setters
  and the ``*_local_*`` (stage 3) variants; DeepSpeed's parameter methods
  as functions of the parameter (``get_full_hp_param(p)``,
  ``set_full_hp_param``, ``get_full_hp_grad``, ``set_full_hp_grad``);
* :mod:`.z3_leaf_module` - ``set_z3_leaf_modules`` and the other ZeRO-3
  leaf-module helpers (``unset_z3_leaf_modules``, ``get_z3_leaf_modules``,
  ``z3_leaf_module``, ``z3_leaf_parameter``, ``set_z3_leaf_module``,
  ``set_z3_leaf_modules_by_name``, ``set_z3_leaf_modules_by_suffix``);
* ``RepeatingLoader`` (from :mod:`dsrun.runtime.dataloader`).

``import dsrun.utils`` imports neither torch nor the submodules; the names
above load their module on first use (PEP 562), so ``python -m
dsrun.utils.zero_to_fp32`` runs its module once.
"""

from __future__ import annotations

import importlib
from typing import Any

from dsrun._absent import module_getattr_error
from dsrun.utils.logging import get_dist_msg, log_dist, log_dist_once, logger

_LAZY = {name: "dsrun.utils.tensor_fragment" for name in (
    "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
    "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
    "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
    "get_full_hp_param", "set_full_hp_param", "get_full_hp_grad", "set_full_hp_grad")}
_LAZY.update({name: "dsrun.utils.zero_to_fp32" for name in (
    "get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict", "load_state_dict_from_zero_checkpoint")})
_LAZY.update({name: "dsrun.utils.z3_leaf_module" for name in (
    "set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
    "z3_leaf_parameter", "set_z3_leaf_module", "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix")})
_LAZY["RepeatingLoader"] = "dsrun.runtime.dataloader"
_LAZY["OnDevice"] = "dsrun.utils.init_on_device"
_LAZY["instrument_w_nvtx"] = "dsrun.utils.nvtx"
_SUBMODULES = ("logging", "tensor_fragment", "zero_to_fp32", "init_on_device", "nvtx",
               "comms_logging")

__all__ = ["get_dist_msg", "log_dist", "log_dist_once", "logger", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"dsrun.utils.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise module_getattr_error("dsrun.utils", name)  # groups: what to do instead
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
