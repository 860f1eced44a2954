"""The pure parts of pipeline checkpoints (dsrun/runtime/pipe/checkpoint.py):
merging the stages' state-dict keys into the one-stage order, which stage
writes a shared name, and the param-group comparison."""

from __future__ import annotations

import torch

from dsrun.runtime.checkpoint.fragments import ExportedState, Fragment, TensorInfo
from dsrun.runtime.pipe.checkpoint import (
    _keep_fragments,
    group_difference,
    merge_state_dict_keys,
    writing_stages,
)


def test_merge_puts_module_level_keys_first_and_layers_in_order() -> None:
    stage0 = ["loss_fn.weight", "tied_modules.embed.weight", "0.w", "1.w", "1.b"]
    stage1 = ["loss_fn.weight", "tied_modules.embed.weight", "tied_modules.head.weight",
              "2.w", "3.w", "3.running_mean"]
    stage2 = ["loss_fn.weight", "tied_modules.head.weight", "4.w", "extra.scale"]
    assert merge_state_dict_keys([stage0, stage1, stage2]) == [
        "loss_fn.weight", "tied_modules.embed.weight", "tied_modules.head.weight",
        "0.w", "1.w", "1.b", "2.w", "3.w", "3.running_mean", "4.w", "extra.scale"]


def test_merge_of_one_stage_is_its_own_order() -> None:
    keys = ["tied_modules.e.weight", "0.weight", "10.weight", "2.weight", "extra"]
    assert merge_state_dict_keys([keys]) == keys


def test_merge_with_a_stage_without_layer_keys() -> None:
    """A stage of parameterless layers contributes only module-level keys."""
    assert merge_state_dict_keys([["0.w"], ["loss_fn.pos"], ["loss_fn.pos", "2.w"]]) == \
        ["loss_fn.pos", "0.w", "2.w"]


def test_a_shared_name_is_written_by_its_lowest_stage() -> None:
    owners = writing_stages([["t.w", "0.w"], ["t.w", "1.w", "u.w"], ["u.w", "t.w", "2.w"]])
    assert owners == {"t.w": 0, "0.w": 0, "1.w": 1, "u.w": 1, "2.w": 2}


def test_loss_fn_names_are_written_by_the_last_stage() -> None:
    """``loss_fn`` runs on the last stage only: its copy is the trained one."""
    owners = writing_stages([["loss_fn.v", "tied_modules.e.w", "0.w"],
                             ["loss_fn.v", "1.w"], ["loss_fn.v", "tied_modules.e.w", "2.w"]])
    assert owners == {"loss_fn.v": 2, "tied_modules.e.w": 0, "0.w": 0, "1.w": 1, "2.w": 2}


def test_group_difference() -> None:
    base = [{"lr": 0.01, "betas": [0.9, 0.999]}, {"lr": 0.01, "weight_decay": 0.0}]
    assert group_difference([base, [dict(g) for g in base]]) is None
    assert group_difference([None, base]) is None  # a stage without an optimizer
    other = [dict(base[0]), {"lr": 0.01, "weight_decay": 0.1}]
    assert group_difference([base, other]) == \
        "param group 1 has weight_decay=0.0 on stage 0 and weight_decay=0.1 on stage 1"
    assert group_difference([base, base, base[:1]]) == \
        "stage 0 has 2 param group(s), stage 2 has 1"
    missing = [dict(base[0]), {"lr": 0.01}]
    assert "weight_decay=0.0 on stage 0 and weight_decay=None on stage 1" in \
        group_difference([base, missing])


def test_keep_fragments_drops_data_but_keeps_declarations() -> None:
    infos = {n: TensorInfo(n, (4,), torch.float32) for n in ("a", "b")}
    frags = tuple(Fragment(n, 0, 4, torch.zeros(4), replicated=True) for n in ("a", "b"))
    export = ExportedState(infos, frags, replica=(1, 2))
    kept = _keep_fragments(export, {"a"})
    assert [f.name for f in kept.fragments] == ["b"]
    assert kept.tensors == infos and kept.replica == (1, 2)
