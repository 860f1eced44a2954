"""Import a DeepSpeed checkpoint: ``dsrun checkpoint from-deepspeed DS_DIR OUT_DIR``.

:func:`import_deepspeed_checkpoint` reads the checkpoint DeepSpeed's
``engine.save_checkpoint`` wrote (ZeRO stage 0-3, fp32/fp16/bf16, any
data-parallel size; :mod:`.from_deepspeed_files` finds and reads the
files, refusing the kinds it does not convert) and writes one tag of a
dsrun checkpoint, which ``engine.load_checkpoint(OUT_DIR)`` loads at any
world size and stage::

    inventory   DS_DIR/TAG's files; unsupported kinds refused by name
    read        every file (no DeepSpeed needed), version checked
    rebuild     whole parameters from the flat partitions
                (:mod:`.from_deepspeed_layout`): fp32 masters, Adam's
                moments and step; frozen parameters; buffers
    write       a dsrun save of one rank (:func:`~.writer.save_alone`):
                OUT_DIR/TAG.tmp/, then the rename and ``latest``

Nothing is written before everything was read and checked, and a failed
write removes what it wrote (``OUT_DIR`` too when it created it).

What a dsrun checkpoint holds and where it comes from here:

* every trained parameter's fp32 master and per-element optimizer state,
  its ``step`` and the param groups' hyperparameters (the inner optimizer's
  ``param_groups``); the optimizer's class name from the config's
  ``optimizer.type`` (else Adam/AdamW from the groups' keys);
* frozen parameters (``frozen_param_fragments``, or the module's state
  dict at stages 0-1) in the dtype DeepSpeed kept them, and rank 0's
  persistent buffers; tied names from ``shared_params`` and the ones it
  leaves out (:mod:`.from_deepspeed_aliases`); a stage-3 second name that
  no match places is left out with a warning and listed in the manifest's
  ``unplaced_aliases`` meta (a consolidated state dict then lacks it);
* ``engine_state.pt``: the LR scheduler's state dict, the counters
  (``global_steps``, ``global_samples``, ``skipped_steps``), fp16's loss
  scaler in dsrun's form (:func:`loss_scaler_state`) and ``client_state``:
  the model-states file's keys that are not DeepSpeed's own.

Not carried: RNG states and the dataloader position (DeepSpeed saves
neither; its curriculum ``data_sampler`` and ``random_ltd`` states are
dropped with a warning). A module's extra state (a non-tensor entry from
``get_extra_state()``) is refused, naming the entry: a dsrun checkpoint
holds tensors only.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

import dsrun
from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.fragments import ExportedState, Fragment, TensorInfo
from dsrun.runtime.checkpoint.from_deepspeed_aliases import module_aliases, unresolved
from dsrun.runtime.checkpoint.from_deepspeed_files import (
    Inventory,
    UnsupportedCheckpoint,
    check_version,
    enum_value,
    fields,
    inventory,
    load,
)
from dsrun.runtime.checkpoint.from_deepspeed_layout import (
    Param,
    RankGroups,
    stage0_params,
    unpartition,
    zero3_params,
    zero12_params,
)
from dsrun.runtime.checkpoint.manifest import TMP_SUFFIX
from dsrun.runtime.checkpoint.tags import check_tag
from dsrun.runtime.checkpoint.writer import SaveRequest, save_alone
from dsrun.runtime.config_schema import redact_secrets

log = logging.getLogger("dsrun.runtime.checkpoint")

__all__ = ["UnsupportedCheckpoint", "import_deepspeed_checkpoint", "read_deepspeed_checkpoint"]

# DeepSpeed's own keys of a model-states file; the others are the client's
DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "ds_config", "ds_version", "checkpoint_parallel_dimensions",
    "universal_checkpoint_info"})
MOE_KEYS = ("num_experts", "ds_autoep_layers", "autoep_layers")
PRECISIONS = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass
class DeepSpeedCheckpoint:
    """A DeepSpeed checkpoint read whole (module docstring)."""

    files: Inventory
    version: str
    stage: int
    precision: str
    dp_world_size: int
    params: list[Param]
    plain: dict[str, tuple[str, torch.Tensor]]      # name -> (kind, tensor): frozen, buffers
    groups: list[dict[str, Any]]
    optimizer: Optional[str]
    aliases: dict[str, str]
    keys: list[str]                                  # the module's state_dict() keys
    unplaced: list[str] = field(default_factory=list)  # second names no match resolved
    engine_state: dict[str, Any] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def frozen(self) -> list[str]:
        return sorted(n for n, (kind, _) in self.plain.items() if kind == "param")


def _check_model_file(data: Mapping[str, Any], path: str) -> None:
    for key in ("module", "buffer_names", "global_steps"):
        if key not in data:
            raise CheckpointError(f"{path} has no {key!r}: it is not a DeepSpeed model-states "
                                  "file")
    dims = data.get("checkpoint_parallel_dimensions") or {}
    if int(data.get("mp_world_size") or 1) > 1 or int(dims.get("tp_degree") or 1) > 1:
        raise UnsupportedCheckpoint(f"{path}: a tensor/model-parallel checkpoint (model-parallel "
                                    "size > 1), which dsrun does not import")
    if int(dims.get("pp_degree") or 1) > 1:
        raise UnsupportedCheckpoint(f"{path}: a pipeline-parallel checkpoint (pipeline degree "
                                    f"{dims['pp_degree']}), which dsrun does not import")
    if any(k in data for k in MOE_KEYS):
        raise UnsupportedCheckpoint(f"{path}: a mixture-of-experts checkpoint, which dsrun does "
                                    "not import")


def _optimizer_dict(data: Mapping[str, Any], path: str) -> dict[str, Any]:
    osd = data.get("optimizer_state_dict")
    if not isinstance(osd, Mapping):
        raise CheckpointError(f"{path} has no 'optimizer_state_dict': it is not a DeepSpeed "
                              "optimizer-states file")
    if "zero_stage" not in osd and not bf16_optimizer(osd):
        raise CheckpointError(f"{path} has no 'zero_stage': it is not a DeepSpeed ZeRO "
                              "optimizer-states file")
    return dict(osd)


def bf16_optimizer(osd: Mapping[str, Any]) -> bool:
    """Whether DeepSpeed's BF16_Optimizer wrote ``osd`` (bf16 at stage 1 with
    fp32 gradient accumulation): stage 1's keys without ``zero_stage``."""
    return "zero_stage" not in osd and "single_partition_of_fp32_groups" in osd \
        and "base_optimizer_state" in osd


