"""DeepSpeed's learning-rate schedules, step for step.

Each schedule is a pure function of the scheduler's ``last_batch_iteration``
(``*_at``; the curves tests compare against formulas) and a class with
DeepSpeed's constructor arguments that writes those values into the
optimizer's param groups. Semantics follow deepspeed/runtime/lr_schedules.py:

* ``step`` below is ``last_batch_iteration``: -1 right after construction,
  then 0, 1, 2, ... after each ``scheduler.step()``, which the engine calls
  once per optimizer step. ``step(n)`` jumps to iteration ``n``.
* Construction with ``last_batch_iteration=-1`` sets the step -1 value:
  WarmupLR/WarmupDecayLR the minimum lr, WarmupCosineLR ratio 0 (lr 0),
  OneCycle ``cycle_min_lr`` (and betas ``(cycle_min_mom, 0.99)``),
  LRRangeTest its minimum lr. Resuming (``last_batch_iteration >= 0``) leaves
  the optimizer untouched until the next ``step()``.
* ``warmup_num_steps`` is used as ``max(2, warmup_num_steps)``. Warmup
  fraction at step t < W: ``log(t + 1) / log(W)`` ('log') or ``t / W``
  ('linear'); after warmup WarmupLR stays at the maximum.
* WarmupDecayLR after warmup: ``gamma = max(0, (T - t) / max(1, T - W))``,
  ``lr = min_lr + (max_lr - min_lr) * gamma`` (linear decay to min_lr at T).
* WarmupCosineLR multiplies each group's lr at construction by a ratio:
  warmup ``min_ratio + (1 - min_ratio) * fraction``; then with
  ``p = min(1, (t - W + 1) / max(1, T - W))``,
  ``ratio = max(0, cos_min + (1 - cos_min) * (1 + cos(pi * p)) / 2)`` (the
  clamp of ``p`` is current DeepSpeed's: the ratio stays at ``cos_min``
  after T instead of rising again).
* WarmupLR without ``warmup_max_lr`` warms each param group up to its own
  lr (a list of bounds, one per group, works for every DeepSpeed schedule).
* OneCycle: triangular cycle of ``first + second`` steps (optionally in
  stairs; ``second`` may be 0), then ``lr = cycle_min_lr / (1 + decay_lr_rate
  * k / decay_step_size)`` for the k-th step after the cycle. Momentum moves inversely between
  ``cycle_max_mom`` and ``cycle_min_mom`` and is written as ``betas[0]``,
  with ``betas[1]`` forced to 0.99 exactly as DeepSpeed does; optimizers
  without ``betas`` (SGD) get no momentum cycling (DeepSpeed warns the same).
* ``state_dict()`` is ``{"last_batch_iteration": t}`` as in DeepSpeed, so
  checkpoints move between the two.

The classes subclass ``torch.optim.lr_scheduler.LRScheduler`` for
``isinstance`` checks in client code but do not run its ``__init__``: its
step counting and initial step differ from DeepSpeed's.

A config ``"scheduler"`` type that is not DeepSpeed's names a
``torch.optim.lr_scheduler`` class, built over the torch optimizer with the
params as keyword arguments (DeepSpeed's fallback) after they are checked
against its signature (:func:`build_scheduler`). :func:`needs_metric` tells
the engine which schedulers it must not step itself (ReduceLROnPlateau).
Those torch and client schedulers are handled in
:mod:`dsrun.runtime.lr_schedules_torch`, whose names are importable from here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config import SchedulerConfig
from dsrun.runtime.config_schema import thaw
from dsrun.runtime.lr_schedules_torch import (  # noqa: F401 - importable from here as before
    _method_signature,
    _required_step_parameters,
    _step_signature,
    _torch_scheduler,
    needs_lr_kwargs,
    needs_metric,
    scheduler_step_args,
    takes_an_argument,
)

log = logging.getLogger(__name__)

PerGroup = Union[float, Sequence[float]]
WARMUP_TYPES = ("log", "linear")


# ------------------------------------------------------------ pure schedules


def _warmup_fraction(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    steps = max(2, warmup_num_steps)
    if warmup_type == "log":
        return math.log(step + 1) / math.log(steps)
    return step / steps


def warmup_lr_at(step: int, *, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log") -> float:
    """WarmupLR's lr at ``last_batch_iteration == step``."""
    if step < 0:
        return warmup_min_lr
    gamma = 1.0
    if step < max(2, warmup_num_steps):
        gamma = _warmup_fraction(step, warmup_num_steps, warmup_type)
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def warmup_decay_lr_at(step: int, *, total_num_steps: int, warmup_min_lr: float = 0.0,
                       warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000,
                       warmup_type: str = "log") -> float:
    """WarmupDecayLR's lr at ``last_batch_iteration == step``."""
    warmup = max(2, warmup_num_steps)
    if step < warmup:
        return warmup_lr_at(step, warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr,
                            warmup_num_steps=warmup, warmup_type=warmup_type)
    gamma = max(0.0, (total_num_steps - step) / max(1.0, total_num_steps - warmup))
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def warmup_cosine_ratio_at(step: int, *, total_num_steps: int, warmup_min_ratio: float = 0.0,
                           warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                           warmup_type: str = "log") -> float:
    """WarmupCosineLR's multiplier of the initial lr at ``step``."""
    if step < 0:
        return 0.0
    warmup = max(2, warmup_num_steps)
    if step < warmup:
        fraction = _warmup_fraction(step, warmup, warmup_type)
        return warmup_min_ratio + (1.0 - warmup_min_ratio) * fraction
    progress = min(1.0, (step - warmup + 1) / max(1, total_num_steps - warmup))
    cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
    return max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * cosine)


