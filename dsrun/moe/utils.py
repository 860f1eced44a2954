"""DeepSpeed's ``deepspeed.moe.utils`` parameter-group helpers, for models
without expert parameters.

An expert parameter is one DeepSpeed's ``MoE`` layer marked with
``allreduce = False`` (and ``group_name``, its expert data-parallel group).
dsrun has no expert parallelism, so such a parameter cannot be trained
here: :func:`split_params_into_different_moe_groups_for_optimizer` returns
the groups as DeepSpeed 0.19.8 does when there is none, and raises a
:class:`~dsrun.errors.DsrunError` naming the parameter when there is one
(rather than building groups that no engine of dsrun reduces correctly).
Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Union

from dsrun.errors import DsrunError

__all__ = ["is_moe_param", "is_moe_param_group",
           "split_params_into_different_moe_groups_for_optimizer",
           "split_params_into_shared_and_expert_params"]

ParamGroups = Union[dict[str, Any], tuple[dict[str, Any], ...], list[dict[str, Any]]]


def is_moe_param(param: Any) -> bool:
    """Whether ``param`` is an expert parameter (DeepSpeed's test: an
    ``allreduce`` attribute that is false)."""
    return hasattr(param, "allreduce") and not param.allreduce


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """Whether an optimizer param group is one of DeepSpeed's MoE groups."""
    return bool(param_group.get("moe", False))


def split_params_into_shared_and_expert_params(params: Any) -> tuple[list[Any], list[Any]]:
    """(shared parameters, expert parameters) of ``params``, in order."""
    shared: list[Any] = []
    expert: list[Any] = []
    for param in params:
        (expert if is_moe_param(param) else shared).append(param)
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: ParamGroups, max_group_size: Union[int, float] = 178956971
) -> list[dict[str, Any]]:
    """DeepSpeed's signature and result for parameters without experts: a
    list of the given group dicts (a dict is one group, a tuple becomes a
    list), each group's ``params`` made a list, no MoE group added.
    ``max_group_size`` only sizes MoE groups, so it is not used. An expert
    parameter is a :class:`DsrunError` naming it (module docstring)."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for index, group in enumerate(param_groups):
        params = list(group["params"])
        for position, param in enumerate(params):
            if is_moe_param(param):
                raise DsrunError(_expert_message(index, group, position, param))
        # a new list, as DeepSpeed's (whose first pass empties a generator:
        # here a generator's parameters are kept)
        group["params"] = params
    return param_groups


def _expert_message(index: int, group: dict[str, Any], position: int, param: Any) -> str:
    name = f" ({group['name']!r})" if "name" in group else ""
    shape = tuple(getattr(param, "shape", ()))
    expert_group = getattr(param, "group_name", None)
    return (f"split_params_into_different_moe_groups_for_optimizer: parameter {position} "
            f"(shape {shape}, expert group {expert_group!r}) of param group {index}{name} is "
            "an expert parameter (allreduce=False): dsrun has no mixture of experts or expert "
            "parallelism (DeepSpeed's deepspeed.moe); train the model without MoE layers, or "
            "with DeepSpeed")
