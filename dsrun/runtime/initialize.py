"""``dsrun.initialize()`` and ``dsrun.add_config_arguments()``: DeepSpeed's entry points.

``initialize`` reads like DeepSpeed's: it brings up the process group when
the script runs without the launcher (world size 1 under plain ``python``;
a no-op under ``dsrun``, whose bootstrap did it), picks the training config,
resolves it for the data-parallel size, logs it once (rank 0), builds the
:class:`~dsrun.runtime.engine.DsrunEngine` (a
:class:`~dsrun.runtime.pipe.engine.PipelineEngine` for a ``PipelineModule``,
whose topology gives the data-parallel size and group) and, given ``training_data``, a
sharded dataloader. It returns ``(engine, optimizer, dataloader,
lr_scheduler)``.

Where the config comes from (:func:`select_config`): ``config=`` (or its
older alias ``config_params=``), ``args.deepspeed_config`` /
``args.dsrun_config`` (``--deepspeed_config`` / ``--dsrun_config``, added by
:func:`add_config_arguments`; ``--deepscale_config`` is still read), and
the launcher's ``DSRUN_CONFIG`` (``dsrun --config``), which is used when the
script gives none. Several of them are fine only when they parse to the same
JSON; otherwise the error names the two that differ.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config import ConfigInput, DsrunConfig, load_config, resolve
from dsrun.runtime.config_agree import check_ranks_agree
from dsrun.runtime.config_passthrough import check_data_parallel_size
from dsrun.runtime.config_schema import redact_secrets  # also importable from here
from dsrun.runtime.dist import init_distributed
from dsrun.runtime.engine import DsrunEngine
from dsrun.runtime.engine_setup import check_expert_params, check_zero_stage
from dsrun.runtime.env import DistEnv
from dsrun.runtime.pipe import PipelineEngine, PipelineModule
from dsrun.runtime.pipe.errors import PipeAssertionError
from dsrun.runtime.progress import ensure_visible

log = logging.getLogger("dsrun.runtime")

# (args attribute, command-line flag), in order of precedence for messages
_ARG_CONFIGS = (("deepspeed_config", "--deepspeed_config"), ("dsrun_config", "--dsrun_config"),
                ("deepscale_config", "--deepscale_config"))
_OPTIMIZER_HINT_KEYS = ("lr", "betas", "eps", "weight_decay")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed``/``--deepspeed_config`` (and
    ``--dsrun_config``) to ``parser``; returns it, as DeepSpeed's does."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (a flag for user code; no effect on the runtime)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed JSON configuration file")
    group.add_argument("--dsrun_config", default=None, type=str,
                       help="Training configuration file (same format as --deepspeed_config)")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


@dataclass(frozen=True)
class ConfigChoice:
    """The config ``initialize`` uses and where it came from."""

    value: ConfigInput
    origin: str


def _parsed(value: Any) -> Any:
    raw, _ = load_config(value)
    try:
        return json.loads(json.dumps(raw))  # tuples vs lists, int vs float keys alike
    except (TypeError, ValueError):
        return raw


def select_config(config: Any = None, config_params: Any = None, args: Any = None,
                  launcher_config: Optional[str] = None) -> ConfigChoice:
    """The one training config among those given (module docstring)."""
    given: list[tuple[str, Any]] = []
    if config is not None:
        given.append(("config= passed to dsrun.initialize()", config))
    if config_params is not None:
        given.append(("config_params= passed to dsrun.initialize()", config_params))
    for attr, flag in _ARG_CONFIGS:
        value = getattr(args, attr, None) if args is not None else None
        if value is not None:
            given.append((f"{flag} {value} (args.{attr})", value))
    if launcher_config:
        given.append((f"DSRUN_CONFIG={launcher_config} (from dsrun --config)", launcher_config))
    if not given:
        raise DsrunConfigError(
            "no training config: pass config=<dict or JSON path> to dsrun.initialize(), "
            "--deepspeed_config PATH to the script (see dsrun.add_config_arguments), or "
            "--config PATH to dsrun")
    origin, first = given[0]
    reference = _parsed(first) if len(given) > 1 else None
    for other_origin, other in given[1:]:
        if other is not first and _parsed(other) != reference:
            raise DsrunConfigError(
                f"two different training configs: {origin} and {other_origin}; pass only one, "
                "or make them identical")
    return ConfigChoice(first, origin)


def _data_parallel(env: DistEnv, mpu: Any) -> tuple[int, str]:
    """(data-parallel size, where it came from) for config resolution."""
    if mpu is not None:
        size = mpu.get_data_parallel_world_size()
        return size, f"data-parallel world size {size} from {getattr(mpu, 'origin', 'the mpu')}"
    world = dist.get_world_size()
    if world == 1 and env.world_size == 1:
        return 1, "single process"
    if env.world_size == world and env.job_id:
        return world, f"WORLD_SIZE={world} from the dsrun launcher"
    if env.world_size == world:
        return world, f"WORLD_SIZE={world} from the {env.source} environment"
    return world, f"torch.distributed world size {world}"


def _optimizer_hints(optimizer: Any) -> dict[str, Any]:
    """lr/betas/eps/weight_decay of a client optimizer, for "auto" config values."""
    if not isinstance(optimizer, Optimizer) or not optimizer.param_groups:
        return {}
    group = optimizer.param_groups[0]
    return {k: float(group[k]) if k == "lr" else group[k]
            for k in _OPTIMIZER_HINT_KEYS if k in group}


def _check_loader_batch(loader_batch: Optional[int], micro: int) -> None:
    """Warn (rank 0, once per initialize) when the script's DataLoader,
    passed as ``training_data``, has another batch size than the config's
    micro batch: the engine counts the config's (``global_samples``, the
    samples the monitors log against and checkpoints record), as DeepSpeed
    counts it whatever batch the script feeds."""
    if loader_batch is None or loader_batch == micro or dist.get_rank() != 0:
        return
    log.warning("initialize(training_data=...): the DataLoader's batch_size is %d, but "
                "train_micro_batch_size_per_gpu is %d: the engine counts %d samples per "
                "micro-batch (global_samples, the monitors' sample counts, checkpoints). "
                "Give the DataLoader batch_size=%d, or set train_micro_batch_size_per_gpu to %d",
                loader_batch, micro, micro, micro, loader_batch)


def _log_start(config: DsrunConfig, origin: str, engine: DsrunEngine) -> None:
    if engine.global_rank != 0:
        return
    params = [p for p in engine.module.parameters()]
    trainable = sum(p.numel() for p in params if p.requires_grad)
    scope = f" in pipeline stage 0 of {engine.num_stages}" \
        if isinstance(engine, PipelineEngine) else ""
    lines = [f"engine: ZeRO stage {engine.zero_stage}, {engine.precision.name}, device "
             f"{engine.device}, {sum(p.numel() for p in params):,} parameters{scope} "
             f"({trainable:,} trainable)",
             f"config chosen: {origin}", *config.summary().splitlines()]
    if config.dump_state:  # DeepSpeed's "dump_state": every resolved setting
        shown = json.dumps(redact_secrets(config.to_dict()), indent=2, sort_keys=True,
                           default=str)
        lines += ["resolved config (dump_state):", *shown.splitlines()]
    log.info("\n  ".join(lines))


def initialize(args: Any = None, model: Optional[torch.nn.Module] = None,
               optimizer: Any = None, model_parameters: Optional[Iterable[Any]] = None,
               training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: Optional[int] = None, mpu: Any = None,
               dist_init_required: Optional[bool] = None,
               collate_fn: Optional[Callable[[list[Any]], Any]] = None,
               config: Any = None, mesh_param: Any = None, config_params: Any = None,
               ) -> tuple[DsrunEngine, Optional[Optimizer], Any, Any]:
    """DeepSpeed's ``initialize`` (same parameters, in the same order).

    ``training_data``: a Dataset gets a :class:`DsrunDataLoader` (sharded,
    micro-batch size, ``collate_fn``); a ready DataLoader is returned as is and
    its batch size fills an ``"auto"`` micro-batch size. ``distributed_port``
    is ignored (the launcher's MASTER_PORT, or none at world size 1, is used);
    ``dist_init_required=False`` is accepted, but a process group is still
    created when none exists. The optimizer returned is the torch optimizer
    (over fp32 master weights when fp16 is enabled). A model with DeepSpeed
    expert parameters (``allreduce = False``) is refused
    (:func:`~dsrun.runtime.engine_setup.check_expert_params`), as is a
    config ``data_parallel_size`` other than the data-parallel size.
    """
    if model is None:
        raise DsrunConfigError("dsrun.initialize() needs model=: the torch.nn.Module to train")
    if not isinstance(model, torch.nn.Module):
        raise DsrunConfigError(f"model= must be a torch.nn.Module, got {type(model).__name__}")
    if mesh_param is not None:
        raise DsrunConfigError("mesh_param (sequence/data-parallel meshes) is not supported by "
                               "dsrun yet; leave it unset")
    check_expert_params(model)
    ensure_visible()
    engine_cls: type[DsrunEngine] = DsrunEngine
    if isinstance(model, PipelineModule):
        if mpu is not None:
            raise PipeAssertionError("a PipelineModule brings its own topology (num_stages= or "
                                     "topology=): do not pass mpu= to dsrun.initialize()")
        engine_cls, mpu = PipelineEngine, model.grid
    env = DistEnv.detect()
    choice = select_config(config, config_params, args, env.config_path)
    if not dist.is_initialized():
        init_distributed(env=env)
    dp_size, dp_source = _data_parallel(env, mpu)
    hint = getattr(training_data, "batch_size", None) \
        if isinstance(training_data, torch.utils.data.DataLoader) else None
    resolved = resolve(choice.value, dp_size=dp_size, dp_source=dp_source,
                       micro_batch_hint=hint, optimizer_hints=_optimizer_hints(optimizer),
                       optimizer_given=optimizer is not None)
    check_zero_stage(resolved)
    _check_loader_batch(hint, resolved.train_micro_batch_size_per_gpu)
    check_data_parallel_size(resolved)
    check_ranks_agree(resolved)
    if model_parameters is not None:
        model_parameters = list(model_parameters)  # a generator is read once
    engine = engine_cls(model, resolved, optimizer=optimizer, lr_scheduler=lr_scheduler,
                         model_parameters=model_parameters, env=env, mpu=mpu)
    _log_start(resolved, choice.origin, engine)
    engine.training_data, engine.collate_fn = training_data, collate_fn  # DeepSpeed's attributes
    if isinstance(training_data, torch.utils.data.DataLoader):
        engine.training_dataloader = training_data  # the script's own, as it is
    elif training_data is not None:  # DeepSpeed's initialize goes through deepspeed_io too
        engine.training_dataloader = engine.deepspeed_io(training_data, collate_fn=collate_fn)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