def lr_range_test_lr_at(step: int, *, lr_range_test_min_lr: float = 1e-3,
                        lr_range_test_step_size: int = 2000,
                        lr_range_test_step_rate: float = 1.0,
                        lr_range_test_staircase: bool = False) -> float:
    """LRRangeTest's lr at ``step``: ``min_lr * (1 + rate * interval)``."""
    interval = (step + 1) / lr_range_test_step_size
    if lr_range_test_staircase:
        interval = math.floor(interval)
    return lr_range_test_min_lr * (1.0 + lr_range_test_step_rate * interval)


def _cycle_scale(step: int, first: float, second: float, first_stairs: int,
                 second_stairs: int) -> float:
    """Position in the triangle, 0 at the ends and 1 at the peak."""
    total = first + second
    iteration = step + 1
    x = 1.0 + iteration / total - math.floor(1 + iteration / total)
    ratio = first / total
    if x <= ratio:
        scale, stairs = x / ratio, first_stairs
    else:
        scale, stairs = (x - 1) / (ratio - 1), second_stairs
    if stairs > 0:  # quantise from the integer offset, as current DeepSpeed does
        offset = iteration % total
        if offset <= first:
            position = offset * stairs / first
        else:
            position = (total - offset) * stairs / second
        scale = math.floor(position) / stairs
    return scale


def one_cycle_at(step: int, *, cycle_min_lr: float, cycle_max_lr: float,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: Optional[int] = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: Optional[int] = None, decay_step_size: int = 0,
                 cycle_min_mom: float = 0.8, cycle_max_mom: float = 0.9,
                 decay_mom_rate: float = 0.0) -> tuple[float, float]:
    """OneCycle's ``(lr, momentum)`` at ``step`` (momentum is ``betas[0]``)."""
    if step < 0:
        return cycle_min_lr, cycle_min_mom
    first = float(cycle_first_step_size)
    second = first if cycle_second_step_size is None else float(cycle_second_step_size)
    if step < first + second:
        second_stairs = (cycle_first_stair_count if cycle_second_stair_count is None
                         else cycle_second_stair_count)
        scale = _cycle_scale(step, first, second, cycle_first_stair_count, second_stairs)
        return (cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale,
                cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale)
    interval = (step - first - second + 1) / decay_step_size if decay_step_size else 0.0
    lr = cycle_min_lr
    if decay_step_size and not math.isclose(decay_lr_rate, 0):
        lr = cycle_min_lr / (1.0 + decay_lr_rate * interval)
    momentum = cycle_max_mom
    if decay_step_size and not math.isclose(decay_mom_rate, 0):
        momentum = cycle_max_mom * (1.0 + decay_mom_rate * interval)
    return lr, momentum


# --------------------------------------------------------- scheduler classes


def _torch_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer, unwrapping an fp16/ZeRO wrapper's ``.optimizer``."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer")


