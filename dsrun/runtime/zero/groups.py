"""What both ZeRO optimizers take from the client and the config: param
groups (validated), the optimizer class (elementwise ones only), its
constructor arguments, the ``zero_optimization`` knobs of stages 1/2
(:class:`ZeroSettings`) and stage 3 (:class:`Stage3Settings`; the
top-level ``communication_data_type`` comes in as their ``comm_dtype``
override) and the per-rank state restore.

Optimizers whose update needs whole-tensor quantities (LAMB's trust ratio,
LARS, Adafactor's factored moments, LBFGS) would silently change meaning on
flat partitions: they are rejected (:data:`UNSHARDABLE_OPTIMIZERS`). Any
other class outside :func:`elementwise_optimizers` - known to update each
element from its own gradient and state alone - needs
``zero_allow_untested_optimizer`` (:func:`check_tested_optimizer`), as in
DeepSpeed.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.optim import Optimizer

from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.runtime.zero.comm import CommStrategy
from dsrun.runtime.zero.divergence import GuardSettings
from dsrun.runtime.zero.offload import offload_settings

log = logging.getLogger(__name__)

UNSHARDABLE_OPTIMIZERS = ("Lamb", "FusedLamb", "LAMB", "Lars", "LARS", "FusedLars",
                          "Adafactor", "LBFGS", "SparseAdam", "Muon", "Shampoo")


@dataclass(frozen=True)
class ZeroSettings:
    """The ``zero_optimization`` knobs stages 1/2 use (sizes in elements).

    ``reduce_scatter`` False forces all-reduce for every gradient reduction
    (DeepSpeed's meaning); ``strategy`` overrides the per-backend choice of
    :mod:`~.comm`; ``comm_dtype`` None reduces in the parameters' dtype;
    ``alignment`` pads partitions to a multiple of it (elements);
    ``offload_optimizer`` keeps masters, their gradients and the optimizer
    state in host memory and steps there (:mod:`~.offload`), with
    ``pin_memory``; ``sub_group_size``: the inner optimizer steps at most
    this many elements per tensor (None: as :func:`~.masters.piece_size`
    decides). ``allgather_bucket_size`` is accepted for DeepSpeed configs
    and unused: the updated partitions are gathered in place, with no
    scratch buffer to bound.
    """

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    alignment: int = 1
    comm_dtype: Optional[torch.dtype] = None
    strategy: Optional[CommStrategy] = None
    offload_optimizer: bool = False
    pin_memory: bool = False
    sub_group_size: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("reduce_bucket_size", "allgather_bucket_size", "alignment",
                     "sub_group_size"):
            value = getattr(self, name)
            if name == "sub_group_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DsrunConfigError(f"zero_optimization.{name} must be a positive integer, "
                                       f"got {value!r}")

    @classmethod
    def from_config(cls, zero: Any, **overrides: Any) -> ZeroSettings:
        """From a ``ZeroConfig`` (or anything with the same attribute names)."""
        names = ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
                 "contiguous_gradients", "reduce_scatter", "sub_group_size")
        return cls(**{**settings_values(zero, names, offload_param=False), **overrides})

    def comm_strategy(self) -> Optional[CommStrategy]:
        return comm_strategy(self.reduce_scatter, self.strategy)


DEEPSPEED_DEFAULT_SUB_GROUP = 1_000_000_000  # elements
DEEPSPEED_DEFAULT_REUSE_DISTANCE = 1_000_000_000  # elements: stage3_max_reuse_distance


def settings_values(zero: Any, names: Sequence[str], *, offload_param: bool) -> dict[str, Any]:
    """The ``names`` a ``ZeroConfig`` (or anything with its attribute names)
    sets, plus its offload sections (``offload_param`` too at stage 3).
    DeepSpeed's default ``sub_group_size`` (1e9: step each partition whole)
    and 0 count as unset: dsrun picks pieces by implementation and device;
    so does DeepSpeed's default ``max_reuse_distance`` (1e9): dsrun's
    releases after use."""
    values = {n: getattr(zero, n) for n in names if getattr(zero, n, None) is not None}
    if values.get("sub_group_size") in (DEEPSPEED_DEFAULT_SUB_GROUP, 0):
        del values["sub_group_size"]
    if values.get("max_reuse_distance") == DEEPSPEED_DEFAULT_REUSE_DISTANCE:
        del values["max_reuse_distance"]
    values.update(offload_settings(zero, param=offload_param))
    return values


def comm_strategy(reduce_scatter: bool, strategy: Optional[CommStrategy]
                  ) -> Optional[CommStrategy]:
    """``strategy`` (None: the backend's), or with ``reduce_scatter`` False
    an all-reduce for every gradient reduction (DeepSpeed's meaning)."""
    if reduce_scatter:
        return strategy
    gather = (strategy or CommStrategy()).gather
    return CommStrategy(reduce="all_reduce", owner_reduce="all_reduce", gather=gather)


def check_not_stepped(optimizer: Optimizer, where: str) -> None:
    """ZeRO rebuilds a client optimizer over its partitions, so it must not
    have stepped (its state would be lost), nor be stepping for another
    ZeRO optimizer already (:func:`take_over`). State an optimizer creates in its
    constructor (Adagrad's ``sum`` and zero ``step``) is not stepping - the
    rebuilt optimizer creates it again - so only a state with a nonzero
    ``step``, or without one (SGD's momentum, made by the first step), is."""
    if getattr(optimizer, TAKEN_OVER, False):
        raise DsrunConfigError("this optimizer already steps for a ZeRO engine built before "
                               "(its param groups hold that engine's partitions, as in "
                               "DeepSpeed): build a new optimizer for each engine")
    for state in optimizer.state.values():
        step = state.get("step")
        if step is None or float(step) != 0:
            raise DsrunConfigError("pass an optimizer that has not stepped yet: ZeRO rebuilds "
                                   f"it over this rank's {where} and would drop its state")


# Instance attributes of the client's optimizer that stay its own when it
# takes over the rebuilt one's: what the script (or an LR scheduler built
# over it) attached - hooks, torch's step wrapper, its step-called flag.
_CLIENT_OWNED = ("step", "_opt_called")
TAKEN_OVER = "_dsrun_zero_inner"  # set on a client optimizer once a ZeRO optimizer steps it


def take_over(client: Optimizer, built: Optimizer) -> Optimizer:
    """Make the script's ``client`` optimizer object the one that steps, as
    DeepSpeed does (its ZeRO optimizers keep the client's object, with the
    params of each group swapped for flat partitions): ``client`` gets
    ``built``'s state, defaults and constructor-made attributes, and its own
    param-group dicts - the very ones the script may hold - get ``built``'s
    entries (partition params, hyperparameters, the implementation dsrun
    picked). So ``for g in optimizer.param_groups: g["lr"] = ...`` on the
    script's object, an LR scheduler built over it (its ``step`` wrapper
    stays, and is what runs) and hooks registered on it all act on the real
    step. ``built`` (same class, built over the partitions) is discarded;
    its group ``i`` is ``client``'s group ``i``."""
    if len(client.param_groups) != len(built.param_groups):  # pragma: no cover - invariant
        raise DsrunError(f"{len(client.param_groups)} client param groups, "
                         f"{len(built.param_groups)} rebuilt")
    for mine, theirs in zip(client.param_groups, built.param_groups):
        mine.clear()
        mine.update(theirs)
    for name, value in vars(built).items():
        if name == "param_groups" or name in _CLIENT_OWNED or name.startswith("_optimizer_"):
            continue  # the hook registries ("_optimizer_*_hooks") stay the client's
        setattr(client, name, value)
    setattr(client, TAKEN_OVER, True)
    return client


def _normalise_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """torch.optim's accepted forms -> list of dicts with a ``params`` list."""
    items = list(params)
    if not items:
        raise DsrunConfigError("ZeroOptimizer got an empty parameter list")
    if not isinstance(items[0], Mapping):
        items = [{"params": items}]
    groups = []
    for g, item in enumerate(items):
        if not isinstance(item, Mapping) or "params" not in item:
            raise DsrunConfigError(f"param group {g} must be a dict with 'params'")
        tensors = item["params"]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        groups.append({**item, "params": tensors})
    return groups


def _check_params(groups: Sequence[Mapping[str, Any]]) -> Optional[torch.Tensor]:
    """Every tensor appears once; trainable ones share dtype and device and
    are contiguous, dense leaves. Returns one trainable tensor (or None)."""
    seen: set[int] = set()
    first: Optional[torch.Tensor] = None
    for g, group in enumerate(groups):
        for i, p in enumerate(group["params"]):
            where = f"param group {g}, parameter {i} (shape {tuple(p.shape)})"
            if id(p) in seen:
                raise DsrunConfigError(f"{where} appears in more than one place")
            seen.add(id(p))
            if not p.requires_grad:
                continue
            if p.is_sparse or not p.is_contiguous() or not p.is_leaf:
                raise DsrunConfigError(f"{where}: ZeRO needs dense, contiguous leaf tensors")
            first = p if first is None else first
            if (p.dtype, p.device) != (first.dtype, first.device):
                raise DsrunConfigError(f"{where} is {p.dtype} on {p.device}, the first "
                                       f"trainable one {first.dtype} on {first.device}: "
                                       "ZeRO stages 1/2 need one dtype and device")
    return first


def _check_optimizer_cls(optimizer_cls: type, stage: int) -> None:
    names = {k.__name__ for k in getattr(optimizer_cls, "__mro__", (optimizer_cls,))}
    bad = names.intersection(UNSHARDABLE_OPTIMIZERS)
    if bad:
        raise DsrunConfigError(
            f"optimizer {optimizer_cls.__name__} needs whole-tensor quantities (norms or "
            f"shapes) that a flat ZeRO partition does not have: it cannot run at ZeRO stage "
            f"{stage}; use stage 0, or an elementwise optimizer (Adam, AdamW, SGD, ...)")


@functools.lru_cache(maxsize=1)
def elementwise_optimizers() -> tuple[type, ...]:
    """Optimizer classes whose update is elementwise (each element steps from
    its own gradient and state, with per-tensor scalars such as the step
    count only), so that stepping a flat partition equals stepping whole
    tensors: DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS (torch's Adam, AdamW and
    Adagrad, FusedAdam, the CPU Adam/Adagrad/Lion ops, FusedLion) and the
    other elementwise classes a dsrun config builds (torch's SGD, RMSprop,
    Adamax, NAdam, RAdam, Adadelta, ASGD and Rprop, dsrun's Lion). Exact
    classes, as DeepSpeed checks them: a subclass may change the update."""
    from dsrun.ops.adagrad import DeepSpeedCPUAdagrad  # the ops import the ZeRO modules
    from dsrun.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from dsrun.ops.lion import DeepSpeedCPULion, FusedLion
    from dsrun.runtime.optimizers import Lion

    names = ("Adam", "AdamW", "Adagrad", "SGD", "RMSprop", "Adamax", "NAdam", "RAdam",
             "Adadelta", "ASGD", "Rprop")
    return (*(getattr(torch.optim, n) for n in names), FusedAdam, DeepSpeedCPUAdam,
            DeepSpeedCPUAdagrad, DeepSpeedCPULion, FusedLion, Lion)


def check_tested_optimizer(optimizer_cls: type, stage: int, allow_untested: bool,
                           source: str) -> None:
    """At ZeRO ``stage``: refuse an optimizer class that cannot step
    partitions (:data:`UNSHARDABLE_OPTIMIZERS`); one that is not known to be
    elementwise needs ``allow_untested`` (``zero_allow_untested_optimizer``
    in ``source``), and then gets DeepSpeed's warning."""
    _check_optimizer_cls(optimizer_cls, stage)
    if optimizer_cls in elementwise_optimizers():
        return
    name = f"{optimizer_cls.__module__}.{optimizer_cls.__qualname__}"
    detail = (f"ZeRO stage {stage} steps it on each rank's flat partition of the parameters, "
              "which equals stepping whole tensors only if its update is elementwise (no "
              "per-tensor norms, shapes or sums)")
    if not allow_untested:
        known = ", ".join(sorted({c.__name__ for c in elementwise_optimizers()}))
        raise DsrunConfigError(
            f"optimizer {name} is an untested ZeRO optimizer: add "
            f'"zero_allow_untested_optimizer": true to {source} to use it (as DeepSpeed '
            f"asks). {detail}; the known elementwise ones are {known}")
    log.warning("**** You are using ZeRO with an untested optimizer (%s), proceed with "
                "caution: %s *****", name, detail)


def _constructor_kwargs(optimizer_cls: type, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` that ``optimizer_cls(params, **kwargs)`` accepts."""
    try:
        signature = inspect.signature(optimizer_cls.__init__)
    except (TypeError, ValueError):
        return dict(defaults)
    accepted = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in accepted and k != "params"}


def restore_partition_state(state: Mapping[str, Any], numels_key: str, numels: list[int],
                            world_size: int, rank: int, masters: Sequence[torch.Tensor],
                            optimizer: Optimizer) -> None:
    """Load a per-rank state dict (masters + inner optimizer) saved by the
    same rank with the same partitioning; anything else is an error."""
    if (state["world_size"], state["rank"], list(state[numels_key])) != \
            (world_size, rank, numels):
        raise DsrunError(f"ZeRO stage {state.get('zero_stage', '?')} state of a different "
                         f"partitioning: world size {state['world_size']} rank "
                         f"{state['rank']} vs {world_size} rank {rank}")
    with torch.no_grad():
        for master, saved in zip(masters, state["masters"]):
            master.copy_(saved)
    optimizer.load_state_dict(state["optimizer"])


@dataclass(frozen=True)
class Stage3Settings:
    """The ``zero_optimization`` knobs stage 3 uses (sizes in elements).

    ``guard`` None reads ``DSRUN_ZERO_DEBUG``/``DSRUN_ZERO_TIMEOUT`` and
    shares the process-wide guard of the group (with ``zero.Init`` and
    ``GatheredParameters``); settings of its own give this optimizer its
    own guard. ``reduce_scatter`` False forces all-reduce for gradients.
    ``max_reuse_distance`` keeps parameters from forward to backward
    (:mod:`~.fetch`); DeepSpeed's default (1e9, also what HF's example
    configs write) counts as unset: 0, release after use.
    ``offload_optimizer`` keeps masters, their gradients and the optimizer
    state in host memory and steps there; ``offload_param`` keeps the
    shards there (:mod:`~.offload`); ``sub_group_size``: the inner
    optimizer steps at most this many elements per tensor (:mod:`~.masters`).
    """

    reduce_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 0
    param_persistence_threshold: int = 100_000
    overlap_comm: bool = True
    reduce_scatter: bool = True
    memory_efficient_linear: bool = True
    alignment: int = 1
    comm_dtype: Optional[torch.dtype] = None
    strategy: Optional[CommStrategy] = None
    guard: Optional[GuardSettings] = None
    offload_optimizer: bool = False
    offload_param: bool = False
    pin_memory: bool = False
    sub_group_size: Optional[int] = None

    def __post_init__(self) -> None:
        for name, low in (("reduce_bucket_size", 1), ("prefetch_bucket_size", 0),
                          ("max_live_parameters", 0), ("max_reuse_distance", 0),
                          ("param_persistence_threshold", 0),
                          ("alignment", 1), ("sub_group_size", 1)):
            value = getattr(self, name)
            if name == "sub_group_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise DsrunConfigError(f"zero_optimization.{name} must be an integer >= {low}, "
                                       f"got {value!r}")

    @classmethod
    def from_config(cls, zero: Any, **overrides: Any) -> Stage3Settings:
        """From a ``ZeroConfig`` (or anything with its attribute names)."""
        names = ("reduce_bucket_size", "prefetch_bucket_size", "max_live_parameters",
                 "max_reuse_distance", "param_persistence_threshold", "overlap_comm",
                 "reduce_scatter", "memory_efficient_linear", "sub_group_size")
        return cls(**{**settings_values(zero, names, offload_param=True), **overrides})

    def comm_strategy(self) -> Optional[CommStrategy]:
        return comm_strategy(self.reduce_scatter, self.strategy)
