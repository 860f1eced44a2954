"""DeepSpeed's ``optimizer`` and ``scheduler`` config sections: the names
dsrun builds (DeepSpeed's and torch's), the ones it refuses and why, what
``"auto"`` becomes, and each scheduler's parameters checked with a
did-you-mean. Nothing here imports torch (the launcher checks ``--config``
with it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Optional

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config_param_values import (
    check_optimizer_values,
    check_torch_scheduler_values,
)
from dsrun.runtime.config_schema import (
    DICT_SOURCE,
    STRICT,
    Check,
    Ctx,
    build,
    check_value,
    did_you_mean,
    freeze,
    is_auto,
    opt,
    pick,
    show,
    validate_fields,
)

# DeepSpeed's optimizer names (it lower-cases them) plus the torch.optim
# classes DeepSpeed reaches by name (``getattr(torch.optim, type)``); value:
# the name users see in messages (torch's spelling). Adafactor needs torch >=
# 2.5 (the optimizer builder says so); like Lamb it is not elementwise, so
# the ZeRO stages refuse it.
OPTIMIZER_NAMES: Mapping[str, str] = MappingProxyType({
    "adam": "Adam", "adamw": "AdamW", "lamb": "Lamb", "sgd": "SGD", "adagrad": "Adagrad",
    "rmsprop": "RMSprop", "adamax": "Adamax", "nadam": "NAdam", "radam": "RAdam",
    "adadelta": "Adadelta", "lion": "Lion", "asgd": "ASGD", "rprop": "Rprop",
    "adafactor": "Adafactor",
})
_ONE_BIT = ("a 1-bit (compressed-communication) optimizer that DeepSpeed has removed: "
            "DeepSpeed 0.19.8 refuses it too (not a supported DeepSpeed optimizer)")
# Names refused with the reason why (lower-case name -> reason).
REFUSED_OPTIMIZERS: Mapping[str, str] = MappingProxyType({
    "onebitadam": _ONE_BIT, "zerooneadam": _ONE_BIT, "onebitlamb": _ONE_BIT,
    "muon": "DeepSpeed's Muon (MuonWithAuxAdam: Newton-Schulz orthogonalisation of each "
            "whole weight matrix tagged use_muon, Adam for the rest) is not implemented in "
            "dsrun; at ZeRO stage 0 a torch.optim.Muon built in the script can be passed "
            "as optimizer= (over 2-D parameters)",
    "lbfgs": "torch's LBFGS re-evaluates the model through a closure that engine.step() "
             "does not have",
    "sparseadam": "torch's SparseAdam steps sparse gradients only: build it in the script "
                  "over the sparse=True embeddings and pass it as optimizer= (ZeRO stage 0)",
})
UNSUPPORTED_OPTIMIZERS = tuple(REFUSED_OPTIMIZERS)

_ADAM_AUTO = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
# What "auto" becomes when no client value is given: DeepSpeed's defaults
# (FusedAdam/FusedLamb: weight_decay 0.0, not torch AdamW's 0.01), else torch's.
AUTO_OPTIMIZER_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "adam": _ADAM_AUTO, "adamw": _ADAM_AUTO, "lamb": _ADAM_AUTO, "radam": _ADAM_AUTO,
    "adamax": {**_ADAM_AUTO, "lr": 2e-3}, "nadam": {**_ADAM_AUTO, "lr": 2e-3},
    "sgd": {"lr": 1e-3, "weight_decay": 0.0},
    "adagrad": {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0},
    "rmsprop": {"lr": 1e-2, "eps": 1e-8, "weight_decay": 0.0},
    "adadelta": {"lr": 1.0, "eps": 1e-6, "weight_decay": 0.0},
    "lion": {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0},
    "asgd": {"lr": 1e-2, "weight_decay": 0}, "rprop": {"lr": 1e-2},  # Rprop has no decay
    "adafactor": {"lr": 1e-2, "weight_decay": 0.0},
})

_WARMUP_TYPE = Check("str", choices=("log", "linear"))
_LAST = Check("int", low=-1)
_WARMUP = {"warmup_min_lr": Check("floats", low=0.0),
           "warmup_max_lr": Check("floats", low=0.0, optional=True),
           "warmup_num_steps": Check("int", low=1), "warmup_type": _WARMUP_TYPE,
           "last_batch_iteration": _LAST}
# DeepSpeed's scheduler constructor arguments (deepspeed/runtime/lr_schedules.py).
SCHEDULER_PARAMS: Mapping[str, Mapping[str, Check]] = MappingProxyType({
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {**_WARMUP, "total_num_steps": Check("int", low=1)},
    "WarmupCosineLR": {
        "total_num_steps": Check("int", low=1), "warmup_min_ratio": Check("float", 0.0, 1.0),
        "warmup_num_steps": Check("int", low=1), "cos_min_ratio": Check("float", 0.0, 1.0),
        "warmup_type": _WARMUP_TYPE, "last_batch_iteration": _LAST},
    "OneCycle": {  # lr and momentum bounds: one value, or one per param group
        "cycle_min_lr": Check("floats", low=0.0), "cycle_max_lr": Check("floats", low=0.0),
        "decay_lr_rate": Check("float", low=0.0),
        "cycle_first_step_size": Check("int", low=1),
        # 0: no second half - the lr climbs for the whole cycle, then drops
        "cycle_second_step_size": Check("int", low=0, optional=True),
        "cycle_first_stair_count": Check("int", low=0),
        "cycle_second_stair_count": Check("int", low=0, optional=True),
        "decay_step_size": Check("int", low=0), "cycle_momentum": Check("bool"),
        "cycle_min_mom": Check("floats", 0.0, 1.0), "cycle_max_mom": Check("floats", 0.0, 1.0),
        "decay_mom_rate": Check("float"), "last_batch_iteration": _LAST},
    "LRRangeTest": {
        "lr_range_test_min_lr": Check("floats", low=0.0),
        "lr_range_test_step_size": Check("int", low=1),
        "lr_range_test_step_rate": Check("float", low=0.0),
        "lr_range_test_staircase": Check("bool"), "last_batch_iteration": _LAST},
})
SCHEDULER_REQUIRED: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr"),
})
# torch.optim.lr_scheduler classes a config may name: DeepSpeed falls back to
# getattr(torch.optim.lr_scheduler, type)(optimizer, **params) and steps it
# once per optimizer step. Their params are checked against the installed
# torch's signature when the scheduler is built (lr_schedules.py): this
# module imports no torch. ReduceLROnPlateau is stepped by the script, with
# its metric (the engine's docs).
TORCH_SCHEDULERS = ("StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR",
                    "PolynomialLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts",
                    "CyclicLR", "OneCycleLR", "ReduceLROnPlateau")
_IN_SCRIPT = ("build it in the script and pass it as lr_scheduler= to initialize() (or a "
              "callable that takes the optimizer)")
REFUSED_SCHEDULERS: Mapping[str, str] = MappingProxyType({
    "lambdalr": f"its lr_lambda is a Python function, which JSON cannot hold: {_IN_SCRIPT}",
    "multiplicativelr": f"its lr_lambda is a Python function, which JSON cannot hold: "
                        f"{_IN_SCRIPT}",
    "sequentiallr": f"it chains scheduler objects, which JSON cannot hold: {_IN_SCRIPT}",
    "chainedscheduler": f"it chains scheduler objects, which JSON cannot hold: {_IN_SCRIPT}",
})
DEFAULT_WARMUP_NUM_STEPS = 1000


def _choose(value: Any, names: Mapping[str, str], what: str, where: str,
            refused: Mapping[str, str]) -> str:
    """Case-insensitive lookup of a type name -> its canonical spelling (the
    ``names`` value); the error lists the valid ones, or says why a name
    is ``refused``."""
    if isinstance(value, str) and value.lower() in names:
        return names[value.lower()]
    shown = ", ".join(names.values())
    if isinstance(value, str) and value.lower() in refused:
        raise DsrunConfigError(f"{where}: {what} {show(value)} is not available in dsrun: "
                               f"{refused[value.lower()]}; valid: {shown}")
    extra = did_you_mean(str(value), list(names.values()))
    raise DsrunConfigError(f"{where}: unknown {what} {show(value)}{extra}; valid: {shown}")


def canonical_optimizer_type(value: Any, where: str = "optimizer.type") -> str:
    """Lower-case optimizer name (``"AdamW"`` -> ``"adamw"``) or an error."""
    if isinstance(value, str) and value.lower() in OPTIMIZER_NAMES:
        return value.lower()
    return _choose(value, OPTIMIZER_NAMES, "optimizer type", where, REFUSED_OPTIMIZERS)


_SCHEDULER_NAMES = MappingProxyType({name.lower(): name
                                     for name in (*SCHEDULER_PARAMS, *TORCH_SCHEDULERS)})


def canonical_scheduler_type(value: Any, where: str = "scheduler.type") -> str:
    """DeepSpeed's or torch's spelling of a scheduler name (case-insensitive input)."""
    return _choose(value, _SCHEDULER_NAMES, "scheduler type", where, REFUSED_SCHEDULERS)


def _check_torch_scheduler_params(kind: str, params: Mapping[str, Any], path: tuple[str, ...],
                                  ctx: Ctx) -> dict[str, Any]:
    """A torch scheduler's params: any JSON values (their names are checked
    against torch's signature when it is built), never "auto"."""
    out = dict(check_value(params, Check("mapping"), ctx.where(path)))
    for key, value in out.items():
        if is_auto(value):
            raise DsrunConfigError(f'{ctx.where((*path, key))} is "auto", which dsrun resolves '
                                   f"only for DeepSpeed's schedulers, not torch's {kind}")
    return check_torch_scheduler_values(out, path, ctx)


