"""The interface between what holds training state on a rank and the checkpoint.

A **state source** holds part of a model's training state on this rank:
the ZeRO optimizers (:class:`~dsrun.runtime.zero.sharded.ZeroOptimizer`,
:class:`~dsrun.runtime.zero.stage3.ZeroStage3`), the stage-0 path
(:class:`~dsrun.runtime.checkpoint.sources.Stage0State`) and the module's
parameters and buffers that no optimizer manages
(:class:`~dsrun.runtime.checkpoint.sources.ModuleTensors`). The checkpoint
package reads and writes state only through these three methods; it never
looks inside partitions, masters or inner optimizers::

    export_state(names) -> ExportedState                  # save: views, no copies
    prepare_import(names, state_keys) -> ImportPlan       # load: fresh buffers to fill
    finish_import(plan, groups, optimizer_states)         # load: install them (collective)

``names`` maps ``id(parameter)`` to the parameter's fully qualified name in
the module (``module.named_parameters()``, first name of a tied parameter).

**Save.** :meth:`export_state` returns an :class:`ExportedState`:

* ``tensors``: a :class:`TensorInfo` for every tensor the source is
  responsible for (its full logical shape, model dtype, kind, optimizer
  param group), whether or not this rank holds any of it;
* ``fragments``: what this rank holds. A :class:`Fragment` is a contiguous
  run ``[start, end)`` of one tensor's flattened elements (no padding),
  lying inside one inner-optimizer tensor, with ``value`` (a 1-D view: the
  fp32 master for a trained parameter, the tensor's own data otherwise),
  ``state`` (1-D views of the per-element optimizer state, e.g. Adam's
  ``exp_avg``/``exp_avg_sq``, each ``end - start`` long) and ``scalars``
  (the rest of that inner tensor's optimizer state, e.g. ``step``).
  ``replicated`` marks fragments that every rank of the source's
  ``replica`` group holds identically (stage 0, whole parameters, buffers):
  the writer stores each such element once, split among those ranks;
  ``volatile`` marks fragments that may change outside the optimizer step
  (buffers change in forward): an asynchronous save copies those before
  ``save_checkpoint`` returns and every other fragment in the background,
  before the next optimizer step;
* ``groups``: each optimizer param group's hyperparameters (no ``params``);
  ``optimizer``: the inner optimizer's class name.

The views stay valid until the next optimizer step; a synchronous save
writes straight from them, an asynchronous one copies them first.

**Load.** :meth:`prepare_import` returns an :class:`ImportPlan` whose
fragments name the ranges this rank needs (for a replicated tensor: all of
it) with *fresh* tensors to be filled: ``value`` in the dtype the source
wants, and, for each of ``state_keys``, a per-element buffer (``state_keys``
None: the optimizer state is not loaded). The loader fills every fragment
it has data for, sets ``loaded``, and ``scalars`` from the checkpoint; until
:meth:`finish_import` nothing of the source has changed, so a failed load
(a corrupt file, a missing tensor) leaves the engine as it was.
:meth:`finish_import` copies the values in (masters, shards, parameters),
installs the optimizer state and the groups' hyperparameters, and refreshes
the model's parameters (a collective for the ZeRO stages: every rank calls
it). Fragments not ``loaded`` (``load_module_strict=False`` skipped them)
keep their current values and optimizer state.

Between the read and :meth:`finish_import` the loader calls
``check_import(plan, groups, optimizer_states)`` on every source that has
it: it builds the optimizer state the load will install and checks that
the optimizer accepts it (:func:`check_state`), changing nothing. A failure
there is exchanged and raised on every rank before any source has changed
anything: :meth:`finish_import` is a collective and must not fail on some
ranks only. A trainable parameter the checkpoint has no optimizer state for
(frozen when it was saved) gets fresh optimizer state.

Per-element state is told from the rest by shape (:func:`per_element`): a
state tensor with dimensions has one value per element; so does a 0-d one
of a 0-d parameter (Adam's moments of ``nn.Parameter(torch.tensor(1.5))``),
except torch's per-tensor scalars (:data:`SCALAR_STATE`, e.g. ``step``).

The helpers at the bottom (:func:`split_state`, :func:`install_state`) are
what the sources share to move torch optimizer state in and out.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

KINDS = ("param", "buffer")
# param-group keys that say how the optimizer runs on this machine, not what
# it computes: never taken from a checkpoint
IMPLEMENTATION_KEYS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})
# torch optimizers' per-tensor state that is one number whatever the tensor's
# shape (Adam's step, NAdam's mu_product, ASGD's eta and mu): for a 0-d
# parameter it has the parameter's shape, like the per-element state
SCALAR_STATE = frozenset({"step", "mu_product", "eta", "mu"})


@dataclass(frozen=True)
class TensorInfo:
    """One tensor a source is responsible for. ``group`` is the optimizer
    param group index, None for a tensor no optimizer updates."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str = "param"
    group: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


