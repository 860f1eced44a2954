"""DeepSpeed's ``deepspeed.ops.op_builder`` path: dsrun builds no C++/CUDA
extensions (:mod:`.builder`).

``from deepspeed.ops.op_builder import CPUAdamBuilder`` (any builder
DeepSpeed 0.19.8 exports: tests, prebuild scripts and NVMe checks import
them at the top) gives a class with DeepSpeed's name and ``NAME``, made on
first use: ``CPUAdamBuilder().is_compatible()`` answers False, so feature
probes take their no-ops branch, and ``load()``/``jit_load()``/``builder()``
raise the :class:`~dsrun.errors.DsrunError` that
``get_accelerator().create_op_builder(...)`` raises (what to use instead).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, NoReturn

from dsrun.ops.op_builder.builder import OpBuilder

#: DeepSpeed 0.19.8's builder classes -> their NAME (the op they build)
BUILDER_NAMES = MappingProxyType({
    "AsyncIOBuilder": "async_io", "CCLCommBuilder": "deepspeed_ccl_comm",
    "CPUAdagradBuilder": "cpu_adagrad", "CPUAdamBuilder": "cpu_adam",
    "CPULionBuilder": "cpu_lion", "DeepCompileBuilder": "dc",
    "EvoformerAttnBuilder": "evoformer_attn", "FPQuantizerBuilder": "fp_quantizer",
    "FusedAdamBuilder": "fused_adam", "FusedLambBuilder": "fused_lamb",
    "FusedLionBuilder": "fused_lion", "GDSBuilder": "gds",
    "InferenceBuilder": "transformer_inference", "InferenceCoreBuilder": "inference_core_ops",
    "InferenceCutlassBuilder": "cutlass_ops", "NotImplementedBuilder": "deepspeed_not_implemented",
    "PinMemoryBuilder": "pin_memory", "QuantizerBuilder": "quantizer",
    "RaggedOpsBuilder": "ragged_device_ops", "RaggedUtilsBuilder": "ragged_ops",
    "RandomLTDBuilder": "random_ltd", "ShareMemCommBuilder": "deepspeed_shm_comm",
    "SpatialInferenceBuilder": "spatial_inference",
    "StochasticTransformerBuilder": "stochastic_transformer",
    "TransformerBuilder": "transformer", "UtilsBuilder": "utils",
})

__all__ = ["OpBuilder", *BUILDER_NAMES]


class AbsentOpBuilder(OpBuilder):
    """The base of the named builders: constructing one works (probes do),
    it is never compatible, and loading or building it is refused."""

    NAME = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # no OpBuilder refusal here
        self.name = self.NAME

    def is_compatible(self, verbose: bool = False) -> bool:
        return False

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}_op"

    def _refuse(self) -> NoReturn:
        # the same words as get_accelerator().create_op_builder(...)
        from dsrun.accelerator.abstract_accelerator import Accelerator

        raise Accelerator._no_ops(f"op builder {type(self).__name__!r}")

    def load(self, verbose: bool = True) -> NoReturn:
        self._refuse()

    def jit_load(self, verbose: bool = True) -> NoReturn:
        self._refuse()

    def builder(self) -> NoReturn:
        self._refuse()


def __getattr__(name: str) -> Any:
    if name not in BUILDER_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}", name=name)
    cls = type(name, (AbsentOpBuilder,), {
        "NAME": BUILDER_NAMES[name], "__module__": __name__,
        "__doc__": f"DeepSpeed's {name}: dsrun builds no compiled ops ({__name__})."})
    globals()[name] = cls  # one class per name, as an import gives
    return cls


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(BUILDER_NAMES))

