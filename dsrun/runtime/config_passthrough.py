"""DeepSpeed config keys dsrun does not implement, checked before they are
accepted or refused.

* Keys DeepSpeed 0.19.8 has removed (``_REMOVED_TOP_LEVEL_CONFIG_KEYS`` and
  ``_REMOVED_ZERO_CONFIG_KEYS`` of its ``runtime/config.py``): refused
  whatever their value (``"enabled": false`` too), with DeepSpeed's reason,
  as DeepSpeed refuses them (:func:`refuse_removed`); only the flags
  ``sparse_gradients`` and ``graph_harvesting`` may be false, as dsrun's
  own ``DsrunConfig.to_dict()`` writes them.
* The passthrough sections (:data:`~dsrun.runtime.config_load.PASSTHROUGH_KEYS`)
  dsrun keeps verbatim: a JSON object where DeepSpeed reads one (it fails
  on anything else), and, where DeepSpeed's model of the section forbids
  other keys (pydantic ``extra="forbid"``), an unknown key with a
  did-you-mean (:func:`check_section`).
* DeepSpeed's Ulysses/ALST sizes ``sequence_parallel_size`` and
  ``data_parallel_size``: 1 (and a ``data_parallel_size`` equal to the
  data-parallel size) is accepted as the no-op it is in DeepSpeed; a
  sequence-parallel size > 1 is refused by name
  (:func:`check_parallel_sizes`, :func:`check_data_parallel_size`).

Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config_schema import Check, Ctx, check_value, show

if TYPE_CHECKING:
    from dsrun.runtime.config import DsrunConfig

_ISSUE = "https://github.com/deepspeedai/DeepSpeed/issues/8489"

#: DeepSpeed 0.19.8's removed top-level keys and its reasons (verbatim)
REMOVED_KEYS: Mapping[str, str] = MappingProxyType({
    "nebula": "Nebula checkpointing has been removed. A leftover 'nebula' block would be "
              "ignored and checkpoints would silently fall back to local torch.save.",
    "compression_training": "The DeepSpeed compression library has been removed. A leftover "
                            "'compression_training' block would be ignored and the model "
                            "would train unquantized.",
    "amp": "NVIDIA Apex AMP integration has been removed. Use DeepSpeed 'fp16', 'bf16', or "
           "'torch_autocast' instead.",
    "quantize_training": "Mixture-of-Quantization (MoQ) / 'quantize_training' has been removed.",
    "sparse_gradients": "Sparse compression of dense torch.nn.Embedding gradients has been "
                        "removed. A leftover 'sparse_gradients' flag would be ignored and those "
                        "gradients would be reduced dense. Gradients from an embedding "
                        "constructed with sparse=True are still reduced sparsely and need no "
                        "config flag.",
    "eigenvalue": "Eigenvalue-based Mixture-of-Quantization (MoQ) has been removed; the "
                  "standalone 'eigenvalue' configuration block is no longer supported.",
    "sparse_attention": "DeepSpeed Sparse Attention has been removed; the 'sparse_attention' "
                        "configuration block is no longer supported.",
    "elasticity": "Elastic training has been removed; the 'elasticity' configuration block is "
                  "no longer supported. Set train_batch_size / train_micro_batch_size_per_gpu "
                  "/ gradient_accumulation_steps directly.",
    "graph_harvesting": "Graph harvesting has been removed; the 'graph_harvesting' "
                        "configuration option is no longer supported.",
    "curriculum_learning": "Legacy top-level 'curriculum_learning' has been removed. Use "
                           "'data_efficiency.data_sampling.curriculum_learning' instead.",
    "progressive_layer_drop": "Progressive Layer Dropping has been removed; the "
                              "'progressive_layer_drop' configuration block is no longer "
                              "supported.",
})
#: DeepSpeed 0.19.8's removed ``zero_optimization`` keys and its reasons
REMOVED_ZERO_KEYS: Mapping[str, str] = MappingProxyType({
    "mics_shard_size": "MiCS ZeRO-3 sharding has been removed; "
                       "'zero_optimization.mics_shard_size' is no longer supported.",
    "mics_hierarchical_params_gather": "MiCS ZeRO-3 sharding has been removed; "
                                       "'zero_optimization.mics_hierarchical_params_gather' is "
                                       "no longer supported.",
    "zeropp_loco_param": "LoCo-Zero++ has been removed; 'zero_optimization.zeropp_loco_param' "
                         "is no longer supported. Remove this key to use standard ZeRO++ "
                         "quantized gradients without LoCo error feedback.",
})


def _removed(where: str, reason: str, value: Any) -> DsrunConfigError:
    return DsrunConfigError(f"{where}: {reason} DeepSpeed 0.19.8 refuses this key whatever its "
                            f"value ({show(value)} here), and so does dsrun: remove it. See "
                            f"{_ISSUE}.")


# Removed flags that DsrunConfig still has (false) and so writes in to_dict()
# (a checkpoint's ds_config, dump_state): false is taken there, so that such
# a dict resolves again; DeepSpeed 0.19.8 refuses false too
_FALSE_TAKEN = frozenset({"sparse_gradients", "graph_harvesting"})


def refuse_removed(raw: Mapping[str, Any], ctx: Ctx) -> None:
    """Raise for the first key of :data:`REMOVED_KEYS` in ``raw`` (or of
    :data:`REMOVED_ZERO_KEYS` in its ``zero_optimization``); for
    ``sparse_gradients`` and ``graph_harvesting``, any value but false."""
    for key, value in raw.items():
        if key in REMOVED_KEYS and not (key in _FALSE_TAKEN and value is False):
            raise _removed(ctx.where((key,)), REMOVED_KEYS[key], value)
    zero = raw.get("zero_optimization")
    if isinstance(zero, Mapping):
        for key, value in zero.items():
            if key in REMOVED_ZERO_KEYS:
                raise _removed(ctx.where(("zero_optimization", key)), REMOVED_ZERO_KEYS[key],
                               value)


# ------------------------------------------------------ passthrough shapes

#: sections DeepSpeed reads as a JSON object (anything else fails there with
#: an AttributeError or TypeError), and the other values it takes as "off"
_MAPPING_SECTIONS: Mapping[str, tuple[Any, ...]] = MappingProxyType({
    "aio": (None,), "autotuning": (), "compile": (), "data_efficiency": (),
    "expert_parallel": (None, False), "hybrid_engine": (), "tensor_parallel": (),
    "weight_quantization": ()})

#: the keys of the sections whose DeepSpeed model forbids any other
#: (DeepSpeedConfigModel: CompileConfig, HybridEngineConfig,
#: TPTrainingConfig with its aliases, WeightQuantConfig)
SECTION_KEYS: Mapping[str, frozenset[str]] = MappingProxyType({
    "compile": frozenset({
        "deepcompile", "autoep_non_moe", "free_activation", "free_activation_threshold",
        "offload_activation", "offload_activation_pin_memory", "offload_opt_states",
        "double_buffer", "symmetric_memory", "debug_log", "offload_parameters",
        "sync_before_reduce", "sync_after_reduce", "sync_before_allgather",
        "sync_after_allgather", "keep_int_input_tensors", "keep_all_input_tensors", "passes"}),
    "hybrid_engine": frozenset({
        "enabled", "max_out_tokens", "inference_tp_size", "release_inference_cache",
        "pin_parameters", "tp_gather_partition_size", "enable_cuda_graph"}),
    "tensor_parallel": frozenset({
        "dtype", "autotp_size", "tp_overlap_comm", "vocab_parallel_lm_head",
        "vocab_parallel_ce_backend", "tensor_parallel", "tp", "injection_policy_tuple",
        "partition_config", "preset_model", "keep_module_on_host", "replace_with_kernel_inject",
        "kernel_inject"}),
    "weight_quantization": frozenset({
        "enabled", "num_bits", "q_type", "q_groups", "quantized_initialization",
        "post_init_quant"}),
})


def check_section(key: str, value: Any, ctx: Ctx) -> Any:
    """Passthrough section ``key`` checked for its shape (module docstring):
    ``value``, less the unknown keys ``ctx`` lets through with a warning."""
    if key not in _MAPPING_SECTIONS:
        return value
    if not isinstance(value, Mapping):
        if any(value is off for off in _MAPPING_SECTIONS[key]):
            return value
        offs = "".join(f" or {show(off)}" for off in _MAPPING_SECTIONS[key])
        raise DsrunConfigError(f"{ctx.where((key,))} must be a JSON object{offs}, got "
                               f"{show(value)} (DeepSpeed 0.19.8 fails on it too)")
    valid = SECTION_KEYS.get(key)
    if valid is None:
        return value
    for name in value:
        if name not in valid:
            ctx.unknown(str(name), (key,), valid)
    kept = {k: v for k, v in value.items() if k in valid}
    if key == "tensor_parallel" and "autotp_size" in kept:
        kept["autotp_size"] = check_value(kept["autotp_size"], Check("int", low=0),
                                          ctx.where((key, "autotp_size")))
    return kept


# ------------------------------------------------- Ulysses / ALST sizes

PARALLEL_SIZE_KEYS = ("sequence_parallel_size", "data_parallel_size")


def check_parallel_sizes(known: Mapping[str, Any], ctx: Ctx) -> None:
    """``sequence_parallel_size``/``data_parallel_size`` (DeepSpeed's
    Ulysses/ALST mesh): positive integers, and a sequence-parallel size of
    1 (DeepSpeed's no-op); more is refused by name."""
    for key in PARALLEL_SIZE_KEYS:
        if key in known:
            check_value(known[key], Check("int", low=1), ctx.where((key,)))
    size = known.get("sequence_parallel_size", 1)
    if size != 1:
        raise DsrunConfigError(
            f"{ctx.where(('sequence_parallel_size',))} is {show(size)}: sequence parallelism "
            "(DeepSpeed's Ulysses / ALST) is not implemented in dsrun, which would train "
            "without it; remove the key or set it to 1 (a no-op, as in DeepSpeed)")


def check_data_parallel_size(config: DsrunConfig) -> None:
    """A ``data_parallel_size`` that is not the data-parallel size the engine
    gets: DeepSpeed builds its (data, sequence)-parallel mesh from it (with
    ``sequence_parallel_size``), which dsrun does not; the same size is the
    plain data parallelism dsrun does."""
    size = config.passthrough.get("data_parallel_size")
    if size is not None and int(size) != config.dp_size:
        raise DsrunConfigError(
            f'"data_parallel_size" in {config.source} is {size}, but the data-parallel size is '
            f"{config.dp_size} ({config.dp_size_source}): DeepSpeed's data/sequence-parallel "
            "mesh (Ulysses sequence parallelism) is not implemented in dsrun; remove the key "
            f"or set it to {config.dp_size}")