@dataclass(frozen=True)
class Fragment:
    """Elements ``[start, end)`` of tensor ``name`` held by this rank (module docstring)."""

    name: str
    start: int
    end: int
    value: torch.Tensor
    state: Mapping[str, torch.Tensor] = field(default_factory=dict)
    scalars: Mapping[str, Any] = field(default_factory=dict)
    replicated: bool = False
    volatile: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"fragment of {self.name!r}: bad range [{self.start}, {self.end})")
        length = self.end - self.start
        for key, tensor in (("value", self.value), *self.state.items()):
            if tensor.dim() != 1 or tensor.numel() != length:
                raise ValueError(f"fragment of {self.name!r} [{self.start}, {self.end}): "
                                 f"{key} has shape {tuple(tensor.shape)}, want ({length},)")

    def narrowed(self, start: int, end: int) -> Fragment:
        """The sub-fragment ``[start, end)`` (absolute element indices)."""
        a, b = start - self.start, end - self.start
        return Fragment(self.name, start, end, self.value[a:b],
                        {k: v[a:b] for k, v in self.state.items()}, self.scalars,
                        self.replicated, self.volatile)


@dataclass(frozen=True)
class ExportedState:
    """What a source holds on this rank (module docstring). ``replica`` is
    ``(index, count)`` of this rank among the ranks that hold the
    ``replicated`` fragments identically."""

    tensors: Mapping[str, TensorInfo]
    fragments: tuple[Fragment, ...]
    groups: tuple[Mapping[str, Any], ...] = ()
    optimizer: Optional[str] = None
    replica: tuple[int, int] = (0, 1)

    def __post_init__(self) -> None:
        index, count = self.replica
        if not 0 <= index < count:
            raise ValueError(f"replica {self.replica} is not (index, count) with index < count")
        for frag in self.fragments:
            info = self.tensors.get(frag.name)
            if info is None:
                raise ValueError(f"fragment of {frag.name!r}, which the source does not declare")
            if frag.end > info.numel:
                raise ValueError(f"fragment [{frag.start}, {frag.end}) of {frag.name!r} outside "
                                 f"its {info.numel} elements")


@dataclass
class LoadTarget:
    """One range a source wants filled on load: fresh tensors, nothing live."""

    name: str
    start: int
    end: int
    value: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)
    loaded: bool = False


@dataclass
class ImportPlan:
    """What :meth:`StateSource.prepare_import` hands the loader; ``private``
    is the source's own bookkeeping for :meth:`StateSource.finish_import`."""

    tensors: Mapping[str, TensorInfo]
    targets: list[LoadTarget]
    optimizer: Optional[str] = None
    private: Any = None


class StateSource(Protocol):
    """The three methods of the interface (module docstring)."""

    def export_state(self, names: Mapping[int, str]) -> ExportedState: ...

    def prepare_import(self, names: Mapping[int, str],
                       state_keys: Optional[Sequence[str]]) -> ImportPlan: ...

    def finish_import(self, plan: ImportPlan, groups: Optional[Sequence[Mapping[str, Any]]],
                      optimizer_states: bool) -> None: ...


