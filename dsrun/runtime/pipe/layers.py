"""Layer specifications: a layer described on every rank, built on one stage.

``LayerSpec(cls, *args, **kwargs)`` stands for ``cls(*args, **kwargs)``;
:class:`~dsrun.runtime.pipe.module.PipelineModule` calls :meth:`LayerSpec.build`
only on the stage that owns the layer, so a model too big for one process
is never built whole. ``TiedLayerSpec(key, cls, ...)`` is a layer whose
module is shared by every spec with the same ``key``: one module per stage
that uses the key, whose parameters are kept identical across those stages
(the classic case: the input embedding tied to the output projection;
``forward_fn(module, x)`` lets the second use compute something else with
the same weights).

:func:`count_parameters` sizes a spec without allocating it (a build on
torch's ``meta`` device), for the ``"parameters"`` partition method.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

import torch
from torch.overrides import TorchFunctionMode

from dsrun.errors import DsrunConfigError
from dsrun.runtime.pipe.errors import PipeConfigRuntimeError, PipeTypeError

log = logging.getLogger(__name__)


class LayerSpec:
    """``cls(*args, **kwargs)``, built later (module docstring)."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not isinstance(typename, type) or not issubclass(typename, torch.nn.Module):
            # DeepSpeed's classes: issubclass() fails on a non-class, its own check after
            error = PipeConfigRuntimeError if isinstance(typename, type) else PipeTypeError
            raise error(f"LayerSpec needs a torch.nn.Module subclass as its first argument, "
                        f"got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> torch.nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    @property
    def name(self) -> str:
        return self.typename.__name__

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args]
        args += [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{type(self).__name__}({self.name}, {', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by all specs with this ``key``.

    ``tied_weight_attr``: the attribute name(s) of the tied parameters, as
    in DeepSpeed (checked to exist). dsrun keeps *every* parameter of the
    tied module identical across its stages - gradients summed, the same
    update - so that one name always holds one value. ``forward_fn(module,
    x)``, when given, replaces ``module(x)`` for this use.
    """

    def __init__(self, key: str, typename: type, *module_args: Any,
                 forward_fn: Optional[Callable[[torch.nn.Module, Any], Any]] = None,
                 tied_weight_attr: Union[str, Sequence[str]] = "weight",
                 **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key or "." in key:
            raise DsrunConfigError(f"TiedLayerSpec key must be a non-empty string without "
                                   f"dots, got {key!r}")
        if forward_fn is not None and not callable(forward_fn):
            raise DsrunConfigError(f"TiedLayerSpec {key!r}: forward_fn must be callable")
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else \
            list(tied_weight_attr)
        if not attrs or not all(isinstance(a, str) and a for a in attrs):
            raise DsrunConfigError(f"TiedLayerSpec {key!r}: tied_weight_attr must be a "
                                   f"name or a list of names, got {tied_weight_attr!r}")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = tuple(attrs)

    def check_attrs(self, module: torch.nn.Module) -> None:
        """The named tied attributes exist and are parameters."""
        for attr in self.tied_weight_attr:
            value: Any = module
            for part in attr.split("."):
                value = getattr(value, part, None)
            if not isinstance(value, torch.nn.Parameter):
                raise DsrunConfigError(f"TiedLayerSpec {self.key!r}: {self.name} has no "
                                       f"parameter {attr!r} (tied_weight_attr)")


def layer_name(layer: Any) -> str:
    """The class name partitioning by ``type:REGEX`` matches against."""
    if isinstance(layer, LayerSpec):
        return layer.name
    if isinstance(layer, torch.nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def count_parameters(layer: Any) -> int:
    """Trainable parameters of a spec, module or function (0)."""
    if isinstance(layer, torch.nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    if not isinstance(layer, LayerSpec):
        return 0
    module = build_on_meta(layer)
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


class _SkipMetaInit(TorchFunctionMode):
    """Weight initialisation on meta tensors as a no-op: there is no data to
    fill, and torch's meta kernels for some of it (``normal_``) are Python
    references whose first use imports ``torch._dynamo``, ~2 s per process."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _INIT_OPS:
            # a Tensor method, or torch.nn.init's function (tensor= keyword)
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target  # in place and elementwise: shape, dtype and strides stay
        return func(*args, **kwargs)


_INIT_OPS = frozenset({"normal_", "uniform_", "random_", "bernoulli_", "exponential_",
                       "log_normal_", "cauchy_", "geometric_", "zero_", "fill_", "erfinv_",
                       "mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_", "clamp_max_"})


def build_on_meta(spec: LayerSpec) -> torch.nn.Module:
    """``spec.build()`` on torch's meta device (no memory, no initialisation);
    on the CPU, moved to meta after, where the constructor needs real
    tensors."""
    try:
        with torch.device("meta"), _SkipMetaInit():
            return spec.build()
    except Exception as exc:  # noqa: BLE001 - some constructors need real tensors
        log.debug("%r cannot be built on the meta device (%s); building it on the CPU",
                  spec, exc)
        return spec.build().to("meta")
