"""DeepSpeed checkpoints given where they do not belong, and kinds told by file names.

* DeepSpeed 0.19.8's pipeline checkpoints (``layer_NN-model_states.pt``;
  ``-model_NN`` only under tensor parallelism) are refused by
  ``from-deepspeed`` as pipeline-parallel (exit 2, naming the file) before
  anything else - not called damaged, nor tensor-parallel for their
  ``mp_rank_01`` files;
* ``info``, ``to-fp32`` and ``zero_to_fp32`` on a DeepSpeed tag directory,
  or on a save directory without ``latest``, name the ``from-deepspeed``
  command with its arguments; on a kind ``from-deepspeed`` refuses
  (pipeline, universal) they do not advise it;
* ``from-deepspeed`` on a dsrun checkpoint says it already is one;
* ``info`` of an import names the DeepSpeed version and ranks that saved it.

Layouts are made by adding files to copies of the DeepSpeed fixtures.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dsrun.launcher.checkpoint_cli import checkpoint as checkpoint_cli
from dsrun.runtime.checkpoint.from_deepspeed import import_deepspeed_checkpoint
from dsrun.utils.zero_to_fp32 import main as zero_to_fp32_main

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed_ckpt"
TAG = "global_step4"


def copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(DATA / name, tmp_path / name))


def cli(*argv: str) -> Any:
    return CliRunner().invoke(checkpoint_cli, [str(a) for a in argv])


def one_error(res: Any, code: int) -> str:
    assert res.exit_code == code, res.output
    assert res.output.count("dsrun: error:") == 1, res.output
    return res.output


def pipeline(tmp_path: Path, stages: int) -> Path:
    """A DeepSpeed pipeline save's names: layer files, mp_rank_NN per stage."""
    root = copy("stage1_fp16", tmp_path)
    for layer in range(3):
        (root / TAG / f"layer_{layer:02d}-model_states.pt").write_bytes(b"")
    for stage in range(1, stages):
        shutil.copy(root / TAG / "mp_rank_00_model_states.pt",
                    root / TAG / f"mp_rank_{stage:02d}_model_states.pt")
    return root


@pytest.mark.parametrize("stages", [1, 2])
def test_a_pipeline_checkpoint_is_refused_as_one(stages: int, tmp_path: Path) -> None:
    root = pipeline(tmp_path, stages)
    out = one_error(cli("from-deepspeed", root, tmp_path / "out"), 2)
    assert f"{root / TAG / 'layer_00-model_states.pt'}: a pipeline-parallel" in out
    assert "tensor/model-parallel" not in out
    assert not (tmp_path / "out").exists()


def universal(tmp_path: Path) -> Path:
    """A save directory whose latest names ds_to_universal's output."""
    root = copy("stage2_bf16", tmp_path)
    other = root / f"{TAG}_universal"
    (other / "zero" / "fc1.weight").mkdir(parents=True)
    shutil.copy(root / TAG / "mp_rank_00_model_states.pt", other)
    (root / "latest").write_text(f"{TAG}_universal")
    return root


@pytest.mark.parametrize("make, what", [(lambda p: pipeline(p, 2), "pipeline-parallel"),
                                        (universal, "universal checkpoint")])
@pytest.mark.parametrize("command", ["info", "to-fp32"])
def test_tools_do_not_advise_the_import_of_a_kind_it_refuses(make: Any, what: str, command: str,
                                                             tmp_path: Path) -> None:
    root = make(tmp_path)
    extra = [tmp_path / "w.bin"] if command == "to-fp32" else []
    out = one_error(cli(command, root, *extra), 1)
    assert what in out and "from-deepspeed` imports" in out
    assert "OUT_DIR" not in out
    assert one_error(cli("from-deepspeed", root, tmp_path / "out"), 2)


@pytest.mark.parametrize("command", ["info", "to-fp32", "zero_to_fp32"])
def test_a_tag_directory_or_a_save_directory_without_latest_names_the_import(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = copy("stage3_fp32", tmp_path)

    def error(path: Path, *tag: str) -> str:
        if command == "zero_to_fp32":
            flag = ["-t", *tag] if tag else []
            assert zero_to_fp32_main([str(path), str(tmp_path / "w"), *flag]) == 1
            return capsys.readouterr().err
        extra = [tmp_path / "w.bin"] if command == "to-fp32" else []
        return one_error(cli(command, path, *extra, *(["--tag", *tag] if tag else [])), 1)

    assert f"`dsrun checkpoint from-deepspeed {root} OUT_DIR`" in error(root / TAG)
    # --tag names another tag than latest's: the advice imports that one
    shutil.copytree(root / TAG, root / "global_step2")
    assert f"`dsrun checkpoint from-deepspeed {root} OUT_DIR --tag global_step2`" \
        in error(root, "global_step2")
    shutil.rmtree(root / "global_step2")
    (root / "latest").unlink()
    for path in (root / TAG, root):
        assert f"`dsrun checkpoint from-deepspeed {root} OUT_DIR --tag {TAG}`" in error(path)
    assert not (tmp_path / "w").exists() and not (tmp_path / "w.bin").exists()


def test_importing_a_dsrun_checkpoint_says_it_already_is_one(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    import_deepspeed_checkpoint(str(DATA / "stage2_bf16"), str(mine))
    for path in (mine, mine / TAG):
        out = one_error(cli("from-deepspeed", path, tmp_path / "out"), 1)
        assert "is already a dsrun checkpoint" in out and "nothing to import" in out
        assert not (tmp_path / "out").exists()


def test_info_of_an_import_says_who_saved_it(tmp_path: Path) -> None:
    import_deepspeed_checkpoint(str(DATA / "stage2_bf16"), str(tmp_path / "mine"))
    res = cli("info", tmp_path / "mine")
    assert res.exit_code == 0, res.output
    assert "from a DeepSpeed 0.19.8 checkpoint saved by 2 rank(s), ZeRO stage 2" in res.output
    assert "by 1 rank(s)" not in res.output  # the importer's own single writer


def test_a_directory_named_zero_alone_is_no_deepspeed_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "run" / "zero").mkdir(parents=True)
    out = one_error(cli("info", tmp_path / "run"), 1)
    assert "holds no dsrun checkpoint" in out and "DeepSpeed" not in out
