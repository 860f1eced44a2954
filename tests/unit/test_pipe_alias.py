"""``import dsrun as deepspeed`` then ``from deepspeed.pipe import ...`` (dsrun._alias)."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsrun


def _drop_deepspeed() -> dict[str, object]:
    names = [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]
    return {n: sys.modules.pop(n) for n in names}


@pytest.fixture(autouse=True)
def no_deepspeed_modules() -> Iterator[None]:
    """Each test imports ``deepspeed`` afresh; what it imported is dropped after."""
    saved = _drop_deepspeed()
    try:
        yield
    finally:
        _drop_deepspeed()
        sys.modules.update(saved)  # type: ignore[arg-type]


def test_deepspeed_names_are_dsrun_modules() -> None:
    pipe = importlib.import_module("deepspeed.pipe")
    import dsrun.pipe
    import dsrun.zero

    assert pipe is dsrun.pipe and sys.modules["deepspeed"] is dsrun
    assert pipe.__spec__.name == "dsrun.pipe"  # the real module, not relabelled
    from deepspeed.pipe import LayerSpec, PipelineModule  # type: ignore[import-not-found]
    from deepspeed.zero import Init  # type: ignore[import-not-found]

    assert (PipelineModule, LayerSpec, Init) == (dsrun.pipe.PipelineModule,
                                                  dsrun.pipe.LayerSpec, dsrun.zero.Init)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("deepspeed.no_such_module")


def test_the_alias_has_deepspeeds_metadata_for_hugging_face(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """transformers' and accelerate's is_deepspeed_available(): find_spec, then metadata."""
    from packaging.version import Version

    assert importlib.util.find_spec("deepspeed") is not None
    version = importlib.metadata.version("deepspeed")
    assert version == f"0.19.8+dsrun.{dsrun.DSRUN_VERSION}" and Version(version) >= Version("0.9.3")
    # the attribute scripts gate on says the same (TRL, Megatron-DeepSpeed compare it)
    import deepspeed

    assert deepspeed.__version__ == version
    assert (deepspeed.__version_major__, deepspeed.__version_minor__,
            deepspeed.__version_patch__) == (0, 19, 8)
    assert importlib.metadata.version("dsrun") == dsrun.DSRUN_VERSION  # pyproject's
    assert importlib.metadata.metadata("DeepSpeed")["Name"] == "deepspeed"  # normalised name
    assert "deepspeed" in {d.metadata["Name"] for d in importlib.metadata.distributions()}
    # a listing of named directories (pip's) does not see it; the switch turns it off
    assert not list(importlib.metadata.distributions(name="deepspeed", path=[str(tmp_path)]))
    monkeypatch.setenv("DSRUN_DEEPSPEED_METADATA", "0")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("deepspeed")


def test_a_real_deepspeed_is_left_alone(monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("REAL = True\n")
    (tmp_path / "deepspeed" / "pipe.py").write_text("REAL_PIPE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    real = importlib.import_module("deepspeed")
    assert real is not dsrun and real.REAL
    assert importlib.import_module("deepspeed.pipe").REAL_PIPE
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("deepspeed")  # the real package's own metadata only


def test_deepspeeds_top_level_names() -> None:
    """What ``deepspeed.<name>`` scripts use, after ``import dsrun as deepspeed``."""
    import dsrun.accelerator
    import dsrun.pipe
    import dsrun.utils
    from dsrun.runtime.pipe.engine import PipelineEngine

    assert dsrun.PipelineModule is dsrun.pipe.PipelineModule
    assert dsrun.PipelineEngine is PipelineEngine
    assert dsrun.get_accelerator is dsrun.accelerator.get_accelerator
    assert dsrun.log_dist is dsrun.utils.log_dist and dsrun.logger is dsrun.utils.logger
    assert dsrun.TORCH_DISTRIBUTED_DEFAULT_PORT == 29500
    for name in ("comm", "checkpointing", "accelerator", "ops", "utils", "zero", "pipe"):
        assert getattr(dsrun, name) is sys.modules[f"dsrun.{name}"]
        assert name in dir(dsrun)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        dsrun.no_such_name  # noqa: B018


def test_deepspeed_runtime_module_paths() -> None:
    """Deeper DeepSpeed import paths scripts use: the same objects as dsrun's."""
    import dsrun.runtime.engine
    import dsrun.zero
    from dsrun.runtime.pipe.engine import PipelineEngine

    ns: dict[str, object] = {}
    exec("from deepspeed.runtime.engine import DeepSpeedEngine\n"
         "from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, "
         "GatheredParameters\n"
         "from deepspeed.runtime.pipe.engine import PipelineEngine\n"
         "from deepspeed.runtime.pipe.module import PipelineModule, LayerSpec\n"
         "from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology\n"
         "from deepspeed.runtime.utils import see_memory_usage\n"
         "from deepspeed.runtime.lr_schedules import WarmupLR\n"
         "from deepspeed.profiling.flops_profiler import get_model_profile\n"
         "from deepspeed.runtime.activation_checkpointing import checkpointing\n"
         "import deepspeed.runtime.activation_checkpointing.checkpointing as ac\n", ns)
    assert ns["DeepSpeedEngine"] is dsrun.runtime.engine.DsrunEngine
    assert ns["ZeroParamStatus"] is dsrun.zero.ZeroParamStatus
    assert ns["GatheredParameters"] is dsrun.zero.GatheredParameters
    assert ns["PipelineEngine"] is PipelineEngine and ns["LayerSpec"] is dsrun.pipe.LayerSpec
    assert sys.modules["deepspeed.runtime.zero.partition_parameters"] is dsrun.zero
    assert ns["checkpointing"] is dsrun.checkpointing and ns["ac"] is dsrun.checkpointing


