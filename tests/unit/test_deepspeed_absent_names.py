"""DeepSpeed names dsrun does not have: attribute access names the DeepSpeed
feature and what to do instead (still an AttributeError, so ``hasattr``
probes answer False), and ``deepspeed.ops.op_builder``'s builder classes
import, are never compatible and refuse to load with the accelerator's
words. Pure: no process group."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from dsrun._absent import DeepSpeedFeatureMissing
from dsrun.errors import DsrunError

# (dsrun package, attribute, words of what to do instead)
ABSENT = [
    ("dsrun", "init_inference", "call the model itself"),
    ("dsrun", "tp_model_init", "AutoTP"),
    ("dsrun", "sequence", "Ulysses"),
    ("dsrun", "module_inject", "AutoTP"),
    ("dsrun", "linear", "OptimizedLinear"),
    ("dsrun", "inference", "call the model itself"),
    ("dsrun.utils", "groups", "engine.dp_group"),
    ("dsrun.moe", "layer", "build the experts as ordinary modules"),
    ("dsrun.ops", "transformer", "DeepSpeedTransformerLayer"),
]


@pytest.mark.parametrize("package, name, advice", ABSENT)
def test_absent_deepspeed_features_say_what_to_do(package: str, name: str, advice: str) -> None:
    module = importlib.import_module(package)
    with pytest.raises(AttributeError) as err:
        getattr(module, name)
    deepspeed_name = "deepspeed" + package[len("dsrun"):] + "." + name
    assert isinstance(err.value, DeepSpeedFeatureMissing)
    assert str(err.value).startswith(f"{deepspeed_name}: ") and advice in str(err.value)
    assert 'README: "What DeepSpeed has and dsrun does not"' in str(err.value)
    assert not hasattr(module, name) and getattr(module, name, None) is None


@pytest.mark.parametrize("package", ["dsrun", "dsrun.utils", "dsrun.moe", "dsrun.ops"])
def test_other_missing_names_keep_pythons_message(package: str) -> None:
    module, name = importlib.import_module(package), "no_such_name"
    with pytest.raises(AttributeError) as err:
        getattr(module, name)
    assert type(err.value) is AttributeError
    assert str(err.value) == f"module {package!r} has no attribute {name!r}"


BUILDERS = ["CPUAdamBuilder", "AsyncIOBuilder", "FusedAdamBuilder", "InferenceBuilder",
            "GDSBuilder", "UtilsBuilder"]


@pytest.mark.parametrize("name", BUILDERS)
def test_named_op_builders_import_and_refuse_to_load(name: str) -> None:
    op_builder = importlib.import_module("dsrun.ops.op_builder")
    cls = getattr(op_builder, name)
    assert cls is getattr(op_builder, name) and cls.__name__ == name
    builder = cls()
    assert builder.is_compatible() is False and builder.is_compatible(verbose=True) is False
    for load in (builder.load, builder.jit_load):
        with pytest.raises(DsrunError, match=f"op builder '{name}': dsrun does not build or load "
                                             "DeepSpeed's compiled ops"):
            load()


def test_builder_names_match_deepspeeds() -> None:
    from dsrun.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder, InferenceBuilder

    assert (CPUAdamBuilder.NAME, FusedAdamBuilder.NAME, InferenceBuilder.NAME) == \
        ("cpu_adam", "fused_adam", "transformer_inference")
    with pytest.raises(ImportError, match="cannot import name 'CPUAdamBulder'"):
        from dsrun.ops.op_builder import CPUAdamBulder  # noqa: F401


ALIASED = """
import dsrun as deepspeed
from deepspeed.ops.op_builder import CPUAdamBuilder, AsyncIOBuilder
assert not CPUAdamBuilder().is_compatible() and not AsyncIOBuilder().is_compatible()
assert not hasattr(deepspeed, "init_inference") and not hasattr(deepspeed.utils, "groups")
try:
    deepspeed.init_inference
except AttributeError as err:
    print(err)
"""


def test_through_the_deepspeed_alias() -> None:
    done = subprocess.run([sys.executable, "-c", ALIASED], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("deepspeed.init_inference: DeepSpeed's inference engine")