def _partition_count(osd: Mapping[str, Any], files: int, path: str) -> int:
    counts = osd.get("partition_count")
    counts = list(counts) if isinstance(counts, (list, tuple)) else [counts]
    if any(int(c) != files for c in counts):
        raise CheckpointError(f"{path} was saved by {max(int(c) for c in counts)} data-parallel "
                              f"ranks but {files} optimizer-states files are there: the "
                              "checkpoint is incomplete or mixes two saves")
    return files


def _inner_groups(inner: Mapping[str, Any], path: str) -> list[dict[str, Any]]:
    groups = inner.get("param_groups")
    if not isinstance(groups, list) or "state" not in inner:
        raise CheckpointError(f"{path}: the inner optimizer's state dict has no param_groups")
    return groups


def _hyperparameters(groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in groups]


def _zero12(models: Sequence[dict[str, Any]], optims: Sequence[dict[str, Any]],
            files: Inventory) -> tuple[list[Param], list[dict[str, Any]]]:
    ranks = []
    for data, path in zip(optims, files.optim_files):
        osd = _optimizer_dict(data, path)
        base = osd.get("base_optimizer_state")
        if isinstance(base, list):
            raise UnsupportedCheckpoint(f"{path}: saved with zero_optimization.elastic_checkpoint"
                                        ", whose layout dsrun does not import")
        if not isinstance(base, Mapping):
            raise CheckpointError(f"{path} has no base_optimizer_state")
        groups = _inner_groups(base, path)
        states = []
        for g, group in enumerate(groups):
            if len(group["params"]) != 1:
                raise CheckpointError(f"{path}: param group {g} of the inner optimizer holds "
                                      f"{len(group['params'])} tensors, not one flat partition")
            states.append(base["state"].get(group["params"][0]))
        whole = bf16_optimizer(osd)  # partitions saved with their padding
        ranks.append(RankGroups(path, osd["single_partition_of_fp32_groups"], states,
                                () if whole else [int(p) for p in osd["group_paddings"]]))
    first = _optimizer_dict(optims[0], files.optim_files[0])
    shapes = models[0]["param_shapes"]
    if len(shapes) != len(ranks[0].flat):
        raise CheckpointError(f"{files.model_files[0]} lists {len(shapes)} param groups, "
                              f"{files.optim_files[0]} holds {len(ranks[0].flat)}")
    slack = 2 * len(ranks) if bf16_optimizer(first) else 1  # its groups' alignment
    params = zero12_params(shapes, ranks, first.get("param_alignment_paddings"), slack)
    return params, _hyperparameters(first["base_optimizer_state"]["param_groups"])