def test_see_memory_usage(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from dsrun.runtime.utils import see_memory_usage

    with caplog.at_level(logging.INFO, logger="dsrun.runtime"):
        see_memory_usage("quiet")  # DeepSpeed's: nothing without force
        assert caplog.text == ""
        see_memory_usage("after the model", force=True)
    (record,) = caplog.records
    assert record.getMessage().startswith("after the model | memory: host RSS ")


def test_deepspeeds_pipeline_module_paths() -> None:
    """Names Megatron-DeepSpeed-style code imports from DeepSpeed's pipeline
    modules: dsrun's classes under DeepSpeed's paths."""
    from deepspeed.runtime.pipe import (  # type: ignore[import-not-found]
        engine,
        module,
        schedule,
        topology,
    )

    import dsrun.runtime.pipe.grid
    import dsrun.runtime.pipe.schedule as sc
    from dsrun.errors import DsrunError

    assert topology.PipelineParallelGrid is dsrun.runtime.pipe.grid.PipelineGrid
    assert schedule is sc
    for name in ("TrainSchedule", "InferenceSchedule", "PipeSchedule", "PipeInstruction",
                 "ForwardPass", "BackwardPass", "LoadMicroBatch", "OptimizerStep"):
        assert isinstance(getattr(schedule, name), type), name
    assert engine.PipelineError is module.PipelineError
    assert issubclass(engine.PipelineError, DsrunError)
    assert engine.is_even(4) and not engine.is_even(3)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchGrid'"):
        topology.NoSuchGrid  # noqa: B018


def test_what_hugging_face_imports_from_deepspeed() -> None:
    """Accelerate's _prepare_deepspeed / get_state_dict and `accelerate launch`."""
    import torch

    from dsrun.runtime.lr_schedules import SCHEDULERS

    ns: dict[str, object] = {}
    exec("from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES\n"
         "from deepspeed.checkpoint.utils import clone_tensors_for_torch_save\n"
         "from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME\n", ns)
    assert ns["VALID_LR_SCHEDULES"] == list(SCHEDULERS) and "WarmupDecayLR" in SCHEDULERS
    assert ns["DEEPSPEED_ENVIRONMENT_NAME"] == ".deepspeed_env"
    clone = ns["clone_tensors_for_torch_save"]
    flat = torch.arange(10.0)
    state = {"a": [flat[:2], (flat[2:4],)], "n": 3}
    copied = clone(state)  # type: ignore[operator]
    assert copied["n"] == 3 and torch.equal(copied["a"][1][0], flat[2:4])
    assert copied["a"][0].untyped_storage().nbytes() == 2 * 4  # its own storage, not the view's
    assert copied["a"][0].data_ptr() != flat.data_ptr()
