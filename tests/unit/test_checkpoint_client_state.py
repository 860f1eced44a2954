"""What a checkpoint's client state may be, and what ``load_checkpoint``
hands back with it (:mod:`dsrun.runtime.checkpoint.client_state`), over
hand-made manifests: DeepSpeed 0.19.8's keys, with its meaning and types."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

import pytest
import torch

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.client_state import (
    RETURNED_KEYS,
    client_state_problem,
    deepspeed_keys,
    returned_client_state,
)
from dsrun.runtime.checkpoint.manifest import Manifest, TensorEntry


def entry(name: str, shape: tuple[int, ...], kind: str = "param",
          group: Optional[int] = 0) -> TensorEntry:
    return TensorEntry(name, shape, "float32", kind, group, {})


def manifest(stage: int, excluded: bool = False, **meta: Any) -> Manifest:
    """A model of ``a`` (group 0), ``b`` (group 1), ``out.weight`` tied to
    ``a.weight``, a frozen ``f`` and a buffer ``buf``, as a save at ``stage``."""
    tensors = [entry("a.weight", (3, 4)), entry("b.bias", (2,), group=1), entry("a.bias", (3,)),
               entry("buf", (5,), "buffer", None)]
    if not excluded:
        tensors.append(entry("f", (2, 2), group=None))
    keys = ["a.weight", "a.bias", "b.bias", "out.weight", *([] if excluded else ["f"]), "buf"]
    return Manifest("t", 2, {e.name: e for e in tensors}, {},
                    {"zero_stage": stage, "dp_world_size": 2, "frozen": ["f"],
                     "excluded_frozen": ["f"] if excluded else [], "state_dict_keys": keys,
                     **meta},
                    {"out.weight": "a.weight"}, ({"lr": 1.0}, {"lr": 2.0}))


STATE = {"counters": {"global_steps": 3, "global_samples": 24, "skipped_steps": 1,
                      "micro_steps": 6},
         "client_state": {"epoch": 2}, "ds_config": {"train_batch_size": 8},
         "ds_version": "0.19.8+dsrun.0.1.0"}


@pytest.mark.parametrize("value, bad", [(None, False), ({}, False), ({"a": 1}, False),
                                        (OrderedDict(a=1), False), ([1, 2], True),
                                        ((("a", 1),), True), ("text", True), (3, True)])
def test_a_client_state_must_be_a_mapping(value: Any, bad: bool) -> None:
    problem = client_state_problem(value)
    assert (problem is not None) == bad
    if bad:
        assert problem is not None and f"got {type(value).__name__} " in problem
        assert "nothing was written" in problem


def test_secrets_in_a_saved_config_are_not_handed_back() -> None:
    """A checkpoint saved before dsrun redacted them still holds them."""
    config = {"train_batch_size": 8, "comet": {"enabled": True, "api_key": "SECRET123",
                                               "project": "p", "experiment_key": None},
              "x": [{"auth_token": "T0K"}]}
    got = returned_client_state({**STATE, "ds_config": config}, manifest(2), False, "ck/t")
    assert got["ds_config"] == {"train_batch_size": 8,
                                "comet": {"enabled": True, "api_key": "<redacted>",
                                          "project": "p", "experiment_key": None},
                                "x": [{"auth_token": "<redacted>"}]}
    assert config["comet"]["api_key"] == "SECRET123"  # not changed in place


def test_a_stage_2_save_hands_back_deepspeeds_keys() -> None:
    got = returned_client_state(STATE, manifest(2), False, "ck/t")
    # the order of DeepSpeed 0.19.8's dict, then the client's keys
    assert list(got) == ["buffer_names", "param_shapes", "frozen_param_shapes", "shared_params",
                         "global_samples", "checkpoint_parallel_dimensions", "ds_config",
                         "ds_version", "epoch"]
    assert got["buffer_names"] == ["buf"]
    shapes = got["param_shapes"]
    assert isinstance(shapes, list) and all(type(g) is OrderedDict for g in shapes)
    assert [list(g.items()) for g in shapes] == [
        [("a.weight", torch.Size([3, 4])), ("a.bias", torch.Size([3]))],
        [("b.bias", torch.Size([2]))]]
    assert all(type(s) is torch.Size for g in shapes for s in g.values())
    assert got["frozen_param_shapes"] == OrderedDict(f=torch.Size([2, 2]))
    assert got["shared_params"] == {"out.weight": "a.weight"}
    assert got["global_samples"] == 24 and got["epoch"] == 2
    assert got["checkpoint_parallel_dimensions"] == {"pp_degree": 1, "tp_degree": 1}
    assert got["ds_config"] == {"train_batch_size": 8}
    assert got["ds_version"] == "0.19.8+dsrun.0.1.0"
    assert set(got) - {"epoch"} <= set(RETURNED_KEYS)


def test_what_deepspeed_leaves_none_at_stages_0_and_1_and_without_frozen_values() -> None:
    stage0 = deepspeed_keys(STATE, manifest(0), False)
    assert stage0["param_shapes"] is None and stage0["shared_params"] is None
    assert stage0["frozen_param_shapes"] is None and stage0["buffer_names"] == ["buf"]
    stage1 = deepspeed_keys(STATE, manifest(1), False)
    assert stage1["frozen_param_shapes"] is None and stage1["shared_params"] is not None
    excluded = deepspeed_keys(STATE, manifest(3, excluded=True), False)
    assert excluded["frozen_param_shapes"] is None
    assert [list(g) for g in excluded["param_shapes"]] == [["a.weight", "a.bias"], ["b.bias"]]


def test_a_module_only_load_also_hands_back_the_counters_it_did_not_restore() -> None:
    got = deepspeed_keys(STATE, manifest(2), True)
    assert {k: got[k] for k in ("skipped_steps", "global_steps", "global_samples",
                                "dp_world_size", "mp_world_size")} == {
        "skipped_steps": 1, "global_steps": 3, "global_samples": 24, "dp_world_size": 2,
        "mp_world_size": 1}


def test_pipeline_stages_are_the_pp_degree_and_client_keys_win() -> None:
    state = {**STATE, "client_state": {"global_samples": "mine", "ds_version": "x"}}
    got = returned_client_state(state, manifest(1, pipeline={"stages": 4}), False, "ck/t")
    assert got["checkpoint_parallel_dimensions"] == {"pp_degree": 4, "tp_degree": 1}
    assert got["global_samples"] == "mine" and got["ds_version"] == "x"


def test_checkpoints_of_earlier_versions_lack_only_ds_config_and_version() -> None:
    old = manifest(2)
    meta = {k: v for k, v in old.meta.items() if k != "frozen"}  # before meta["frozen"]
    old = Manifest(old.tag, old.world_size, old.tensors, old.files, meta, old.aliases,
                   old.param_groups)
    state = {k: v for k, v in STATE.items() if not k.startswith("ds_")}
    got = returned_client_state(state, old, False, "ck/t")
    assert "ds_config" not in got and "ds_version" not in got
    assert got["frozen_param_shapes"] == OrderedDict(f=torch.Size([2, 2]))
    assert [list(g) for g in got["param_shapes"]] == [["a.weight", "a.bias"], ["b.bias"]]
    assert returned_client_state(None, old, False, "ck/t")["buffer_names"] == ["buf"]


@pytest.mark.parametrize("state, message", [
    ({**STATE, "client_state": [1, 2]}, "its client_state is a list [1, 2], not a dict"),
    ([1], "engine_state.pt holds a list, not a dict"),
    ({**STATE, "counters": {"global_steps": "3"}}, "counters are not whole numbers"),
])
def test_a_saved_state_that_cannot_be_installed_is_refused(state: Any, message: str) -> None:
    with pytest.raises(CheckpointError, match="checkpoint ck/t cannot be loaded: .*"
                       + message.replace("[", r"\[").replace("]", r"\]")):
        returned_client_state(state, manifest(2), False, "ck/t")