def check_scheduler_params(kind: str, params: Mapping[str, Any], path: tuple[str, ...] = (
        "scheduler", "params"), ctx: Ctx = STRICT) -> dict[str, Any]:
    """Check scheduler ``params`` against DeepSpeed's signature for ``kind``
    (a torch scheduler's when it is built)."""
    if kind not in SCHEDULER_PARAMS:
        return _check_torch_scheduler_params(kind, params, path, ctx)
    specs = SCHEDULER_PARAMS[kind]
    known = pick(params, path, ctx, specs)
    out = {key: check_value(value, specs[key], ctx.where((*path, key)))
           for key, value in known.items()}
    missing = [key for key in SCHEDULER_REQUIRED.get(kind, ()) if key not in out]
    if missing:
        raise DsrunConfigError(f"{ctx.where(path)}: scheduler {kind} needs "
                               + ", ".join(f'"{m}"' for m in missing))
    return out


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: ``type`` (lower-case canonical name) and its ``params``."""

    type: str = "adam"
    params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    legacy_fusion: bool = opt("bool", False)
    # where the section came from, for the optimizer builder's errors
    source: str = field(default=DICT_SOURCE, compare=False, metadata={"internal": True})

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", canonical_optimizer_type(self.type))
        check_value(self.params, Check("mapping"), "optimizer.params")
        if "max_grad_norm" in self.params:
            raise DsrunConfigError('optimizer.params.max_grad_norm is not supported (as in '
                                   'DeepSpeed); use the top-level "gradient_clipping"')
        validate_fields(self)


@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler``: a DeepSpeed or torch ``type`` name and its checked ``params``."""

    type: str
    params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", canonical_scheduler_type(self.type))
        object.__setattr__(self, "params", freeze(check_scheduler_params(self.type, self.params)))


