"""``deepspeed.moe.utils``'s parameter-group helpers (dsrun.moe.utils):
DeepSpeed 0.19.8's result for models without expert parameters, and an
error naming the parameter where one is (dsrun has no expert parallelism)."""

from __future__ import annotations

import pytest
import torch

from dsrun.errors import DsrunError
from dsrun.moe.utils import (
    is_moe_param,
    is_moe_param_group,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)


def params() -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    return torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3, 4))


def test_one_group_dict_comes_back_as_a_list_holding_that_dict() -> None:
    # cifar10_deepspeed.py's create_moe_param_groups without --moe
    a, b = params()
    group = {"params": [a, b], "name": "parameters", "lr": 0.1}
    out = split_params_into_different_moe_groups_for_optimizer(group)
    assert out == [group] and out[0] is group
    assert out[0]["params"] == [a, b] and sorted(out[0]) == ["lr", "name", "params"]
    torch.optim.SGD(out, lr=0.1)  # still what an optimizer takes


def test_a_list_is_returned_itself_a_tuple_as_a_list_each_params_a_new_list() -> None:
    a, b = params()
    groups = [{"params": [a]}, {"params": (b,), "weight_decay": 0.0}]
    assert split_params_into_different_moe_groups_for_optimizer(groups) is groups
    assert groups[1]["params"] == [b] and isinstance(groups[1]["params"], list)
    as_tuple = split_params_into_different_moe_groups_for_optimizer(tuple(groups))
    assert isinstance(as_tuple, list) and as_tuple[0] is groups[0]
    with pytest.raises(ValueError, match="Unknown param group type of <class 'set'>"):
        split_params_into_different_moe_groups_for_optimizer({a})  # type: ignore[arg-type]


def test_an_expert_parameter_is_an_error_naming_it() -> None:
    a, b = params()
    b.allreduce = False  # what DeepSpeed's MoE layer sets on its experts
    b.group_name = "ep_size_2"
    with pytest.raises(DsrunError) as err:
        split_params_into_different_moe_groups_for_optimizer(
            [{"params": [a]}, {"params": [a, b], "name": "experts"}])
    text = str(err.value)
    assert "parameter 1 (shape (3, 4), expert group 'ep_size_2') of param group 1 ('experts')" \
        in text
    assert "expert parallelism" in text


def test_is_moe_param_is_deepspeeds_test() -> None:
    a, b = params()
    assert not is_moe_param(a)
    b.allreduce = True
    assert not is_moe_param(b)
    b.allreduce = False
    assert is_moe_param(b)
    assert split_params_into_shared_and_expert_params([a, b]) == ([a], [b])
    assert is_moe_param_group({"moe": True}) and not is_moe_param_group({"params": []})
