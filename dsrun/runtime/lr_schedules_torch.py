"""Schedulers that are not DeepSpeed's: built by name from torch, and
stepped the way their ``step()`` asks.

A config ``"scheduler"`` type that DeepSpeed does not have names a
``torch.optim.lr_scheduler`` class; :func:`_torch_scheduler` builds it
over the torch optimizer after checking the params against its signature
(DeepSpeed's fallback, called from
:func:`dsrun.runtime.lr_schedules.build_scheduler`). A client scheduler
may be anything with a ``step``: :func:`scheduler_step_args` reads that
method's signature to decide what the engine passes it (``lr_kwargs``,
nothing, or ``train_batch_size`` as DeepSpeed does), :func:`needs_metric`
tells which schedulers the engine must not step itself (ReduceLROnPlateau)
and :func:`needs_lr_kwargs` why one cannot be stepped without
``lr_kwargs``. :mod:`dsrun.runtime.lr_schedules` re-exports these names.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch.optim import Optimizer

from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.runtime.config_schema import did_you_mean


def _torch_scheduler(name: str, params: dict[str, Any], optimizer: Optimizer) -> Any:
    cls = getattr(torch.optim.lr_scheduler, name, None)
    if not isinstance(cls, type):
        raise DsrunConfigError(f'scheduler.type "{name}": torch {torch.__version__} has no '
                               f"torch.optim.lr_scheduler.{name}")
    where = f"scheduler.params for {name} (torch.optim.lr_scheduler.{name})"
    signature = inspect.signature(cls.__init__).parameters
    valid = [key for key, p in signature.items() if key not in ("self", "optimizer")
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unknown = [key for key in params if key not in valid]
    if unknown:
        named = ", ".join(f'"{key}"{did_you_mean(key, valid)}' for key in unknown)
        raise DsrunConfigError(f"unknown parameter(s) {named} in {where}; valid: "
                               f"{', '.join(valid)}")
    missing = [key for key in valid if signature[key].default is inspect.Parameter.empty
               and key not in params]
    if missing:
        raise DsrunConfigError(f"{where} needs " + ", ".join(f'"{key}"' for key in missing))
    try:
        return cls(optimizer, **params)
    except (TypeError, ValueError) as err:
        raise DsrunConfigError(f"{where}: torch rejected {params}: {err}") from err


@functools.lru_cache(maxsize=256)
def _method_signature(func: Any) -> Optional[inspect.Signature]:
    """The signature of a ``step`` method's function without ``self`` and
    without its return annotation (cached: the engine asks every step)."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    return signature.replace(parameters=list(signature.parameters.values())[1:],
                             return_annotation=inspect.Signature.empty)


def _step_signature(scheduler: Any) -> Optional[inspect.Signature]:
    """``scheduler.step``'s signature as called (None: no ``step``, or none to read)."""
    step = getattr(scheduler, "step", None)
    if step is None:
        return None
    func = getattr(step, "__func__", None)
    if func is not None and getattr(step, "__self__", None) is scheduler:
        return _method_signature(func)
    try:  # a function set on the instance, a partial, a builtin
        return inspect.signature(step).replace(return_annotation=inspect.Signature.empty)
    except (TypeError, ValueError):
        return None


def _required_step_parameters(scheduler: Any) -> Optional[list[str]]:
    """Names of the parameters ``scheduler.step()`` requires (None: no
    ``step`` or no signature to read)."""
    signature = _step_signature(scheduler)
    if signature is None:
        return None
    return [p.name for p in signature.parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def needs_metric(scheduler: Any) -> bool:
    """True for a plateau scheduler, whose ``step()`` needs a metric (torch's
    ReduceLROnPlateau, or a first required parameter named ``metrics`` /
    ``metric``): the engine cannot step it without ``lr_kwargs``."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return True
    required = _required_step_parameters(scheduler)
    return bool(required) and required[0] in ("metrics", "metric")


def takes_an_argument(scheduler: Any) -> bool:
    """True when ``scheduler.step()`` requires an argument that is not a
    metric: the engine then passes ``train_batch_size``."""
    return bool(_required_step_parameters(scheduler)) and not needs_metric(scheduler)


def scheduler_step_args(scheduler: Any, lr_kwargs: Optional[Mapping[str, Any]],
                        train_batch_size: int) -> Optional[tuple[tuple[Any, ...], dict[str, Any]]]:
    """``(args, kwargs)`` for the engine's ``scheduler.step`` after an applied
    optimizer step, or None to leave it alone: ``lr_kwargs`` when given
    (refused here, before the optimizer step, when ``step()`` does not take
    them); else no arguments; else, for a plateau scheduler, None; else
    ``train_batch_size``, DeepSpeed's fallback for a ``step(increment)`` such
    as Megatron's ``OptimizerParamScheduler``."""
    if scheduler is None:
        return None
    kwargs = dict(lr_kwargs or {})
    signature = _step_signature(scheduler)
    if signature is None:
        return (), kwargs
    try:
        signature.bind(**kwargs)
        return (), kwargs
    except TypeError as err:
        if kwargs:
            raise DsrunError(f"engine.step(lr_kwargs={kwargs}): {type(scheduler).__name__}."
                             f"step{signature} does not take them ({err}); nothing was "
                             "stepped") from None
    if needs_metric(scheduler):
        return None
    reason = needs_lr_kwargs(scheduler)
    if reason:
        raise DsrunError(f"engine.step(): {reason}; pass them as engine.step(lr_kwargs="
                         "{...}); nothing was stepped")
    return (train_batch_size,), {}


def needs_lr_kwargs(scheduler: Any) -> Optional[str]:
    """Why the engine cannot step ``scheduler`` without ``lr_kwargs`` - its
    ``step()`` needs more than the one argument DeepSpeed gives it, or
    keyword-only ones - else None (a plateau scheduler is simply left alone)."""
    signature = _step_signature(scheduler)
    if signature is None or needs_metric(scheduler):
        return None
    for args in ((), (1,)):
        try:
            signature.bind(*args)
            return None
        except TypeError as err:
            problem = err
    return (f"{type(scheduler).__name__}.step{signature} needs arguments the engine cannot "
            f"give ({problem})")