def parse_optimizer(raw: Any, ctx: Ctx, hints: Mapping[str, Any]) -> Optional[OptimizerConfig]:
    if raw is None:
        return None
    path = ("optimizer",)
    misplaced = ({"lr", "betas", "eps", "weight_decay", "momentum", "adam_w_mode", "torch_adam",
                  "bias_correction", "amsgrad"}, "optimizer.params")
    known = pick(raw, path, ctx, ("type", "params", "legacy_fusion"), misplaced)
    if "type" not in known:
        raise DsrunConfigError(f'{ctx.where(path)} needs a "type"; valid: '
                               + ", ".join(OPTIMIZER_NAMES.values()))
    kind = canonical_optimizer_type(known["type"], ctx.where((*path, "type")))
    params = dict(check_value(known.get("params") or {}, Check("mapping"),
                              ctx.where((*path, "params"))))
    defaults = AUTO_OPTIMIZER_DEFAULTS[kind]
    for key, value in params.items():
        if not is_auto(value):
            continue
        if key in hints or key in defaults:
            params[key] = hints[key] if key in hints else defaults[key]
        else:
            raise DsrunConfigError(f'{ctx.where((*path, "params", key))} is "auto", which dsrun '
                                   f"resolves only for {', '.join(defaults)} of "
                                   f"{OPTIMIZER_NAMES[kind]}")
    params = check_optimizer_values(kind, params, (*path, "params"), ctx)
    known.update(type=kind, params=params, source=ctx.source)
    return build(OptimizerConfig, known, ctx)


def parse_scheduler(raw: Any, ctx: Ctx, lr: Any, total_num_steps: Optional[int],
                     warmup_num_steps: Optional[int]) -> Optional[SchedulerConfig]:
    if raw is None:
        return None
    path = ("scheduler",)
    known = pick(raw, path, ctx, ("type", "params"),
                  ({k for specs in SCHEDULER_PARAMS.values() for k in specs}, "scheduler.params"))
    kind = canonical_scheduler_type(known.get("type"), ctx.where((*path, "type")))
    params = dict(check_value(known.get("params") or {}, Check("mapping"),
                              ctx.where((*path, "params"))))
    autos = {"warmup_min_lr": 0.0, "warmup_max_lr": lr, "total_num_steps": total_num_steps,
             "warmup_num_steps": DEFAULT_WARMUP_NUM_STEPS if warmup_num_steps is None
             else warmup_num_steps}
    why = {"warmup_max_lr": "there is no optimizer lr to take it from",
           "total_num_steps": "no total step count was given (total_num_steps)"}
    for key, value in params.items():
        if is_auto(value) and key in autos and key in SCHEDULER_PARAMS.get(kind, {}):
            if autos[key] is None:
                raise DsrunConfigError(f'{ctx.where((*path, "params", key))} is "auto" but '
                                       f"{why[key]}")
            params[key] = autos[key]
    params = check_scheduler_params(kind, params, (*path, "params"), ctx)
    return build(SchedulerConfig, {"type": kind, "params": params}, ctx)


