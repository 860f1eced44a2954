"""Value types of the well-known ``optimizer.params`` and torch
``scheduler.params`` (``lr``, ``betas``, ``step_size``, ``gamma`` ...),
checked when the config is resolved.

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
}
# optimizer types whose parameter of that name is something else
_OTHER_MEANING = {"eps": ("adafactor",)}  # Adafactor's eps is a pair (eps1, eps2)

# torch.optim.lr_scheduler arguments (StepLR, MultiStepLR, ConstantLR, LinearLR,
# ExponentialLR, PolynomialLR, CosineAnnealingLR, CosineAnnealingWarmRestarts,
# CyclicLR, OneCycleLR, ReduceLROnPlateau); a 0 period divides by zero at a step
TORCH_SCHEDULER_VALUES: Mapping[str, Check] = {
    **dict.fromkeys(("step_size", "T_max", "T_0", "T_mult", "step_size_up", "epochs",
                     "steps_per_epoch"), Check("int", low=1)),
    **dict.fromkeys(("step_size_down", "total_steps"), Check("int", low=1, optional=True)),
    **dict.fromkeys(("total_iters", "patience", "cooldown"), Check("int", low=0)),
    "last_epoch": Check("int", low=-1),
    **dict.fromkeys(("gamma", "eta_min", "factor", "start_factor", "end_factor", "power",
                     "pct_start", "div_factor", "final_div_factor", "threshold", "eps"),
                    Check("float")),
    # one value, or one per param group
    **dict.fromkeys(("base_lr", "max_lr", "min_lr", "base_momentum", "max_momentum"),
                    Check("floats")),
    **dict.fromkeys(("three_phase", "cycle_momentum"), Check("bool")),
}


def _check(value: Any, spec: Check, where: str) -> None:
    if not isinstance(value, _JSON_TYPES):
        return
    try:
        check_value(value, spec, where)
    except DsrunConfigError as err:
        raise DsrunConfigError(f"{err}{_quoted_number(value)}") from None


def _quoted_number(value: Any) -> str:
    """A hint for a number written as a string (what YAML-to-JSON gives for 3e-4)."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        # PyYAML reads 3e-4 (no dot) as a string: YAML-to-JSON configs carry it so
        return " (a string: write the number without quotes)"
    return ""


def _check_betas(value: Any, where: str) -> None:
    if not isinstance(value, _JSON_TYPES):
        return
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0
        for b in value)
    if not ok:
        raise DsrunConfigError(f"{where} must be a list of 2 numbers in [0, 1), got "
                               f"{show(value)}")


def check_optimizer_values(kind: str, params: Mapping[str, Any], path: tuple[str, ...],
                           ctx: Ctx) -> None:
    """Raise naming ``path.KEY`` and the config's source for a well-known
    optimizer parameter of the wrong type or range (``kind``: lower-case type)."""
    for key, value in params.items():
        where = ctx.where((*path, key))
        if key == BETAS:
            _check_betas(value, where)
        elif key in OPTIMIZER_VALUES and kind not in _OTHER_MEANING.get(key, ()):
            _check(value, OPTIMIZER_VALUES[key], where)


def check_torch_scheduler_values(params: Mapping[str, Any], path: tuple[str, ...],
                                 ctx: Ctx) -> None:
    """The same for a torch scheduler's well-known parameters; ``milestones``
    is a list of integers."""
    for key, value in params.items():
        where = ctx.where((*path, key))
        if key == "milestones" and isinstance(value, _JSON_TYPES):
            if not isinstance(value, (list, tuple)):
                raise DsrunConfigError(f"{where} must be a list of integers, got {show(value)}")
            for index, milestone in enumerate(value):
                _check(milestone, Check("int", low=0), ctx.where((*path, key, str(index))))
        elif key in TORCH_SCHEDULER_VALUES:
            _check(value, TORCH_SCHEDULER_VALUES[key], where)
