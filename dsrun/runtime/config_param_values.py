"""Value types of the well-known ``optimizer.params`` and torch
``scheduler.params`` (``lr``, ``betas``, ``step_size``, ``gamma`` ...),
checked when the config is resolved, and normalised to what torch takes
(``"betas": [0, 0.99]`` -> ``(0.0, 0.99)``, ``"T_0": 10.0`` -> ``10``).

Their names are checked later, against the installed torch's signatures
(:mod:`dsrun.runtime.optimizers`, :mod:`dsrun.runtime.lr_schedules_torch`);
a wrong *value* would otherwise pass the launcher's ``--config`` check and
fail in every rank inside torch (``'<=' not supported between 'float' and
'str'``, a bare ``IndexError`` for ``"betas": [0.9]``, or at the first step
for a scheduler). Only names whose meaning is the same in every class that
has them are checked here; others are left to the class. Values that are
not JSON types (a tensor ``lr`` in a config dict) are left to torch.
Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config_schema import Check, Ctx, check_value, show

_JSON_TYPES = (str, bool, int, float, list, tuple, Mapping, type(None))
BETAS = "betas"

# optimizer.params: torch (and Lamb/Lion) refuse negative lr, eps, weight_decay
# and momentum; betas are a pair in [0, 1) for every class that has them
OPTIMIZER_VALUES: Mapping[str, Check] = {
    "lr": Check("float", low=0.0), "eps": Check("float", low=0.0),
    "weight_decay": Check("float", low=0.0), "momentum": Check("float", low=0.0),
    "dampening": Check("float"),
    # torch's flags (and DeepSpeed's own, also checked when the optimizer is
    # built): a string "false" is truthy, so torch would turn the flag ON
    # (maximize: gradient ascent) or crash deep inside at the first step;
    # DeepSpeed's FusedAdam refuses these, so a non-bool is refused by name
    **dict.fromkeys(("amsgrad", "maximize", "nesterov", "centered", "capturable",
                     "differentiable", "decoupled_weight_decay", "eps_inside_sqrt",
                     "adam_w_mode", "torch_adam", "bias_correction", "fp32_optimizer_states",
                     "set_grad_none"), Check("bool")),
    # torch's default None picks an implementation per device
    **dict.fromkeys(("foreach", "fused"), Check("bool", optional=True)),
}
# optimizer types whose parameter of that name is something else
_OTHER_MEANING = {"eps": ("adafactor",)}  # Adafactor's eps is a pair (eps1, eps2)

# torch.optim.lr_scheduler arguments (StepLR, MultiStepLR, ConstantLR, LinearLR,
# ExponentialLR, PolynomialLR, CosineAnnealingLR, CosineAnnealingWarmRestarts,
# CyclicLR, OneCycleLR, ReduceLROnPlateau), as torch 2.13's code uses them:
# - "int": T_0, T_mult, epochs, steps_per_epoch and total_steps are refused by
#   torch unless isinstance(x, int), so an integral float (JSON's 10.0) is
#   passed on as an int; StepLR's step_size and MultiStepLR's milestones are
#   matched against the integer epoch (last_epoch % step_size, last_epoch in
#   milestones), so a fraction would decay at other epochs than it says (2.5
#   every 5) or never
# - "float": T_max, total_iters, step_size_up/down, patience and cooldown are
#   only computed or compared with (CyclicLR does float(step_size_up)), so a
#   fraction is what torch (and DeepSpeed, which passes them on) accept
# a 0 period divides by zero at a step; _POSITIVE are those needing > 0
TORCH_SCHEDULER_VALUES: Mapping[str, Check] = {
    **dict.fromkeys(("step_size", "T_0", "T_mult"), Check("int", low=1)),
    **dict.fromkeys(("epochs", "steps_per_epoch", "total_steps"),
                    Check("int", low=1, optional=True)),
    "last_epoch": Check("int", low=-1),
    **dict.fromkeys(("T_max", "step_size_up"), Check("float")),  # > 0: _POSITIVE
    **dict.fromkeys(("total_iters", "patience", "cooldown"), Check("float", low=0.0)),
    "step_size_down": Check("float", low=0.0, optional=True),
    **dict.fromkeys(("gamma", "eta_min", "factor", "start_factor", "end_factor", "power",
                     "pct_start", "div_factor", "final_div_factor", "threshold", "eps"),
                    Check("float")),
    # one value, or one per param group
    **dict.fromkeys(("base_lr", "max_lr", "min_lr", "base_momentum", "max_momentum"),
                    Check("floats")),
    **dict.fromkeys(("three_phase", "cycle_momentum"), Check("bool")),
}
_POSITIVE = ("T_max", "step_size_up")
MILESTONE = Check("int", low=0)


def _check(value: Any, spec: Check, where: str) -> Any:
    """``value`` normalised to ``spec`` (10.0 -> 10 for an int, 0 -> 0.0 for a
    float, which torch requires); a value of no JSON type is left to torch."""
    if not isinstance(value, _JSON_TYPES):
        return value
    try:
        return check_value(value, spec, where)
    except DsrunConfigError as err:
        raise DsrunConfigError(f"{err}{_quoted_number(value)}") from None


def _quoted_number(value: Any) -> str:
    """A hint for a number written as a string (what YAML-to-JSON gives for
    3e-4), or for a flag written as one ("false", which Python reads as true)."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return " (a string: write true or false without quotes)"
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        # PyYAML reads 3e-4 (no dot) as a string: YAML-to-JSON configs carry it so
        return " (a string: write the number without quotes)"
    return ""