# ------------------------------------------------------------ shared helpers


def per_element(key: str, value: Any, shape: Sequence[int]) -> bool:
    """Whether optimizer state ``key`` of a tensor of ``shape`` has one value
    per element. A state tensor with dimensions does; a 0-d one only when
    the tensor it belongs to is 0-d too (Adam's moments of a scalar
    parameter), unless it is one of torch's per-tensor scalars
    (:data:`SCALAR_STATE`): those have the same shape there."""
    if not isinstance(value, torch.Tensor):
        return False
    if value.dim() > 0:
        return True
    return tuple(shape) == () and key not in SCALAR_STATE


def split_state(state: Mapping[str, Any], shape: int | Sequence[int], where: str
                ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One inner-optimizer tensor's state (the tensor has ``shape``; an int
    is a flat length) -> (per-element 1-D views, the rest). A tensor state
    of another size (factored second moments, ...) cannot be resharded by
    element: an error naming it."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = math.prod(shape)
    elementwise: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for key, value in state.items():
        if per_element(key, value, shape):
            if value.numel() != numel or not value.is_contiguous():
                raise ValueError(f"optimizer state {key!r} of {where} has shape "
                                 f"{tuple(value.shape)}, not one value per element: dsrun "
                                 "checkpoints store optimizer state per element")
            elementwise[key] = value.detach().view(-1)
        else:
            scalars[key] = value
    return elementwise, scalars


def group_hyperparameters(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], ...]:
    return tuple({k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups)


def staged_state(optimizer: torch.optim.Optimizer,
                 states: Mapping[int, Optional[Mapping[str, Any]]],
                 groups: Optional[Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """The state dict :func:`install_state` loads (nothing is changed):
    the state of the inner tensors named in ``states`` (keyed by
    ``id(tensor)``; None drops that tensor's state) replaced, the others'
    kept, and, when ``groups`` is given, the hyperparameters both sides have."""
    current = optimizer.state_dict()
    index = {}
    offset = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            index[id(p)] = offset
            offset += 1
    new_state = dict(current["state"])
    for key, state in states.items():
        position = index[key]
        if state is None:
            new_state.pop(position, None)
        else:
            new_state[position] = dict(state)
    new_groups = [dict(g) for g in current["param_groups"]]
    if groups is not None:
        for mine, saved in zip(new_groups, groups):
            for key, value in saved.items():
                if key not in IMPLEMENTATION_KEYS and key in mine:
                    mine[key] = _like(mine[key], value)
    return {"state": new_state, "param_groups": new_groups}


def check_state(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    """Load ``state_dict`` into a stand-in for ``optimizer`` whose tensors
    are on the meta device (no memory, no copies): what ``load_state_dict``
    would refuse (a state without the ``step`` the optimizer needs, ...) is
    raised here, while the optimizer is as it was."""
    probe = copy.copy(optimizer)
    probe.defaults = dict(optimizer.defaults)
    probe.state = defaultdict(dict)
    probe.param_groups = [
        {**g, "params": [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in g["params"]]}
        for g in optimizer.param_groups]
    probe.load_state_dict(dict(state_dict))


def install_state(optimizer: torch.optim.Optimizer,
                  states: Mapping[int, Optional[Mapping[str, Any]]],
                  groups: Optional[Sequence[Mapping[str, Any]]]) -> None:
    """Replace the optimizer state as :func:`staged_state` describes,
    through ``optimizer.load_state_dict`` (which places ``step`` and casts
    as torch does). Tensors not in ``states`` keep their state."""
    optimizer.load_state_dict(staged_state(optimizer, states, groups))


def _like(current: Any, saved: Any) -> Any:
    """``saved`` in ``current``'s container type (JSON turns tuples into lists)."""
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    if isinstance(current, torch.Tensor) and not isinstance(saved, torch.Tensor):
        return torch.tensor(saved, dtype=current.dtype, device=current.device)
    return saved
