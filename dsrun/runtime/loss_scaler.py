"""fp16 loss scaling as a pure state machine (no torch), DeepSpeed's rules.

The engine multiplies the loss by :attr:`LossScaler.scale` before backward,
checks the gradients for inf/NaN, and calls :meth:`LossScaler.update` once
per optimizer step with the result; ``update`` says whether to skip the step.

Dynamic scaling (``fp16.loss_scale == 0``), as deepspeed/runtime/fp16/
loss_scaler.py ``DynamicLossScaler.update_scale``:

* every overflow skips the step;
* an overflow when the hysteresis budget is down to 1 shrinks the scale by
  ``scale_factor`` (2), never below ``min_scale``; with budget left it only
  spends one unit of hysteresis;
* growth: at the clean step ``window + 1`` steps after the last overflow
  (its first ``window`` clean steps do not count it; from the start: at step
  ``window``, counted from 0) and every ``window`` steps after, the scale
  grows by ``scale_factor`` and the hysteresis budget is refilled
  (``consecutive_hysteresis`` refills it on every clean step instead) -
  DeepSpeed's ``stable_interval = (iter - last_overflow_iter) - 1``, tested
  against its scaler;
* an overflow at ``min_scale`` with no hysteresis left raises
  :class:`LossScaleError` when ``raise_at_min_scale`` (DeepSpeed's
  behaviour: training has diverged), else the step is just skipped.

DeepSpeed's names (``DynamicLossScaler``'s plain attributes, which scripts
read and write through ``optimizer.loss_scaler``) are properties over these
fields: ``cur_scale`` (``scale``), ``cur_hysteresis`` (``hysteresis_left``),
``cur_iter`` (``iteration``), ``last_overflow_iter``, ``scale_window``
(``window``), ``delayed_shift`` (``hysteresis``), ``raise_error_at_min_scale``
(``raise_at_min_scale``); ``loss_scale`` reads ``cur_scale``. A write is the
state the next step uses (the engine reads :attr:`LossScaler.scale` at every
backward and step).

Static scaling (``loss_scale > 0``): the scale never changes; an overflow
still skips the step (DeepSpeed would apply it; applying inf/NaN gradients
only destroys the weights, so dsrun skips and counts it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from dsrun.errors import DsrunError


class LossScaleError(DsrunError):
    """Gradients overflow at the minimum loss scale: training diverged."""


def checked_scale(value: Any, where: str) -> float:
    """``value`` as a loss scale, or ValueError naming it and ``where`` it
    was written (0, a negative or a non-finite scale would zero or poison
    every gradient)."""
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where} = {value!r}: a loss scale is a number") from None
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{where} = {value!r}: a loss scale must be finite and > 0")
    return scale


@dataclass
class LossScaler:
    """Loss-scale state; mutable on purpose (it is the training state)."""

    scale: float = 2.0**16
    dynamic: bool = True
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    scale_factor: float = 2.0
    raise_at_min_scale: bool = True
    # state
    iteration: int = 0
    last_overflow_iteration: int = -1
    hysteresis_left: int = field(default=0)
    overflows: int = 0
    #: called after a script writes :attr:`cur_scale` (stage 0 republishes
    #: the scale on the client's optimizer, whose ``cur_scale`` is a copy)
    on_write: Optional[Callable[[], None]] = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.scale <= 0 or self.window < 1 or self.hysteresis < 1 or self.scale_factor <= 1:
            raise ValueError(f"invalid loss scaler settings: {self}")
        if self.min_scale > self.scale and self.dynamic:
            raise ValueError(f"min_scale {self.min_scale:g} above initial scale {self.scale:g}")
        self.hysteresis_left = self.hysteresis

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's name of :attr:`scale`; a write is the scale of the next
        backward and step (ReaL syncs it across model-parallel ranks)."""
        return self.scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self.scale = checked_scale(value, "loss_scaler.cur_scale")
        if self.on_write is not None:
            self.on_write()

    @property
    def loss_scale(self) -> float:
        """DeepSpeed's read-only ``LossScalerBase.loss_scale``."""
        return self.scale

    @property
    def cur_hysteresis(self) -> int:
        return self.hysteresis_left

    @cur_hysteresis.setter
    def cur_hysteresis(self, value: int) -> None:
        self.hysteresis_left = int(value)

    @property
    def cur_iter(self) -> int:
        return self.iteration

    @cur_iter.setter
    def cur_iter(self, value: int) -> None:
        self.iteration = int(value)

    @property
    def last_overflow_iter(self) -> int:
        return self.last_overflow_iteration

    @last_overflow_iter.setter
    def last_overflow_iter(self, value: int) -> None:
        self.last_overflow_iteration = int(value)

    @property
    def scale_window(self) -> int:
        return self.window

    @scale_window.setter
    def scale_window(self, value: int) -> None:
        if int(value) < 1:
            raise ValueError(f"loss_scaler.scale_window = {value!r}: must be at least 1")
        self.window = int(value)

    @property
    def delayed_shift(self) -> int:
        """DeepSpeed's name of :attr:`hysteresis` (the budget refilled on growth)."""
        return self.hysteresis

    @delayed_shift.setter
    def delayed_shift(self, value: int) -> None:
        if int(value) < 1:
            raise ValueError(f"loss_scaler.delayed_shift = {value!r}: must be at least 1")
        self.hysteresis = int(value)

    @property
    def raise_error_at_min_scale(self) -> bool:
        return self.raise_at_min_scale

    @raise_error_at_min_scale.setter
    def raise_error_at_min_scale(self, value: bool) -> None:
        self.raise_at_min_scale = bool(value)

    def update(self, overflow: bool) -> bool:
        """Record one optimizer step's overflow check; True means skip the step."""
        if overflow:
            self.overflows += 1
        if not self.dynamic:
            self.iteration += 1
            return overflow
        if overflow:
            self._on_overflow()
        else:
            self._on_clean()
        self.iteration += 1
        return overflow

    def _on_overflow(self) -> None:
        if self.hysteresis_left <= 1:
            if self.scale <= self.min_scale and self.raise_at_min_scale:
                raise LossScaleError(
                    f"gradients overflow at the minimum loss scale {self.min_scale:g} "
                    f"(iteration {self.iteration}): training has diverged; lower the learning "
                    "rate, or set fp16.min_loss_scale lower")
            self.scale = max(self.scale / self.scale_factor, self.min_scale)
        else:
            self.hysteresis_left -= 1
        self.last_overflow_iteration = self.iteration

    def _on_clean(self) -> None:
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        stable = self.iteration - self.last_overflow_iteration - 1
        if stable > 0 and stable % self.window == 0:
            if not self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            self.scale *= self.scale_factor

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "iteration": self.iteration,
                "last_overflow_iteration": self.last_overflow_iteration,
                "hysteresis_left": self.hysteresis_left, "overflows": self.overflows}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Continue from :meth:`state_dict` (the settings stay this scaler's)."""
        self.scale = float(state["scale"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.overflows = int(state.get("overflows", 0))


class UnitLossScaler(LossScaler):
    """What a ZeRO 1-3 optimizer holds as ``loss_scaler`` where nothing is
    loss-scaled (bf16, fp32): DeepSpeed 0.19.8's ``LossScaler(scale=1.0)``
    there, so a script that reads ``optimizer.loss_scaler.cur_scale`` gets
    1.0 instead of failing on None. A write is refused (dsrun scales only
    fp16 losses; DeepSpeed would scale a bf16 loss by it)."""

    def __init__(self) -> None:
        super().__init__(scale=1.0, dynamic=False)

    @property
    def cur_scale(self) -> float:
        return 1.0

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        raise DsrunError(f"loss_scaler.cur_scale = {value!r}: this model has no loss scaling "
                         "(only fp16 scales the loss; the scale here is always 1.0)")

    @property
    def loss_scale(self) -> float:
        return 1.0
