"""``zero.Init``, with DeepSpeed's names and arguments.

**Init.** Without a process group, :class:`Init` starts one
(``init_distributed()``), as DeepSpeed's does. While an :class:`Init`
context is open, the ``__init__`` of every ``torch.nn.Module`` subclass
(those that exist when it opens, and those defined inside it, through
``Module.__init_subclass__``) is wrapped: when the *outermost* ``__init__``
of a module object returns, the module's parameters that are not
partitioned yet - its own, its children's are already - get group rank
0's values (broadcast) and are partitioned
(:func:`~.partitioned.partition_param`). A model is thus never whole on a
rank: the transient is one module's own parameters (e.g. one ``Linear``'s
weight and bias) plus a broadcast of them, not the model. Values equal a
model built whole on rank 0 with the same seed (partitioning draws no random
numbers). Wrappers are removed when the last context closes; classes defined
inside keep a wrapper that does nothing outside a context.

Buffers are not partitioned; their dtype under a 16-bit Init is
DeepSpeed's (:mod:`~dsrun.runtime.buffer_dtypes`), set when the outermost
module built in the context is complete; the tensors the constructors
(``torch.zeros``, ``ones``, ``tensor``...) made that a module of it holds
as plain attributes take the Init dtype then too
(:func:`cast_new_attributes`). DeepSpeed's Init makes *every* floating
tensor those constructors return in the context 16-bit as it is made; dsrun
leaves the others as made - a tensor made in the ``with`` block outside
every module, one a module keeps in a list, and the intermediates of a
module's ``__init__`` (``torch.ones(n) * 2``) stay fp32 - so that parameters
are initialised in fp32 and rounded once, the buffers kept in fp32 are
never rounded, and code that runs in the block outside a module
(``GatheredParameters``, ``dsrun.initialize``) makes the dtypes it asks
for.

``Module.apply(fn)`` called inside the context (a parent's
``self.apply(init_weights)``, as HF models do after building their children)
runs ``fn`` on each module with that module's parameters gathered and
keeps rank 0's result. Other initialisation a parent does to a child's
parameters after the child's ``__init__`` returned writes the parameters
kept whole - at most ``stage3_param_persistence_threshold`` elements, or
any at world size 1 - and initialize() takes group rank 0's values of them
(:mod:`~.whole_edits`). On a released parameter the ``torch.nn.init``
writes (``nn.MultiheadAttention`` zeroing ``out_proj.bias``: ``fill_``,
``zero_``, ``normal_``, ``uniform_``...) run on it gathered, rank 0's result
kept (:func:`_write_gathered`, :mod:`~.released`), so the model equals
plain torch's; code that reshapes, views or copies into a released
parameter - the old ``torch.nn.utils.spectral_norm`` applied to a built
child, weights copied in (do that under
``GatheredParameters(params, modifier_rank=0)``) - is refused, naming the
module being built. A parent that deep-copies a built child
(``nn.TransformerEncoder`` cloning its layer) gets partitioned copies with
the child's values, as does ``copy.deepcopy(model)`` in the ``with`` block
(:mod:`~.param_copy`).

``GatheredParameters``, ``register_external_parameter`` and
``unregister_external_parameter`` live in :mod:`~.gathered` and are
re-exported here.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.runtime.buffer_dtypes import CASTABLE, ConstructorTags, cast_new_buffers
from dsrun.runtime.config_schema import Ctx, parse_section
from dsrun.runtime.config_sections import (
    KEEP_IN_FP32_AUTO,
    DataTypesConfig,
    ZeroConfig,
    parse_zero,
)
from dsrun.runtime.dist import compute_device, init_distributed
from dsrun.runtime.zero.divergence import shared_guard
from dsrun.runtime.zero.gathered import (
    GatheredParameters,
    register_external_parameter,
    unregister_external_parameter,
)
from dsrun.runtime.zero.partitioned import (
    broadcast_full,
    is_zero_param,
    offload_shard,
    partition_param,
)
from dsrun.runtime.zero.released import ReleasedParameterError, set_init_write
from dsrun.runtime.zero.stage3_plan import is_persistent

__all__ = ["ConfigSettings", "GatheredParameters", "Init", "InitSettings", "partition_module",
           "register_external_parameter", "settings_from_config",
           "unregister_external_parameter"]


@dataclass(frozen=True)
class InitSettings:
    """How :class:`Init` partitions: over ``group``, keeping parameters of at
    most ``persistence_threshold`` elements whole; optional dtype/device
    applied to each parameter before it is partitioned; ``keep_in_fp32``:
    ``data_types.keep_in_fp32_modules`` (module docstring)."""

    group: Any = None
    persistence_threshold: int = ZeroConfig().param_persistence_threshold
    alignment: int = 1
    dtype: Optional[torch.dtype] = None
    device: Optional[torch.device] = None
    offload: bool = False
    pin_memory: bool = False
    keep_in_fp32: Any = KEEP_IN_FP32_AUTO

    def __post_init__(self) -> None:
        if isinstance(self.persistence_threshold, bool) or self.persistence_threshold < 0:
            raise DsrunConfigError("stage3_param_persistence_threshold must be >= 0, got "
                                   f"{self.persistence_threshold!r}")


@dataclass(frozen=True)
class ConfigSettings:
    """What ``zero.Init`` takes from a DeepSpeed config: the persistence
    threshold, the parameter dtype (fp16/bf16 sections, else fp32), the
    ``offload_param`` section's device (None: none or "none") and
    ``pin_memory``, and ``data_types.keep_in_fp32_modules``, as DeepSpeed's
    Init does when given a config."""

    persistence_threshold: int
    dtype: Optional[torch.dtype] = None
    remote_device: Optional[str] = None
    pin_memory: bool = False
    keep_in_fp32: Any = KEEP_IN_FP32_AUTO


def settings_from_config(config: Any) -> ConfigSettings:
    """:class:`ConfigSettings` from a DeepSpeed config dict, a JSON path or a
    resolved DsrunConfig (None: DeepSpeed's defaults)."""
    if config is None:
        return ConfigSettings(ZeroConfig().param_persistence_threshold)
    if hasattr(config, "zero_optimization"):
        zero, types = config.zero_optimization, config.data_types
        fp16, bf16 = config.fp16.enabled, config.bf16.enabled
    else:
        from dsrun.runtime.config import load_config

        raw, source = load_config(config)
        ctx = Ctx(source, allow_unknown=True)
        zero = parse_zero(raw.get("zero_optimization", {}), ctx)
        types = parse_section(DataTypesConfig, raw.get("data_types", {}), ("data_types",), ctx)
        fp16 = _enabled(raw.get("fp16"))
        bf16 = _enabled(raw.get("bf16", raw.get("bfloat16")))
    # as DeepSpeed's Init given a config: neither fp16 nor bf16 means fp32, so
    # a model made in bf16 (from_pretrained(torch_dtype=...)) trains in fp32
    dtype = torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32
    section = getattr(zero, "offload_param", None)
    device = getattr(section, "device", None)
    return ConfigSettings(zero.param_persistence_threshold, dtype,
                          None if device in (None, "none") else device,
                          bool(getattr(section, "pin_memory", False)),
                          types.keep_in_fp32_modules)


def _enabled(section: Any) -> bool:
    return isinstance(section, Mapping) and section.get("enabled") is True


def partition_module(module: torch.nn.Module, settings: InitSettings) -> None:
    """Partition ``module``'s parameters that are not partitioned yet, with
    group rank 0's values (collective over ``settings.group``)."""
    names = {id(p): n for n, p in module.named_parameters()}
    params = [p for p in dict.fromkeys(module.parameters()) if not is_zero_param(p)]
    if not params:
        return
    with torch.no_grad():
        for p in params:
            if settings.device is not None and p.device != settings.device:
                p.data = p.data.to(settings.device)
            if settings.dtype is not None and p.is_floating_point():
                p.data = p.data.to(settings.dtype)
    world = dist.get_world_size(settings.group)
    if world > 1:
        shared_guard(settings.group).event("init", type(module).__name__, [],
                                           [p.numel() for p in params])
    broadcast_full(params, settings.group)
    owner = type(module).__name__
    for p in params:
        partition_param(p, group=settings.group, alignment=settings.alignment,
                        persist=is_persistent(p.numel(), settings.persistence_threshold, world,
                                              settings.offload),
                        name=f"{owner}.{names.get(id(p), '?')}")
        if settings.offload:
            offload_shard(p, settings.pin_memory)


# ----------------------------------------------------------- Init patching

_stack: list[InitSettings] = []
_depth: dict[int, int] = {}
_patched: list[tuple[type, Callable[..., None]]] = []
_tags = ConstructorTags()  # the floating tensors torch's constructors made in the context


def _partitioning_init(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def wrapper(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        if not _stack:
            return init(self, *args, **kwargs)
        key = id(self)
        _depth[key] = _depth.get(key, 0) + 1
        try:
            init(self, *args, **kwargs)
        except ReleasedParameterError as err:
            raise _built_too_early(self, err) from None
        finally:
            _depth[key] -= 1
            outermost = _depth[key] == 0
            if outermost:
                del _depth[key]
        if outermost and _stack:
            partition_module(self, _stack[-1])
            if not _depth:  # no module is being built around this one: a whole model
                settings = _stack[-1]
                cast_new_buffers(self, _tags, settings.dtype, settings.keep_in_fp32)
                cast_new_attributes(self, settings.dtype)
        return None

    wrapper._dsrun_zero_init = True  # type: ignore[attr-defined]
    return wrapper


def _built_too_early(module: torch.nn.Module, err: ReleasedParameterError
                     ) -> ReleasedParameterError:
    """``err`` (a released parameter's data read in ``module.__init__``, e.g.
    by the old ``spectral_norm``) with what it means under :class:`Init`,
    said once (the innermost ``__init__`` that raised it)."""
    if getattr(err, "_dsrun_init_said", False):
        return err
    name = type(module).__name__
    said = ReleasedParameterError(
        f"zero.Init: {name}.__init__: {getattr(err, 'what', err)}, which is partitioned "
        "already: under zero.Init each module's parameters are partitioned - and released, "
        "this rank keeps only its shard - when that module's own __init__ returns, so code "
        "that works on a built module's parameters afterwards (the old "
        "torch.nn.utils.spectral_norm or weight_norm) would see no data. Build "
        f"{name} outside zero.Init and let initialize() or zero.Init(module=model) partition "
        "it; torch.nn.utils.parametrizations.spectral_norm is the newer API (to apply "
        "outside zero.Init as well)")
    said._dsrun_init_said = True  # type: ignore[attr-defined]
    return said


@torch.no_grad()
def cast_new_attributes(model: torch.nn.Module, dtype: Optional[torch.dtype]) -> None:
    """The floating tensors the constructors made in the context that
    ``model``'s modules hold as plain attributes (``self.scale =
    torch.ones(d)``, neither parameter nor buffer) become ``dtype``, as
    DeepSpeed makes them at construction (module docstring)."""
    if dtype is None:
        return
    for module in model.modules():
        for value in list(vars(module).values()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) \
                    and value.dtype in CASTABLE and value.dtype != dtype and _tags.take(value):
                value.data = value.data.to(dtype)


def _wrap_class(cls: type) -> None:
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "_dsrun_zero_init", False):
        return
    cls.__init__ = _partitioning_init(init)  # type: ignore[misc]
    _patched.append((cls, init))


def _subclasses(cls: type) -> list[type]:
    out, todo = [cls], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.append(sub)
                todo.append(sub)
    return out


def _on_subclass(cls: type, **kwargs: Any) -> None:
    super(torch.nn.Module, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
    if _stack:
        _wrap_class(cls)


def _gathering_apply(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Module.apply`` that runs ``fn`` on each module with the module's
    partitioned parameters gathered, rank 0's result kept (as DeepSpeed's
    ``override_module_apply``): a parent's ``self.apply(init_weights)``
    then initialises children that are partitioned already."""

    @functools.wraps(original)
    def apply(self: torch.nn.Module, fn: Callable[[torch.nn.Module], None]) -> Any:
        if not _stack or getattr(fn, "_dsrun_gathered", False):
            return original(self, fn)

        def gathered(module: torch.nn.Module) -> None:
            params = [p for p in module.parameters(recurse=False) if is_zero_param(p)]
            with GatheredParameters(params, modifier_rank=0):
                fn(module)

        gathered._dsrun_gathered = True  # type: ignore[attr-defined]
        return original(self, gathered)

    return apply


_original_apply = torch.nn.Module.apply


def _write_gathered(param: torch.Tensor, apply: Callable[[], Any]) -> Any:
    """An in-place write to a released ``param`` while a context is open:
    ``apply()`` on the whole parameter on every rank, group rank 0's result
    kept, as :func:`_gathering_apply` does for ``Module.apply(fn)`` (every
    rank builds the same model, so every rank comes here in the same order)."""
    with GatheredParameters([param], modifier_rank=0):
        return apply()


def _patch() -> None:
    for cls in _subclasses(torch.nn.Module):
        _wrap_class(cls)
    torch.nn.Module.__init_subclass__ = classmethod(_on_subclass)  # type: ignore[assignment]
    torch.nn.Module.apply = _gathering_apply(_original_apply)  # type: ignore[method-assign]
    set_init_write(_write_gathered)
    _tags.install()


def _unpatch() -> None:
    while _patched:
        cls, init = _patched.pop()
        cls.__init__ = init  # type: ignore[misc]
    if "__init_subclass__" in torch.nn.Module.__dict__:
        del torch.nn.Module.__init_subclass__
    torch.nn.Module.apply = _original_apply  # type: ignore[method-assign]
    set_init_write(None)
    _depth.clear()
    _tags.remove()


def _init_device(remote_device: Optional[str]) -> tuple[Optional[torch.device], bool]:
    """(compute device, offload shards). DeepSpeed's default: this rank's GPU
    when it trains on one (an NCCL group); None on CPU ranks leaves parameters put;
    ``remote_device="cpu"`` keeps the shards in host memory - parameters are
    still broadcast and gathered on the GPU, which NCCL needs."""
    if remote_device not in (None, "none", "cpu"):
        raise DsrunConfigError(f"zero.Init: remote_device={remote_device!r}; dsrun supports "
                               "None, 'none' and 'cpu'")
    device = compute_device()
    if device.type == "cuda":
        return device, remote_device == "cpu"
    return None, False


def _ensure_group() -> None:
    """Start the default process group where none exists, as DeepSpeed's Init
    does: :func:`~dsrun.runtime.dist.init_distributed` takes the rank from the
    environment (dsrun, torchrun, MPI or Slurm; a lone process is world size 1)."""
    if dist.is_initialized():
        return
    try:
        init_distributed()
    except Exception as err:  # noqa: BLE001 - one error naming what zero.Init needed
        hint = "" if isinstance(err, DsrunError) else \
            " (start the script with dsrun or torchrun, or call dsrun.init_distributed() first)"
        raise DsrunError(f"zero.Init needs torch.distributed and could not start it: "
                         f"{err}{hint}") from err


class Init:
    """DeepSpeed's ``zero.Init`` (module docstring). Accepted and ignored:
    ``mem_efficient_linear``, ``sequence_data_parallel_group``;
    rejected when set: NVMe, quantized weights, hpZ/MiCS groups, swappers."""

    def __init__(self, module: Optional[torch.nn.Module] = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Optional[str] = None,
                 pin_memory: bool = False, config_dict_or_path: Any = None, config: Any = None,
                 enabled: bool = True, dtype: Optional[torch.dtype] = None, mpu: Any = None,
                 zero_param_parallel_group: Any = None, zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group: Any = None, param_swapper: Any = None) -> None:
        self.enabled = bool(enabled)
        if not self.enabled:
            return
        _ensure_group()
        unsupported = {"zero_param_parallel_group": zero_param_parallel_group is not None,
                       "zero_quantized_weights": zero_quantized_weights,
                       "zero_quantized_nontrainable_weights": zero_quantized_nontrainable_weights,
                       "param_swapper": param_swapper is not None,
                       "remote_device='nvme'": remote_device == "nvme"}
        bad = [name for name, used in unsupported.items() if used]
        if bad:
            raise DsrunConfigError(f"zero.Init: {', '.join(bad)} not supported by dsrun")
        if data_parallel_group is None and mpu is not None:
            data_parallel_group = mpu.get_data_parallel_group()
        found = settings_from_config(
            config_dict_or_path if config_dict_or_path is not None else config)
        if remote_device is None and found.remote_device is not None:
            # DeepSpeed's Init takes offload_param's device and pinning from the config
            remote_device, pin_memory = found.remote_device, pin_memory or found.pin_memory
        if remote_device == "nvme":
            raise DsrunConfigError("zero.Init: offload_param.device 'nvme' (from the config) "
                                   "is not supported by dsrun")
        device, offload = _init_device(remote_device)
        self.settings = InitSettings(data_parallel_group, found.persistence_threshold,
                                     dtype=dtype or found.dtype, device=device, offload=offload,
                                     pin_memory=bool(pin_memory), keep_in_fp32=found.keep_in_fp32)
        if module is not None:
            partition_module(module, self.settings)
            # built outside: no constructor made its buffers, only the kept ones change
            cast_new_buffers(module, _tags, self.settings.dtype, self.settings.keep_in_fp32)

    def __enter__(self) -> Init:
        if self.enabled:
            if not _stack:
                _patch()
            _stack.append(self.settings)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            _stack.remove(self.settings)
            if not _stack:
                _unpatch()