def _positive_int(value: Any, name: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise DsrunConfigError(f"{name} must be {what}, got {value!r}")
    return value


def _warmup_type(value: Any) -> str:
    if value not in WARMUP_TYPES:
        raise DsrunConfigError(f"warmup_type must be one of {', '.join(WARMUP_TYPES)}, "
                               f"got {value!r}")
    return value


class _DeepSpeedSchedule(LRScheduler):
    """DeepSpeed's scheduler protocol over a torch optimizer (see module doc)."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        # LRScheduler.__init__ is skipped on purpose: it steps once and
        # counts epochs; DeepSpeed schedules are indexed by batch iteration.
        self.optimizer = _torch_optimizer(optimizer)
        self.last_batch_iteration = int(last_batch_iteration)
        self.base_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self._last_lr: Optional[list[float]] = None

    @property
    def last_epoch(self) -> int:  # torch's name for the same counter
        return self.last_batch_iteration

    @last_epoch.setter
    def last_epoch(self, value: int) -> None:
        self.last_batch_iteration = value

    def _per_group(self, value: PerGroup, name: str) -> list[float]:
        groups = len(self.optimizer.param_groups)
        if isinstance(value, (list, tuple)):
            if len(value) != groups:
                raise DsrunConfigError(f"{name} has {len(value)} values for {groups} param groups")
            return [float(v) for v in value]
        return [float(value)] * groups

    def get_lr(self) -> list[float]:  # pragma: no cover - every schedule overrides it
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The lrs the last ``step()`` (or construction) wrote."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}: call step() first")
        return list(self._last_lr)

    def step(self, last_batch_iteration: Optional[int] = None) -> None:  # type: ignore[override]
        """Advance one iteration, or jump to ``last_batch_iteration``."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = int(last_batch_iteration)
        self._apply()

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # keep a tensor lr a tensor (capturable optimizers)
            else:
                group["lr"] = lr
        self._last_lr = [float(lr) for lr in lrs]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])