def _zero3(models: Sequence[dict[str, Any]], optims: Sequence[dict[str, Any]],
           files: Inventory) -> tuple[list[Param], list[dict[str, Any]]]:
    ranks, groups = [], []
    for data, path in zip(optims, files.optim_files):
        osd = _optimizer_dict(data, path)
        inner = osd.get("optimizer_state_dict")
        if not isinstance(inner, Mapping):
            raise CheckpointError(f"{path} has no inner optimizer state dict")
        groups = _inner_groups(inner, path)
        flat = osd["fp32_flat_groups"]
        ranks.append(RankGroups(path, flat, [inner["state"].get(sg) for sg in range(len(flat))]))
    group_of: dict[int, int] = {}
    for g, group in enumerate(groups):
        for index in group["params"]:
            group_of[int(index)] = g
    count = len(ranks[0].flat)
    shapes = models[0]["param_shapes"]
    if sorted(group_of) != list(range(count)) or len(shapes) != count:
        raise CheckpointError(f"{files.optim_files[0]}: its {count} flat sub-groups do not match "
                              f"the optimizer's param groups or the {len(shapes)} sub-groups of "
                              f"{files.model_files[0]}")
    params = zero3_params(shapes, ranks, [group_of[sg] for sg in range(count)])
    return params, _hyperparameters(groups)


def _stage0(model: Mapping[str, Any], path: str, aliases: Mapping[str, str]
            ) -> tuple[list[Param], list[dict[str, Any]]]:
    opt = model.get("optimizer")
    if opt is None:
        return [], []
    if not isinstance(opt, Mapping) or "fp32_groups_flat" in opt or "state" not in opt:
        raise UnsupportedCheckpoint(
            f"{path}: ZeRO stage 0 with fp16/bf16 (DeepSpeed's FP16_Optimizer over flat groups "
            "with no parameter names), which dsrun does not import; save from DeepSpeed at ZeRO "
            "stage 1 or higher, or in fp32")
    groups = _inner_groups(opt, path)
    buffers = set(model["buffer_names"])
    names = [k for k, v in model["module"].items()
             if k not in buffers and k not in aliases and isinstance(v, torch.Tensor)]
    if all("param_names" in g for g in groups):
        order = [list(g["param_names"]) for g in groups]
    elif len(groups) == 1 and len(groups[0]["params"]) == len(names):
        order = [names]  # every parameter, in the module's order
    else:
        raise UnsupportedCheckpoint(
            f"{path}: at ZeRO stage 0 DeepSpeed saves the optimizer's state by position only; "
            f"its {len(groups)} param group(s) hold {sum(len(g['params']) for g in groups)} of "
            f"the module's {len(names)} parameters, so which is which is unknown (dsrun imports "
            "stage 0 with one group of all parameters, or an optimizer built with named "
            "parameters)")
    return stage0_params(order, model["module"], opt, path), _hyperparameters(groups)


