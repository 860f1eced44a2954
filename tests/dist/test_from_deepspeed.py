"""Imported DeepSpeed checkpoints continue on DeepSpeed's own loss curve in dsrun.

Each fixture of tests/data/deepspeed_ckpt (DeepSpeed 0.19.8, saved by 2
ranks) is imported with ``dsrun checkpoint from-deepspeed``, then loaded by
dsrun engines - at 2 ranks at another ZeRO stage, and at 1 rank - which
train the 4 steps DeepSpeed trained after its own resume (make.py), on the
same global batches (resume_dsrun.py, the same model and config). The
losses are compared with the ones DeepSpeed recorded (oracle.json):

* fp32: within 1e-6 (seen: 1.2e-7, summation order);
* fp16: within 5e-4, half an fp16 ulp of a loss near 1. Both keep the fp16
  model's buffer ``scale`` in fp32 (DeepSpeed 0.19.8 casts parameters
  only), which promotes the output, so the MSE is in fp32 (seen: 0 at 2
  ranks, 9.7e-5 at 1 rank; 2.0e-4 when dsrun still halved the buffer);
* bf16: within 3e-3. DeepSpeed runs the model in bf16 weights and
  activations, dsrun in bf16 autocast (fp32 weights cast per matmul,
  LayerNorm and the loss in fp32): a few bf16 roundings of the activations
  (half an ulp is 2e-3 relative; seen: 7.5e-4).

An import that lost the Adam moments misses by 1e-2 to 7e-2 within these
4 steps (measured with ``load_optimizer_states=False``), so the tolerances
tell a correct import from a broken one. The fp16 loss scale must follow
DeepSpeed's exactly (it grows at the second step after the resume).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.from_deepspeed import import_deepspeed_checkpoint
from dsrun.runtime.checkpoint.from_deepspeed_files import load
from tests.conftest import dsrun_argv
from tests.data.deepspeed_ckpt import model as spec
from tests.dist.test_engine_dist import _run

pytestmark = pytest.mark.dist

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed_ckpt"
WORKER = DATA / "resume_dsrun.py"
ORACLE = json.loads((DATA / "oracle.json").read_text())
TOLERANCE = {"fp32": 1e-6, "fp16": 5e-4, "bf16": 3e-3}
# the stage each fixture is loaded at by 2 ranks (another one than it was saved at)
OTHER_STAGE = {"stage0_fp32": 3, "stage1_fp16": 2, "stage1_bf16": 3, "stage2_bf16": 1,
               "stage3_fp32": 2, "stage3_bf16": 0}
NAMES = sorted(spec.FIXTURES)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    imported = tmp_path_factory.mktemp("imported")
    for name in NAMES:
        import_deepspeed_checkpoint(str(DATA / name), str(imported / name))
    results: dict[str, dict[str, Any]] = {}
    for ranks, stages in ((2, OTHER_STAGE), (1, {n: spec.FIXTURES[n][0] for n in NAMES})):
        out = tmp_path_factory.mktemp(f"resumed{ranks}")
        argv = ["--out", str(out)]
        for name in NAMES:
            argv += ["--run", f"{name}:{stages[name]}:{imported / name}"]
        (rank0,) = _run(dsrun_argv("--cpu", "--num_gpus", str(ranks), str(WORKER), *argv), out)
        for key, facts in rank0.items():
            assert facts["ok"], f"{key} at {ranks} rank(s):\n{facts['error']}"
            results[f"{key.split('@')[0]}/{ranks}"] = facts
    return results


def assert_follows_deepspeed(name: str, facts: dict[str, Any]) -> None:
    oracle = ORACLE[name]
    tolerance = TOLERANCE[spec.FIXTURES[name][1]]
    assert facts["start"] == oracle["start"] == spec.SAVE_AFTER
    assert len(facts["losses"]) == len(oracle["losses"]) == spec.CONTINUE
    worst = max(abs(a - b) for a, b in zip(facts["losses"], oracle["losses"]))
    assert worst <= tolerance, (name, facts["losses"], oracle["losses"])
    assert facts["loss_scale"] == oracle["loss_scale"]


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_at_another_stage_follow_deepspeed(
        name: str, resumed: dict[str, dict[str, Any]]) -> None:
    assert_follows_deepspeed(name, resumed[f"{name}/2"])


@pytest.mark.parametrize("name", NAMES)
def test_one_rank_follows_deepspeed(name: str, resumed: dict[str, dict[str, Any]]) -> None:
    assert_follows_deepspeed(name, resumed[f"{name}/1"])


@pytest.mark.parametrize("name", NAMES)
def test_the_load_restores_counters_scaler_and_client_state(
        name: str, resumed: dict[str, dict[str, Any]]) -> None:
    for ranks in (1, 2):
        facts = resumed[f"{name}/{ranks}"]
        fp16 = spec.FIXTURES[name][1] == "fp16"
        assert facts["skipped"] == (1 if fp16 else 0)
        assert facts["samples"] == spec.SAVE_AFTER * spec.GLOBAL_BATCH
        assert facts["loaded_dp_world_size"] == spec.WORLD
        client = dict(facts["client"])
        # DeepSpeed's own keys: what its files hold, as its load_checkpoint returns them
        model_file = sorted((DATA / name / "global_step4").glob("*model_states.pt"))[0]
        saved = load(str(model_file))
        for key in ("buffer_names", "param_shapes", "frozen_param_shapes", "shared_params",
                    "checkpoint_parallel_dimensions", "ds_config", "ds_version"):
            assert client.pop(key) == json.loads(json.dumps(saved[key])), key
        assert client == {"epoch": 3, "note": "client state of make.py",
                          "best": [0.25, 0.5], "global_samples": facts["samples"]}
        if fp16:  # DeepSpeed's scaler after the overflow at step 1: one hysteresis unit spent
            assert facts["scaler"] == {"scale": 256.0, "iteration": 4,
                                       "last_overflow_iteration": 1, "hysteresis_left": 1,
                                       "overflows": 1}
            assert facts["lr"] == pytest.approx([0.01 * 2 / 3] * 2)  # the skipped step's lr
        else:
            assert facts["scaler"] is None


def test_loading_the_deepspeed_directory_names_the_import_command(solo: None,
                                                                  tmp_path: Path) -> None:
    import shutil

    import dsrun

    module = spec.build()
    engine, *_ = dsrun.initialize(model=module, model_parameters=spec.param_groups(module, 2),
                                  config=spec.config(2, "bf16", 1))
    ds_dir = DATA / "stage2_bf16"
    with pytest.raises(CheckpointError) as info:
        engine.load_checkpoint(str(ds_dir))
    assert f"`dsrun checkpoint from-deepspeed {ds_dir} OUT_DIR`" in str(info.value)
    other = Path(shutil.copytree(ds_dir, tmp_path / "ds"))
    (other / "latest").write_text("global_step8")  # a tag other than latest needs --tag
    with pytest.raises(CheckpointError) as info:
        engine.load_checkpoint(str(other), tag="global_step4")
    assert f"`dsrun checkpoint from-deepspeed {other} OUT_DIR --tag global_step4`" in \
        str(info.value)
    engine.destroy()