class WarmupLR(_DeepSpeedSchedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold.

    ``warmup_max_lr=None`` takes each param group's own lr (current DeepSpeed).
    """

    def __init__(self, optimizer: Any, warmup_min_lr: PerGroup = 0.0,
                 warmup_max_lr: Optional[PerGroup] = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:  # each group's own lr, as DeepSpeed
            warmup_max_lr = list(self.base_lrs)
        self.min_lrs = self._per_group(warmup_min_lr, "warmup_min_lr")
        self.max_lrs = self._per_group(warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.warmup_type = _warmup_type(warmup_type)
        if last_batch_iteration == -1:
            self._apply()

    def get_lr(self) -> list[float]:
        return [warmup_lr_at(self.last_batch_iteration, warmup_min_lr=low, warmup_max_lr=high,
                             warmup_num_steps=self.warmup_num_steps, warmup_type=self.warmup_type)
                for low, high in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """Warm up like :class:`WarmupLR`, then decay linearly to the minimum at
    ``total_num_steps``."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: PerGroup = 0.0,
                 warmup_max_lr: PerGroup = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            log.warning("total_num_steps %d is less than warmup_num_steps %d",
                        total_num_steps, warmup_num_steps)

    def get_lr(self) -> list[float]:
        return [warmup_decay_lr_at(self.last_batch_iteration, total_num_steps=self.total_num_steps,
                                   warmup_min_lr=low, warmup_max_lr=high,
                                   warmup_num_steps=self.warmup_num_steps,
                                   warmup_type=self.warmup_type)
                for low, high in zip(self.min_lrs, self.max_lrs)]


class WarmupCosineLR(_DeepSpeedSchedule):
    """Scale each group's initial lr by a warmup-then-cosine ratio."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = _warmup_type(warmup_type)
        self.org_lrs = list(self.base_lrs)
        if self.total_num_steps < self.warmup_num_steps:
            log.warning("total_num_steps %d is less than warmup_num_steps %d",
                        total_num_steps, warmup_num_steps)
        if last_batch_iteration == -1:
            self._apply()

    def get_lr_ratio(self) -> float:
        return warmup_cosine_ratio_at(
            self.last_batch_iteration, total_num_steps=self.total_num_steps,
            warmup_min_ratio=self.warmup_min_ratio, warmup_num_steps=self.warmup_num_steps,
            cos_min_ratio=self.cos_min_ratio, warmup_type=self.warmup_type)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_DeepSpeedSchedule):
    """1Cycle: a triangular lr cycle, then decay; momentum cycled inversely.

    ``cycle_min_lr``/``cycle_max_lr``/``cycle_min_mom``/``cycle_max_mom``
    are one value for every param group or a list with one per group
    (DeepSpeed's ``_format_param``); each group follows the same cycle
    between its own bounds. ``cycle_second_step_size`` 0 (DeepSpeed allows
    it) makes a cycle of the rising half only.
    """

    def __init__(self, optimizer: Any, cycle_min_lr: PerGroup, cycle_max_lr: PerGroup,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: Optional[int] = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: Optional[int] = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: PerGroup = 0.8,
                 cycle_max_mom: PerGroup = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        _positive_int(cycle_first_step_size, "cycle_first_step_size")
        if cycle_second_step_size is not None:
            _positive_int(cycle_second_step_size, "cycle_second_step_size", low=0)
        self.bounds = list(zip(
            self._per_group(cycle_min_lr, "cycle_min_lr"),
            self._per_group(cycle_max_lr, "cycle_max_lr"),
            self._per_group(cycle_min_mom, "cycle_min_mom"),
            self._per_group(cycle_max_mom, "cycle_max_mom")))
        self.shape = dict(
            decay_lr_rate=float(decay_lr_rate), cycle_first_step_size=cycle_first_step_size,
            cycle_second_step_size=cycle_second_step_size,
            cycle_first_stair_count=cycle_first_stair_count,
            cycle_second_stair_count=cycle_second_stair_count, decay_step_size=decay_step_size,
            decay_mom_rate=float(decay_mom_rate))
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in self.optimizer.defaults:
            log.warning("cycle_momentum is disabled because optimizer %s has no betas",
                        type(self.optimizer).__name__)
            self.cycle_momentum = False
        if last_batch_iteration == -1:
            self._apply()

    def _at(self) -> list[tuple[float, float]]:
        """``(lr, momentum)`` per param group at the current iteration."""
        return [one_cycle_at(self.last_batch_iteration, cycle_min_lr=low, cycle_max_lr=high,
                             cycle_min_mom=low_mom, cycle_max_mom=high_mom, **self.shape)
                for low, high, low_mom, high_mom in self.bounds]

    def get_lr(self) -> list[float]:
        return [lr for lr, _ in self._at()]

    def get_mom(self) -> Optional[list[tuple[float, float]]]:
        """``betas`` per group, or None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        return [(momentum, 0.99) for _, momentum in self._at()]

    def _apply(self) -> None:
        super()._apply()
        for group, betas in zip(self.optimizer.param_groups, self.get_mom() or ()):
            group["betas"] = betas


class LRRangeTest(_DeepSpeedSchedule):
    """Grow the lr from ``lr_range_test_min_lr`` to find the largest usable lr."""

    def __init__(self, optimizer: Any, lr_range_test_min_lr: PerGroup = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = self._per_group(lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        if last_batch_iteration == -1:
            self._apply()

    def get_lr(self) -> list[float]:
        return [lr_range_test_lr_at(self.last_batch_iteration, lr_range_test_min_lr=low,
                                    lr_range_test_step_size=self.step_size,
                                    lr_range_test_step_rate=self.step_rate,
                                    lr_range_test_staircase=self.staircase)
                for low in self.min_lrs]


SCHEDULERS: Mapping[str, type[_DeepSpeedSchedule]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle, "LRRangeTest": LRRangeTest,
}
#: DeepSpeed's list of its scheduler names (Accelerate checks a client
#: scheduler's class name against it)
VALID_LR_SCHEDULES = list(SCHEDULERS)


def build_scheduler(config: Optional[SchedulerConfig], optimizer: Any) -> Optional[Any]:
    """The scheduler ``config`` describes (None for None): DeepSpeed's (its
    params were checked against these signatures when the config was
    resolved), else the torch.optim.lr_scheduler class of that name over
    the torch optimizer, its params checked here against torch's signature."""
    if config is None:
        return None
    params = {key: thaw(value) for key, value in config.params.items()}
    if config.type in SCHEDULERS:
        return SCHEDULERS[config.type](optimizer, **params)
    return _torch_scheduler(config.type, params, _torch_optimizer(optimizer))
