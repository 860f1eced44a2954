"""The DeepSpeed importer against DeepSpeed's own view of real checkpoints.

The fixtures (tests/data/deepspeed_ckpt, written by its make.py with
DeepSpeed 0.19.8 on 2 ranks) come with ``expected.pt``: what DeepSpeed
itself says each checkpoint holds - the fp32 masters from the live engine
(``safe_get_full_fp32_param``), the Adam moments from ``ds_to_universal``
(stage 0: the live torch optimizer), ``zero_to_fp32``'s consolidated state
dict, the loss scaler's attributes, the scheduler and the counters. The
import must reproduce every tensor bit for bit. No DeepSpeed is needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from dsrun.launcher.checkpoint_cli import checkpoint as checkpoint_cli
from dsrun.runtime.checkpoint.consolidate import get_fp32_state_dict
from dsrun.runtime.checkpoint.from_deepspeed import (
    import_deepspeed_checkpoint,
    read_deepspeed_checkpoint,
)
from tests.data.deepspeed_ckpt import model as spec

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed_ckpt"
NAMES = sorted(spec.FIXTURES)


def expected(name: str) -> dict[str, Any]:
    return torch.load(DATA / name / "expected.pt", weights_only=False)


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name in NAMES:
        root = tmp_path_factory.mktemp(name)
        import_deepspeed_checkpoint(str(DATA / name), str(root / "ckpt"))
        out[name] = root / "ckpt"
    return out


@pytest.mark.parametrize("name", NAMES)
def test_masters_moments_and_step_are_deepspeeds(name: str) -> None:
    ckpt = read_deepspeed_checkpoint(str(DATA / name))
    want = expected(name)
    trained = {n: e for n, e in want["params"].items() if "fp32" in e}
    params = {p.name: p for p in ckpt.params if p.state}
    assert sorted(params) == sorted(trained)
    for pname, entry in trained.items():
        p = params[pname]
        assert p.shape == tuple(entry["fp32"].shape)
        assert p.master.dtype == torch.float32
        assert torch.equal(p.master.view(p.shape), entry["fp32"]), pname
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(p.state[key].view(p.shape), entry[key]), (pname, key)
        step = entry.get("step", want["step"][0])
        assert float(p.scalars["step"]) == step
    assert ckpt.stage == spec.FIXTURES[name][0]
    assert ckpt.precision == spec.FIXTURES[name][1]
    assert ckpt.dp_world_size == spec.WORLD


@pytest.mark.parametrize("name", NAMES)
def test_frozen_parameter_buffer_and_groups(name: str) -> None:
    ckpt = read_deepspeed_checkpoint(str(DATA / name))
    want = expected(name)
    stage = spec.FIXTURES[name][0]
    value = ckpt.plain["offset"][1] if stage else \
        next(p.master for p in ckpt.params if p.name == "offset").view(16)
    assert torch.equal(value, want["params"]["offset"]["value"].to(value.dtype))
    assert value.dtype == want["params"]["offset"]["value"].dtype
    assert ckpt.plain["scale"][0] == "buffer"
    assert torch.equal(ckpt.plain["scale"][1], want["buffers"]["scale"])
    assert ckpt.frozen == ([] if stage == 0 else ["offset"])  # stage 0: in the optimizer
    assert len(ckpt.groups) == len(want["param_groups"])
    for mine, theirs in zip(ckpt.groups, want["param_groups"]):
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert mine[key] == theirs[key], key
    assert ckpt.optimizer == "AdamW"
    assert ckpt.keys[0] == "offset" and "scale" in ckpt.keys and len(ckpt.keys) == 10


@pytest.mark.parametrize("name", NAMES)
def test_engine_state_counters_scheduler_scaler_client(name: str) -> None:
    state = read_deepspeed_checkpoint(str(DATA / name)).engine_state
    want = expected(name)
    assert state["counters"] == {"global_steps": want["global_steps"],
                                 "global_samples": want["global_samples"],
                                 "skipped_steps": want["skipped_steps"],
                                 "micro_steps": want["global_steps"]}
    assert state["lr_scheduler"] == want["lr_scheduler"]
    client = state["client_state"]
    assert sorted(client) == sorted(want["client_state"])
    assert torch.equal(client["best"], want["client_state"]["best"])
    assert client["epoch"] == 3 and client["note"] == want["client_state"]["note"]
    if spec.FIXTURES[name][1] != "fp16":
        assert state["loss_scaler"] is None
        return
    ds = want["loss_scaler"]
    assert want["skipped_steps"] == 1 and ds["cur_hysteresis"] == 1  # the overflow step
    assert state["loss_scaler"] == {
        "scale": ds["cur_scale"], "iteration": ds["cur_iter"],
        "last_overflow_iteration": ds["last_overflow_iter"],
        "hysteresis_left": ds["cur_hysteresis"], "overflows": 1}


@pytest.mark.parametrize("name", NAMES)
def test_consolidated_weights_are_zero_to_fp32s(name: str, imported: dict[str, Path]) -> None:
    got = get_fp32_state_dict(str(imported[name]))
    want = expected(name)
    reference = want["zero_to_fp32"]
    if reference is None:  # stage 0, BF16_Optimizer: zero_to_fp32 refuses; the live engine's
        reference = {n: e.get("fp32", e.get("value")) for n, e in want["params"].items()}
        reference["scale"] = want["buffers"]["scale"]
    assert set(reference) <= set(got)
    assert set(got) == {"offset", "scale", *(n for n, e in want["params"].items())}
    for key, value in reference.items():
        assert got[key].dtype == torch.float32
        assert torch.equal(got[key], value.float()), key
    assert list(got) == read_deepspeed_checkpoint(str(DATA / name)).keys  # the module's order


@pytest.mark.parametrize("name", NAMES)
def test_the_import_is_a_dsrun_checkpoint_of_the_same_tag(name: str,
                                                          imported: dict[str, Path]) -> None:
    root = imported[name]
    assert (root / "latest").read_text() == "global_step4"
    manifest = json.loads((root / "global_step4" / "manifest.json").read_text())
    assert manifest["format"] == "dsrun-checkpoint" and manifest["world_size"] == 1
    assert manifest["optimizer"] == "AdamW"
    meta = manifest["meta"]
    stage, precision = spec.FIXTURES[name]
    assert (meta["zero_stage"], meta["precision"], meta["dp_world_size"]) == (stage, precision, 2)
    assert meta["imported_from"]["deepspeed_version"] == "0.19.8"
    assert meta["global_steps"] == 4
    entry = manifest["tensors"]["fc3.bias"]
    assert entry["shape"] == [3] and set(entry["items"]) == {"value", "exp_avg", "exp_avg_sq"}
    assert entry["scalars"]["step"]["value"] == (3.0 if precision == "fp16" else 4.0)
    assert not list(root.glob("*.tmp"))
    res = CliRunner().invoke(checkpoint_cli, ["info", str(root)])
    assert res.exit_code == 0, res.output
    assert f"ZeRO stage {stage}, {precision}" in res.output


def test_the_command_line_writes_the_same_checkpoint(tmp_path: Path,
                                                     imported: dict[str, Path]) -> None:
    res = CliRunner().invoke(checkpoint_cli, ["from-deepspeed", str(DATA / "stage2_bf16"),
                                              str(tmp_path / "out"), "--tag", "global_step4"])
    assert res.exit_code == 0, res.output
    assert f"wrote {tmp_path / 'out' / 'global_step4'}" in res.output
    mine = get_fp32_state_dict(str(tmp_path / "out"))
    theirs = get_fp32_state_dict(str(imported["stage2_bf16"]))
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_the_importer_is_exported_by_the_checkpoint_package() -> None:
    import dsrun.runtime.checkpoint as package

    assert package.import_deepspeed_checkpoint is import_deepspeed_checkpoint
    assert "import_deepspeed_checkpoint" in package.__all__


def test_a_tag_already_there_is_refused_and_kept(imported: dict[str, Path]) -> None:
    root = imported["stage3_fp32"]
    before = (root / "global_step4" / "manifest.json").read_bytes()
    res = CliRunner().invoke(checkpoint_cli, ["from-deepspeed", str(DATA / "stage3_fp32"),
                                              str(root)])
    assert res.exit_code == 1
    assert "global_step4 already exists" in res.output and "nothing was written" in res.output
    assert (root / "global_step4" / "manifest.json").read_bytes() == before


@pytest.mark.parametrize("command", [["info"], ["to-fp32"]])
def test_dsrun_tools_on_a_deepspeed_directory_name_the_import_command(
        command: list[str], tmp_path: Path) -> None:
    ds_dir = str(DATA / "stage1_fp16")
    argv = [*command, ds_dir] + ([str(tmp_path / "out.bin")] if command == ["to-fp32"] else [])
    res = CliRunner().invoke(checkpoint_cli, argv)
    assert res.exit_code == 1
    assert f"dsrun checkpoint from-deepspeed {ds_dir} OUT_DIR`" in res.output


# ----------------------------------------------------- synthetic layouts
# Layouts built here by DeepSpeed's rules (from_deepspeed_layout's docstring)
# with what the fixtures do not have: parameter alignment padding, padding
# on more than the last rank, three ranks, several sub-groups. Padding holds
# NaN, so any padding element taken for a parameter's fails the comparison.


def test_zero12_skips_alignment_padding_between_parameters() -> None:
    from dsrun.runtime.checkpoint.from_deepspeed_layout import RankGroups, zero12_params

    sizes, pads, world = {"a": 3, "b": 5, "c": 2}, [1, 3, 0], 3
    values = {n: torch.arange(k, dtype=torch.float32) + 10 * i
              for i, (n, k) in enumerate(sizes.items())}
    nan = torch.tensor([float("nan")])
    flat = torch.cat([torch.cat([values[n], nan.repeat(p)]) for n, p in zip(sizes, pads)])
    flat = torch.cat([flat, nan.repeat(-flat.numel() % (2 * world))])  # 14 -> 18
    part = flat.numel() // world
    ranks = []
    for r in range(world):
        piece = flat[r * part:(r + 1) * part]
        lean = piece[:max(0, min(part, 14 - r * part))]
        ranks.append(RankGroups(f"rank{r}", [lean], [{"exp_avg": piece * 2,
                                                      "step": torch.tensor(7.0)}],
                                [part - lean.numel()]))
    params = zero12_params([{n: (k,) for n, k in sizes.items()}], ranks, [pads])
    assert [p.name for p in params] == ["a", "b", "c"]
    for p in params:
        assert torch.equal(p.master, values[p.name])
        assert torch.equal(p.state["exp_avg"], values[p.name] * 2)
        assert float(p.scalars["step"]) == 7.0 and p.group == 0


def test_zero3_joins_each_parameters_slices_over_three_ranks_and_sub_groups() -> None:
    from dsrun.runtime.checkpoint.from_deepspeed_layout import RankGroups, zero3_params

    world = 3
    groups = [{"a": (5,), "b": (1,)}, {"c": (2, 2)}]  # two sub-groups, of param groups 1 and 0
    values = {n: torch.arange(int(torch.Size(s).numel()), dtype=torch.float32) + 100 * i
              for i, (n, s) in enumerate((n, s) for g in groups for n, s in g.items())}
    ranks = []
    for r in range(world):
        flat = []
        for group in groups:
            pieces = []
            for name in group:
                v = values[name]
                size = -(-v.numel() // world)
                padded = torch.cat([v, torch.full((size * world - v.numel(),), float("nan"))])
                pieces.append(padded[r * size:(r + 1) * size])
            flat.append(torch.cat(pieces))
        ranks.append(RankGroups(f"rank{r}", flat, [{"exp_avg": f + 1} for f in flat]))
    params = zero3_params(groups, ranks, [1, 0])
    assert [(p.name, p.group, p.shape) for p in params] == [("a", 1, (5,)), ("b", 1, (1,)),
                                                           ("c", 0, (2, 2))]
    for p in params:
        assert torch.equal(p.master, values[p.name])
        assert torch.equal(p.state["exp_avg"], values[p.name] + 1)


def test_deepspeeds_config_comes_over_without_its_secrets() -> None:
    """A DeepSpeed checkpoint's ds_config may hold a comet api_key: the
    imported engine state (what dsrun writes and a load returns) does not."""
    from dsrun.runtime.checkpoint.from_deepspeed import _engine_state

    model = {"global_steps": 2, "ds_version": "0.19.8",
             "ds_config": {"train_batch_size": 4, "comet": {"enabled": True,
                                                            "api_key": "sk-123"}}}
    state = _engine_state(model, "fp32", [], model["ds_config"])
    assert state["ds_config"] == {"train_batch_size": 4,
                                  "comet": {"enabled": True, "api_key": "<redacted>"}}
    assert model["ds_config"]["comet"]["api_key"] == "sk-123"  # the input is left alone
    assert state["ds_version"] == "0.19.8"