def _frozen(stage: int, models: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The frozen parameters DeepSpeed recorded, each whole (stage 3: its
    ranks' fragments joined)."""
    model = models[0]
    out = {}
    for name, shape in (model.get("frozen_param_shapes") or {}).items():
        numel = int(torch.Size(shape).numel())
        pieces = [m["frozen_param_fragments"][name] for m in models] if stage == 3 \
            else [model["frozen_param_fragments"][name]]
        out[name] = unpartition(pieces, numel).reshape(tuple(shape))
    return out


def _plain(stage: int, models: Sequence[dict[str, Any]], trained: set[str],
           aliases: Mapping[str, str], path: str
           ) -> tuple[dict[str, tuple[str, torch.Tensor]], list[str]]:
    """Frozen parameters and buffers, each whole, by name; and the stage-3
    second names no match placed (left out, with a warning)."""
    module = models[0]["module"]
    buffers = set(models[0]["buffer_names"])
    out = {name: ("param", value) for name, value in _frozen(stage, models).items()}
    unplaced = []
    for name in unresolved(module, trained | set(out), aliases):
        value = module[name]
        if not isinstance(value, torch.Tensor):
            raise UnsupportedCheckpoint(
                f"{path}: module entry {name!r} is a {type(value).__name__}, not a tensor: a "
                "module's extra state (get_extra_state(), e.g. TransformerEngine's fp8 "
                "metadata), which DeepSpeed's load_checkpoint hands to set_extra_state() but "
                "a dsrun checkpoint does not hold, so dsrun does not import it")
        if name in buffers:
            out[name] = ("buffer", value)
        elif stage != 3:
            out[name] = ("param", value)  # frozen, from the module (stages 0-2)
        elif value.numel() == 0:  # a second name no match resolved: the model's ties will
            unplaced.append(name)
        else:
            raise CheckpointError(
                f"{path}: module entry {name!r} ({value.numel()} elements) is in neither the "
                "flat groups, the frozen parameters nor buffer_names, and shares no storage "
                "with another entry: the checkpoint is damaged or not one dsrun imports")
    if unplaced:
        log.warning("%s: left out %s: second names of parameters that DeepSpeed's "
                    "shared_params does not name, whose first names are ambiguous (look-alike "
                    "modules). engine.load_checkpoint takes them from the model's own ties; a "
                    "state dict from to-fp32 or zero_to_fp32 lacks them (as DeepSpeed's "
                    "zero_to_fp32 output does): load it with model.load_state_dict(sd, "
                    "strict=False), which reports them as missing keys and leaves them to the "
                    "model's ties", path, ", ".join(map(repr, unplaced)))
    return out, unplaced


def loss_scaler_state(scaler: Any, skipped: int, global_steps: int) -> Optional[dict[str, Any]]:
    """DeepSpeed's fp16 loss scaler (its attributes) as dsrun's
    :class:`~dsrun.runtime.loss_scaler.LossScaler` state: the same rules,
    named ``scale``, ``iteration``, ``last_overflow_iteration``,
    ``hysteresis_left``; ``overflows`` counts the skipped steps."""
    attrs = fields(scaler)
    if "cur_scale" not in attrs:
        return None
    if not attrs.get("dynamic", True):  # static: only the scale matters
        return {"scale": float(attrs["cur_scale"]), "iteration": int(global_steps),
                "last_overflow_iteration": -1, "hysteresis_left": 1, "overflows": int(skipped)}
    return {"scale": float(attrs["cur_scale"]), "iteration": int(attrs["cur_iter"]),
            "last_overflow_iteration": int(attrs["last_overflow_iter"]),
            "hysteresis_left": int(attrs["cur_hysteresis"]), "overflows": int(skipped)}


def optimizer_name(config: Mapping[str, Any], groups: Sequence[Mapping[str, Any]]
                   ) -> Optional[str]:
    """The class dsrun builds for the config's ``optimizer`` section, else
    Adam/AdamW told by the groups' ``decoupled_weight_decay``; None when
    unknown (then any engine optimizer takes the state)."""
    section = config.get("optimizer") if isinstance(config, Mapping) else None
    if isinstance(section, Mapping) and section.get("type"):
        from dsrun.runtime.config_optim import OptimizerConfig
        from dsrun.runtime.optimizers import optimizer_class_and_kwargs

        try:
            cls, _ = optimizer_class_and_kwargs(OptimizerConfig(
                type=str(section["type"]), params=dict(section.get("params") or {})))
            return cls.__name__
        except Exception as exc:  # noqa: BLE001 - a DeepSpeed-only type: fall back
            log.info("optimizer type %r: %s", section.get("type"), exc)
    if groups and all("decoupled_weight_decay" in g for g in groups):
        return "AdamW" if groups[0]["decoupled_weight_decay"] else "Adam"
    return None


def _precision(model: Mapping[str, Any], buffers: set[str]) -> str:
    dtypes = [v.dtype for k, v in model["module"].items()
              if k not in buffers and isinstance(v, torch.Tensor) and v.is_floating_point()]
    return PRECISIONS.get(dtypes[0], "fp32") if dtypes else "fp32"


def _engine_state(model: Mapping[str, Any], precision: str, optims: Sequence[dict[str, Any]],
                  config: Mapping[str, Any]) -> dict[str, Any]:
    counters = {k: int(model.get(k) or 0) for k in ("global_steps", "global_samples",
                                                     "skipped_steps")}
    accumulation = config.get("gradient_accumulation_steps")
    if isinstance(accumulation, int):
        counters["micro_steps"] = counters["global_steps"] * accumulation
    scaler = None
    if precision == "fp16" and optims:
        osd = optims[0]["optimizer_state_dict"]
        scaler = loss_scaler_state(osd.get("loss_scaler"), counters["skipped_steps"],
                                   counters["global_steps"])
    for key in ("data_sampler", "random_ltd"):
        if model.get(key) is not None:
            log.warning("DeepSpeed's %s state is not carried over: dsrun has no such state", key)
    # DeepSpeed's own config and version come back from load_checkpoint as they
    # would from DeepSpeed's (.client_state)
    own = {k: model[k] for k in ("ds_config", "ds_version") if k in model}
    if "ds_config" in own:  # what dsrun writes holds no secrets, as its own saves
        own["ds_config"] = redact_secrets(own["ds_config"])
    return {"counters": counters, "lr_scheduler": model.get("lr_scheduler"),
            "loss_scaler": scaler,
            "client_state": {k: v for k, v in model.items() if k not in DEEPSPEED_KEYS}, **own}


def read_deepspeed_checkpoint(ds_dir: str, tag: Optional[str] = None) -> DeepSpeedCheckpoint:
    """Every file of ``ds_dir``'s tag (default: ``latest``), read, checked and
    rebuilt into whole tensors (module docstring); nothing is written."""
    files = inventory(ds_dir, tag)
    models = [load(p) for p in files.model_files]
    for data, path in zip(models, files.model_files):
        _check_model_file(data, path)
    version = check_version(models[0], files.model_files[0])
    optims = [load(p) for p in files.optim_files]
    for data, path in zip(optims, files.optim_files):
        check_version(data, path)
    try:
        return _rebuild(files, version, models, optims)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        raise CheckpointError(f"{files.path}: a DeepSpeed file lacks what its kind holds "
                              f"({type(exc).__name__}: {exc}): the checkpoint is damaged or "
                              "not one dsrun imports") from None


def _rebuild(files: Inventory, version: str, models: Sequence[dict[str, Any]],
             optims: Sequence[dict[str, Any]]) -> DeepSpeedCheckpoint:
    model, path = models[0], files.model_files[0]
    config = model.get("ds_config") if isinstance(model.get("ds_config"), Mapping) else {}
    module, buffers = model["module"], set(model["buffer_names"])
    if optims:
        osd = _optimizer_dict(optims[0], files.optim_files[0])
        stage = 1 if bf16_optimizer(osd) else int(enum_value(osd["zero_stage"]))
        if (stage == 3) != files.stage3:
            raise CheckpointError(f"{files.optim_files[0]} says ZeRO stage {stage} but the model "
                                  f"states are {os.path.basename(path)}'s kind: the tag mixes "
                                  "two saves")
        world = _partition_count(osd, len(optims), files.optim_files[0])
        params, groups = (_zero3 if stage == 3 else _zero12)(models, optims, files)
        held = {p.name for p in params} | set(model.get("frozen_param_shapes") or {})
        aliases = module_aliases(module, model.get("shared_params"), held, buffers, stage)
    elif model.get("param_shapes") is not None:
        missing = os.path.join(files.path, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        raise CheckpointError(f"{missing} is missing: a ZeRO checkpoint without its "
                              "optimizer-states files")
    else:
        stage, world = 0, int(model.get("dp_world_size") or 1)
        aliases = module_aliases(module, model.get("shared_params"), (), buffers, 0)
        params, groups = _stage0(model, path, aliases)
    plain, unplaced = _plain(stage, models, {p.name for p in params}, aliases, path)
    precision = _precision(model, buffers)
    return DeepSpeedCheckpoint(
        files, version, stage, precision, world, params, plain, groups,
        optimizer_name(config, groups), aliases, list(module), unplaced,
        _engine_state(model, precision, optims, config), config)


def _exports(ckpt: DeepSpeedCheckpoint, dtype: torch.dtype) -> ExportedState:
    tensors, fragments = {}, []
    for p in ckpt.params:
        tensors[p.name] = TensorInfo(p.name, p.shape, dtype, "param", p.group)
        if p.master.numel():
            fragments.append(Fragment(p.name, 0, p.master.numel(), p.master.contiguous(),
                                      {k: v.contiguous() for k, v in p.state.items()},
                                      dict(p.scalars)))
    for name, (kind, value) in ckpt.plain.items():
        tensors[name] = TensorInfo(name, tuple(value.shape), value.dtype, kind)
        if value.numel():
            fragments.append(Fragment(name, 0, value.numel(), value.reshape(-1).contiguous()))
    return ExportedState(tensors, tuple(fragments), tuple(ckpt.groups), ckpt.optimizer)


def _meta(ckpt: DeepSpeedCheckpoint) -> dict[str, Any]:
    counters = ckpt.engine_state["counters"]
    return {**counters, "zero_stage": ckpt.stage, "precision": ckpt.precision,
            "dp_world_size": ckpt.dp_world_size,
            "train_batch_size": ckpt.config.get("train_batch_size"),
            "gradient_accumulation_steps": ckpt.config.get("gradient_accumulation_steps"),
            "dsrun_version": dsrun.DSRUN_VERSION, "torch_version": torch.__version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "excluded_frozen": [], "frozen": ckpt.frozen, "state_dict_keys": ckpt.keys,
            "unplaced_aliases": ckpt.unplaced,
            "imported_from": {"format": "deepspeed", "deepspeed_version": ckpt.version,
                              "path": ckpt.files.path, "zero_stage": ckpt.stage}}


def import_deepspeed_checkpoint(ds_dir: str, out_dir: str, tag: Optional[str] = None) -> str:
    """``dsrun checkpoint from-deepspeed DS_DIR OUT_DIR [--tag T]`` (module
    docstring): returns the new tag's directory, ``OUT_DIR/TAG``."""
    ckpt = read_deepspeed_checkpoint(ds_dir, tag)
    check_tag(ckpt.files.tag)
    out_dir = os.path.abspath(out_dir)
    final = os.path.join(out_dir, ckpt.files.tag)
    if os.path.exists(final) or os.path.exists(final + TMP_SUFFIX):
        raise CheckpointError(f"{final} already exists: remove it or import into another "
                              "directory (nothing was written)")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"{out_dir} exists and is not a directory (nothing was written)")
    model_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(ckpt.precision,
                                                                       torch.float32)
    request = SaveRequest(out_dir, ckpt.files.tag, True, _meta(ckpt), ckpt.aliases,
                          ckpt.engine_state)
    created = not os.path.exists(out_dir)
    try:
        path = save_alone(request, [_exports(ckpt, model_dtype)])
    except BaseException:
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    log.debug("imported DeepSpeed %s checkpoint %s (ZeRO stage %d, %s, %d ranks) into %s",
             ckpt.version, ckpt.files.path, ckpt.stage, ckpt.precision, ckpt.dp_world_size, path)
    return path

