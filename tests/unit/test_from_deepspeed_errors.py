"""The DeepSpeed importer's refusals: each unsupported, missing or corrupt
input is one error naming the file, and nothing is written.

Kinds told by file names are made by adding or removing files in a copy
of a fixture; kinds told by content (another DeepSpeed version, an
elastic checkpoint, optimizer state that is not per
element, stage-0 fp16) by changing what :func:`load` returns for a file,
since DeepSpeed's own classes in the optimizer files cannot be written
back without DeepSpeed. The command line exits 2 for an unsupported kind
and 1 for a missing or corrupt file.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from dsrun.errors import CheckpointError
from dsrun.launcher.checkpoint_cli import checkpoint as checkpoint_cli
from dsrun.runtime.checkpoint import from_deepspeed
from dsrun.runtime.checkpoint.from_deepspeed_files import UnsupportedCheckpoint
from dsrun.runtime.checkpoint.writer import RankWrite

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed_ckpt"
TAG = "global_step4"


def copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(DATA / name, tmp_path / name))


def run(ds_dir: Path, tmp_path: Path, *extra: str) -> Any:
    """The command line on ``ds_dir``; OUT_DIR must not appear unless it worked."""
    out = tmp_path / "imported"
    res = CliRunner().invoke(checkpoint_cli, ["from-deepspeed", str(ds_dir), str(out), *extra])
    if res.exit_code:
        assert not out.exists(), "a failed import left OUT_DIR behind"
    return res


def assert_refused(res: Any, code: int, *words: str) -> None:
    assert res.exit_code == code, res.output
    assert res.output.count("dsrun: error:") == 1, res.output
    for word in words:
        assert word in res.output, (word, res.output)


@pytest.mark.parametrize("name, file, what", [
    ("stage1_fp16", "layer_01-model_00-model_states.pt", "pipeline-parallel"),
    ("stage1_fp16", "mp_rank_01_model_states.pt", "tensor/model-parallel"),
    ("stage3_fp32", "zero_pp_rank_0_mp_rank_01_optim_states.pt", "tensor/model-parallel"),
    ("stage2_bf16", "layer_3_expert_0_mp_rank_00_model_states.pt", "mixture-of-experts"),
    ("stage2_bf16", "expp_rank_0_mp_rank_00_optim_states.pt", "mixture-of-experts"),
])
def test_kinds_told_by_their_files_exit_2(name: str, file: str, what: str,
                                          tmp_path: Path) -> None:
    root = copy(name, tmp_path)
    (root / TAG / file).write_bytes(b"")
    assert_refused(run(root, tmp_path), 2, str(root / TAG / file), what)


@pytest.mark.parametrize("folder, what", [("zero", "universal checkpoint"),
                                          ("offloaded_tensors", "NVMe-offloaded")])
def test_universal_and_offloaded_checkpoints_exit_2(folder: str, what: str,
                                                    tmp_path: Path) -> None:
    root = copy("stage2_bf16", tmp_path)
    (root / TAG / folder / "fc1.weight").mkdir(parents=True)
    assert_refused(run(root, tmp_path), 2, str(root / TAG / folder), what)


Edit = Callable[[dict[str, Any], str], None]


def edited(monkeypatch: pytest.MonkeyPatch, suffix: str, edit: Edit) -> None:
    """Files whose name ends in ``suffix`` are read with ``edit`` applied."""
    real = from_deepspeed.load

    def load(path: str) -> dict[str, Any]:
        data = real(path)
        if path.endswith(suffix):
            edit(data, path)
        return data

    monkeypatch.setattr(from_deepspeed, "load", load)


def _version(data: dict[str, Any], _: str) -> None:
    data["ds_version"] = "0.14.2"


def _not_zero(data: dict[str, Any], _: str) -> None:
    del data["optimizer_state_dict"]["zero_stage"]
    del data["optimizer_state_dict"]["single_partition_of_fp32_groups"]


def _elastic(data: dict[str, Any], _: str) -> None:
    osd = data["optimizer_state_dict"]
    osd["base_optimizer_state"] = list(osd["base_optimizer_state"]["state"].values())


def _factored(data: dict[str, Any], _: str) -> None:
    state = data["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
    state["exp_avg_sq"] = torch.zeros(2, 3)  # as Adafactor's row/column factors


def _stage0_fp16(data: dict[str, Any], _: str) -> None:
    data["optimizer"] = {"optimizer_state_dict": data["optimizer"], "fp32_groups_flat": [],
                         "cur_scale": 256.0}


def _stage0_two_groups(data: dict[str, Any], _: str) -> None:
    group = data["optimizer"]["param_groups"][0]
    data["optimizer"]["param_groups"] = [{**group, "params": group["params"][:4]},
                                         {**group, "params": group["params"][4:]}]


def _model_parallel(data: dict[str, Any], _: str) -> None:
    data["mp_world_size"] = 2


def _pipeline(data: dict[str, Any], _: str) -> None:
    data["checkpoint_parallel_dimensions"] = {"pp_degree": 2, "tp_degree": 1}


@pytest.mark.parametrize("name, suffix, edit, words", [
    ("stage2_bf16", "rank_1_mp_rank_00_optim_states.pt", _version,
     ["DeepSpeed 0.14.2", "0.19.x"]),
    ("stage3_fp32", "model_states.pt", _version, ["DeepSpeed 0.14.2"]),
    ("stage1_fp16", "rank_0_mp_rank_00_optim_states.pt", _elastic, ["elastic_checkpoint"]),
    ("stage1_fp16", "rank_0_mp_rank_00_optim_states.pt", _factored,
     ["'exp_avg_sq'", "not one value per element"]),
    ("stage0_fp32", "model_states.pt", _stage0_fp16, ["FP16_Optimizer"]),
    ("stage0_fp32", "model_states.pt", _stage0_two_groups, ["by position only", "2 param group"]),
    ("stage2_bf16", "model_states.pt", _model_parallel, ["tensor/model-parallel"]),
    ("stage2_bf16", "model_states.pt", _pipeline, ["pipeline-parallel"]),
])
def test_kinds_told_by_their_content_exit_2(name: str, suffix: str, edit: Edit,
                                            words: list[str], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    edited(monkeypatch, suffix, edit)
    res = run(DATA / name, tmp_path)
    file = next(p for p in sorted((DATA / name / TAG).iterdir()) if p.name.endswith(suffix))
    assert_refused(res, 2, *words)
    assert str(file) in res.output if name != "stage3_fp32" else "model_states.pt" in res.output


def test_an_optimizer_file_of_no_zero_kind_is_named(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    edited(monkeypatch, "rank_1_mp_rank_00_optim_states.pt", _not_zero)
    assert_refused(run(DATA / "stage1_fp16", tmp_path), 1,
                   str(DATA / "stage1_fp16" / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                   "not a DeepSpeed ZeRO optimizer-states file")


def test_the_python_api_raises_the_unsupported_error(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    edited(monkeypatch, "rank_0_mp_rank_00_optim_states.pt", _elastic)
    with pytest.raises(UnsupportedCheckpoint) as info:
        from_deepspeed.import_deepspeed_checkpoint(str(DATA / "stage1_fp16"),
                                                   str(tmp_path / "out"))
    assert isinstance(info.value, CheckpointError) and info.value.exit_code == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, file", [
    ("stage3_bf16", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ("stage3_fp32", "zero_pp_rank_0_mp_rank_00_model_states.pt"),
    ("stage2_bf16", "mp_rank_00_model_states.pt"),
    ("stage1_fp16", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
])
def test_a_missing_file_is_named(name: str, file: str, tmp_path: Path) -> None:
    root = copy(name, tmp_path)
    (root / TAG / file).unlink()
    assert_refused(run(root, tmp_path), 1, str(root / TAG / file), "missing")


def test_a_missing_last_rank_is_told_by_the_partition_count(tmp_path: Path) -> None:
    root = copy("stage1_fp16", tmp_path)
    (root / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert_refused(run(root, tmp_path), 1, "saved by 2 data-parallel ranks but 1 optimizer")


@pytest.mark.parametrize("file", ["zero_pp_rank_1_mp_rank_00_optim_states.pt",
                                  "mp_rank_00_model_states.pt"])
def test_a_corrupt_file_is_named(file: str, tmp_path: Path) -> None:
    root = copy("stage1_fp16", tmp_path)
    path = root / TAG / file
    path.write_bytes(path.read_bytes()[:1000])
    assert_refused(run(root, tmp_path), 1, f"{path} is corrupt")


def test_a_partition_of_the_wrong_size_is_named(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def shorter(data: dict[str, Any], _: str) -> None:
        groups = data["optimizer_state_dict"]["fp32_flat_groups"]
        groups[0] = groups[0][:-1]

    edited(monkeypatch, "rank_1_mp_rank_00_optim_states.pt", shorter)
    assert_refused(run(DATA / "stage3_fp32", tmp_path), 1, "zero_pp_rank_1_mp_rank_00_optim",
                   "sub-group 0 holds 215 elements")


def test_tags_latest_and_directories(tmp_path: Path) -> None:
    root = copy("stage3_fp32", tmp_path)
    assert_refused(run(root, tmp_path, "--tag", "global_step9"), 1, "no tag 'global_step9'",
                   "tags there: global_step4")
    assert_refused(run(root / TAG, tmp_path), 1, "is a DeepSpeed tag directory",
                   "--tag global_step4")
    (root / "latest").unlink()
    assert_refused(run(root, tmp_path), 1, "has no latest file")
    assert run(root, tmp_path, "--tag", TAG).exit_code == 0
    shutil.rmtree(tmp_path / "imported")
    assert_refused(run(tmp_path / "nowhere", tmp_path), 1, "does not exist")
    (tmp_path / "empty" / "t").mkdir(parents=True)
    assert_refused(run(tmp_path / "empty", tmp_path, "--tag", "t"), 1,
                   "is not a DeepSpeed checkpoint")


def test_a_failed_write_leaves_no_out_dir(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(self: RankWrite) -> None:
        Path(self.tmp_dir).mkdir(parents=True, exist_ok=True)  # as RankWrite: made by rank 0
        raise CheckpointError("no space left on the device (simulated)")

    monkeypatch.setattr(RankWrite, "run", full_disk)
    assert_refused(run(DATA / "stage2_bf16", tmp_path), 1, "no space left")
    existing = tmp_path / "kept"
    (existing / "other").mkdir(parents=True)
    with pytest.raises(CheckpointError):
        from_deepspeed.import_deepspeed_checkpoint(str(DATA / "stage2_bf16"), str(existing))
    assert sorted(p.name for p in existing.iterdir()) == ["other"]  # its own files stay


def test_a_file_lacking_a_key_of_its_kind_is_an_error_naming_the_tag(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def lacking(data: dict[str, Any], _: str) -> None:
        del data["optimizer_state_dict"]["single_partition_of_fp32_groups"]

    edited(monkeypatch, "rank_1_mp_rank_00_optim_states.pt", lacking)
    assert_refused(run(DATA / "stage2_bf16", tmp_path), 1, str(DATA / "stage2_bf16" / TAG),
                   "KeyError", "single_partition_of_fp32_groups")
