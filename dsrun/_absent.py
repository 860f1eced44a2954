"""DeepSpeed names dsrun does not have, and what to use instead.

``deepspeed.init_inference``, ``deepspeed.utils.groups``,
``deepspeed.moe.layer``, ... read as attributes of dsrun's packages (after
``import dsrun as deepspeed``) raise :class:`DeepSpeedFeatureMissing`: an
``AttributeError`` - so ``hasattr(deepspeed, "init_inference")`` and
``getattr(deepspeed, name, None)``, the probes Hugging Face and Lightning
make, still answer False and None - whose message names the DeepSpeed
feature, says what to do instead and points at the README section "What
DeepSpeed has and dsrun does not". Names not listed here get Python's
usual message. :func:`module_getattr_error` is what the packages'
``__getattr__`` raise. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

_README = '(README: "What DeepSpeed has and dsrun does not")'
_NO_INFERENCE = ("DeepSpeed's inference engine is not in dsrun: call the model itself "
                 "(model.eval() under torch.no_grad()), or engine.module of an engine from "
                 "deepspeed.initialize()")
_NO_MOE = ("dsrun has no mixture-of-experts layers or expert parallelism: build the experts "
           "as ordinary modules (replicated on every rank, trained as dense parameters), or "
           "train the model with DeepSpeed")
_NO_TP = ("DeepSpeed's AutoTP (automatic tensor parallelism, the \"tensor_parallel\" section) "
          "is not implemented in dsrun: train with data parallelism and ZeRO, or with your own "
          "tensor-parallel layers and a Megatron-style mpu= passed to deepspeed.initialize()")
_NO_SP = ("sequence parallelism (DeepSpeed's Ulysses / ALST) is not implemented in dsrun: "
          "train without it (data parallelism and ZeRO)")
_REMOVED = "DeepSpeed 0.19.8 has removed it too"

#: "package.attribute" (dsrun's package, as DeepSpeed names it) -> what to say
ABSENT: Mapping[str, str] = MappingProxyType({
    "deepspeed.init_inference": _NO_INFERENCE,
    "deepspeed.inference": _NO_INFERENCE,
    "deepspeed.InferenceEngine": _NO_INFERENCE,
    "deepspeed.module_inject": "kernel injection and AutoTP layers are not in dsrun; "
                               + _NO_TP,
    "deepspeed.tp_model_init": _NO_TP,
    "deepspeed.sequence": _NO_SP,
    "deepspeed.linear": "DeepSpeed's OptimizedLinear and LoRAConfig are not in dsrun: use "
                        "torch.nn.Linear (and PEFT for LoRA adapters)",
    "deepspeed.compression": "DeepSpeed's compression library is not in dsrun (" + _REMOVED
                             + " in its config, 'compression_training')",
    "deepspeed.elasticity": "elastic training is not in dsrun (" + _REMOVED + "): set "
                            "train_batch_size / train_micro_batch_size_per_gpu / "
                            "gradient_accumulation_steps directly",
    "deepspeed.autotuning": "DeepSpeed's autotuner is not in dsrun: set the batch sizes and "
                            "ZeRO options in the config yourself",
    "deepspeed.utils.groups": "DeepSpeed's expert- and sequence-parallel process groups are "
                              "not in dsrun, which has neither expert nor sequence "
                              "parallelism (train without MoE layers: a script's --moe off); "
                              "the data-parallel group is engine.dp_group",
    "deepspeed.moe.layer": "DeepSpeed's MoE layer: " + _NO_MOE,
    "deepspeed.moe.experts": "DeepSpeed's MoE experts: " + _NO_MOE,
    "deepspeed.moe.sharded_moe": "DeepSpeed's MoE gating: " + _NO_MOE,
    "deepspeed.ops.transformer": "DeepSpeed's fused transformer kernels "
                                 "(DeepSpeedTransformerLayer) are not in dsrun: use a torch "
                                 "transformer layer (Hugging Face's, or torch.nn's)",
    "deepspeed.ops.sparse_attention": "DeepSpeed's sparse attention is not in dsrun ("
                                      + _REMOVED + ")",
    "deepspeed.ops.aio": "DeepSpeed's NVMe I/O ops are not in dsrun, which has no NVMe offload "
                         "(offload to \"cpu\" instead)",
    "deepspeed.ops.gds": "DeepSpeed's GPUDirect Storage ops are not in dsrun, which has no "
                         "NVMe offload (offload to \"cpu\" instead)",
})


class DeepSpeedFeatureMissing(AttributeError):
    """A DeepSpeed name dsrun does not have (an ``AttributeError``, so
    ``hasattr`` probes answer False)."""


def module_getattr_error(package: str, name: str) -> AttributeError:
    """What ``package.__getattr__(name)`` raises for a name it does not have:
    :class:`DeepSpeedFeatureMissing` saying what to do instead for a
    DeepSpeed feature of :data:`ABSENT`, else Python's plain message.
    ``package`` is dsrun's module name (``dsrun.utils``)."""
    deepspeed_name = "deepspeed" + package[len("dsrun"):] + "." + name
    reason = ABSENT.get(deepspeed_name)
    if reason is None:
        return AttributeError(f"module {package!r} has no attribute {name!r}", name=name)
    return DeepSpeedFeatureMissing(f"{deepspeed_name}: {reason} {_README}", name=name)