def _check_betas(value: Any, where: str) -> Any:
    """A pair of numbers in [0, 1), as floats: torch >= 2 refuses an int
    element ("betas must be either both floats or both Tensors"), which
    DeepSpeed's FusedAdam takes (JSON writes beta1 = 0 as 0)."""
    if not isinstance(value, _JSON_TYPES):
        return value
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0
        for b in value)
    if not ok:
        raise DsrunConfigError(f"{where} must be a list of 2 numbers in [0, 1), got "
                               f"{show(value)}")
    return tuple(float(b) for b in value)


def check_optimizer_values(kind: str, params: Mapping[str, Any], path: tuple[str, ...],
                           ctx: Ctx) -> dict[str, Any]:
    """``params`` with the well-known optimizer parameters normalised (ints to
    floats); raise naming ``path.KEY`` and the config's source for one of the
    wrong type or range (``kind``: lower-case type)."""
    out = dict(params)
    for key, value in params.items():
        where = ctx.where((*path, key))
        if key == BETAS:
            out[key] = _check_betas(value, where)
        elif key in OPTIMIZER_VALUES and kind not in _OTHER_MEANING.get(key, ()):
            out[key] = _check(value, OPTIMIZER_VALUES[key], where)
    return out


def check_torch_scheduler_values(params: Mapping[str, Any], path: tuple[str, ...],
                                 ctx: Ctx) -> dict[str, Any]:
    """The same for a torch scheduler's well-known parameters, normalised to
    what torch takes (``T_0: 10.0`` -> 10); ``milestones`` is a list of
    integers."""
    out = dict(params)
    for key, value in params.items():
        where = ctx.where((*path, key))
        if key == "milestones" and isinstance(value, _JSON_TYPES):
            if not isinstance(value, (list, tuple)):
                raise DsrunConfigError(f"{where} must be a list of integers, got {show(value)}")
            out[key] = [_check(milestone, MILESTONE, ctx.where((*path, key, str(index))))
                        for index, milestone in enumerate(value)]
        elif key in TORCH_SCHEDULER_VALUES:
            spec = TORCH_SCHEDULER_VALUES[key]
            normalised = _check(value, spec, where)
            if key in _POSITIVE and isinstance(normalised, float) and not normalised > 0.0:
                raise DsrunConfigError(f"{where} must be a number > 0, got {show(value)}")
            # torch takes an int or a float for the others: they stay as written
            out[key] = normalised if spec.kind == "int" else value
    return out
