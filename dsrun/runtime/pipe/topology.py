"""Where every rank sits in a pipeline x data-parallel job (pure, no torch).

A job of ``stages * replicas`` ranks runs ``replicas`` copies of one
pipeline of ``stages`` stages. As in DeepSpeed's ``PipeDataParallelTopology``
(axes ``pipe``, ``data``), the data-parallel coordinate varies fastest:

    rank = stage * replicas + replica

so with 4 ranks, 2 stages x 2 replicas: stage 0 is ranks 0 and 1, stage 1 is
ranks 2 and 3; replica 0's pipeline is ranks 0 -> 2, replica 1's 1 -> 3.
Under a launcher that fills hosts in rank order, a stage's data-parallel
ranks (which all-reduce whole gradients) share a host and consecutive stages
(which exchange only activations) may sit on different hosts.

:class:`ProcessTopology` is DeepSpeed's general grid of named axes (the last
axis varies fastest) with its query methods (``get_rank(pipe=1, data=0)``,
``get_coord``, ``get_dim``, ``filter_match``, ``get_axis_comm_lists``...);
:class:`PipeTopology` is the ``pipe`` x ``data`` grid a
``PipelineModule`` runs on, and ``PipeDataParallelTopology`` /
``PipeModelDataParallelTopology`` (with one model-parallel rank: tensor
parallelism is not implemented) build one under DeepSpeed's names.

``PipelineParallelGrid`` (DeepSpeed imports it from this module) is
:class:`dsrun.runtime.pipe.grid.PipelineGrid`, loaded on first use: this
module stays free of torch.

Invariants: :meth:`PipeTopology.coords` and :meth:`PipeTopology.rank` are
inverse bijections between ``range(world_size())`` and the grid; the
data-parallel groups partition the ranks, and so do the pipeline groups.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from typing import Any

from dsrun.errors import DsrunConfigError
from dsrun.runtime.pipe.errors import PipeAssertionError, PipeConfigRuntimeError


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DsrunConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


class ProcessTopology:
    """Ranks on a grid of named ``axes`` with sizes ``dims``; the last axis
    varies fastest (DeepSpeed's ``ProcessTopology``)."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes, dims = list(axes), list(dims)
        if not axes or len(axes) != len(dims):
            raise DsrunConfigError(f"ProcessTopology needs one size per axis, got axes={axes} "
                                   f"and dims={dims}")
        if len(set(axes)) != len(axes) or not all(isinstance(a, str) and a.isidentifier()
                                                  for a in axes):
            raise DsrunConfigError(f"ProcessTopology axes must be distinct names, got {axes}")
        for axis, dim in zip(axes, dims):
            _positive(f"the size of axis {axis!r}", dim)
        self.axes, self.dims = axes, dims
        self.ProcessCoord = collections.namedtuple("ProcessCoord", axes)  # type: ignore[misc]
        self.mapping = {self.ProcessCoord(*coord): rank for rank, coord in
                        enumerate(itertools.product(*(range(d) for d in dims)))}

    def world_size(self) -> int:
        return len(self.mapping)

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """The size of ``axis`` (0 if there is no such axis, as DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank(self, **coords: int) -> int:
        """The rank at ``coords`` (every axis named: ``get_rank(pipe=1, data=0)``)."""
        if sorted(coords) != sorted(self.axes):
            raise ValueError(f"get_rank() needs a coordinate for each axis {self.axes}, got "
                             f"{sorted(coords)} (filter_match() selects several ranks)")
        key = self.ProcessCoord(**coords)
        if key not in self.mapping:
            raise PipeAssertionError(f"{key} is outside the topology (dims {self.dims})")
        return self.mapping[key]

    def get_coord(self, rank: int) -> Any:
        """The ``ProcessCoord`` named tuple of ``rank``."""
        if not 0 <= rank < self.world_size():
            raise ValueError(f"rank {rank} is outside the topology (world size "
                             f"{self.world_size()})")
        coord = []
        for dim in reversed(self.dims):
            rank, index = divmod(rank, dim)
            coord.append(index)
        return self.ProcessCoord(*reversed(coord))

    def get_rank_repr(self, rank: int, omit_axes: Sequence[str] = ("data", "pipe"),
                      inner_sep: str = "_", outer_sep: str = "-") -> str:
        """``"model_01"``-style name of ``rank`` over the axes not omitted."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}"
                              for axis in self.axes if axis not in set(omit_axes))

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups along ``axis``: for every coordinate of the other axes,
        the ranks that differ only in ``axis`` ([] if there is no such axis)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for fixed in itertools.product(*(range(self.get_dim(a)) for a in others)):
            where = dict(zip(others, fixed))
            lists.append([self.get_rank(**where, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **criteria: int) -> list[int]:
        """The ranks whose coordinates match ``criteria`` (e.g. ``pipe=0``)."""
        unknown = sorted(set(criteria) - set(self.axes))
        if unknown:
            raise ValueError(f"filter_match(): no axis {', '.join(unknown)} in {self.axes}")
        return [rank for coord, rank in self.mapping.items()
                if all(getattr(coord, k) == v for k, v in criteria.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate on ``axis`` is ``idx``."""
        return self.filter_match(**{axis: idx})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProcessTopology):
            return NotImplemented
        return (self.axes, self.dims) == (other.axes, other.dims)

    def __hash__(self) -> int:
        return hash((tuple(self.axes), tuple(self.dims)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(axes={self.axes}, dims={self.dims})"

    __str__ = __repr__


class PipeTopology(ProcessTopology):
    """``stages`` pipeline stages x ``replicas`` data-parallel replicas (axes
    ``pipe``, ``data``; ``model`` of size 1 after them when ``model_axis``)."""

    def __init__(self, stages: int, replicas: int, *, model_axis: bool = False) -> None:
        self.stages = _positive("the number of pipeline stages", stages)
        self.replicas = _positive("the number of data-parallel replicas", replicas)
        axes, dims = ["pipe", "data"], [stages, replicas]
        super().__init__(axes + ["model"] * model_axis, dims + [1] * model_axis)

    def rank(self, stage: int, replica: int) -> int:
        if not (0 <= stage < self.stages and 0 <= replica < self.replicas):
            raise ValueError(f"(stage {stage}, replica {replica}) is outside {self.describe()}")
        return stage * self.replicas + replica

    def coords(self, rank: int) -> tuple[int, int]:
        """``(stage, replica)`` of ``rank``."""
        if not 0 <= rank < self.world_size():
            raise ValueError(f"rank {rank} is outside {self.describe()}")
        return divmod(rank, self.replicas)

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """The data-parallel group of ``stage``: its ranks in every replica."""
        return tuple(self.rank(stage, r) for r in range(self.replicas))

    def pipeline_ranks(self, replica: int) -> tuple[int, ...]:
        """The ranks of one pipeline, first stage first."""
        return tuple(self.rank(s, replica) for s in range(self.stages))

    def describe(self) -> str:
        return (f"{self.stages} pipeline stage(s) x {self.replicas} data-parallel "
                f"replica(s) = {self.world_size()} rank(s)")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PipeTopology):
            return (self.stages, self.replicas) == (other.stages, other.replicas)
        return super().__eq__(other)

    def __hash__(self) -> int:
        return hash((self.stages, self.replicas))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(stages={self.stages}, replicas={self.replicas})"

    __str__ = __repr__


class PipeDataParallelTopology(PipeTopology):
    """DeepSpeed's name: ``num_pp`` stages x ``num_dp`` replicas."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(num_pp, num_dp)


class PipeModelDataParallelTopology(PipeTopology):
    """DeepSpeed's name (axes ``pipe``, ``data``, ``model``); tensor (model)
    parallelism is not implemented, so ``num_mp`` must be 1."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        if num_mp != 1:
            raise DsrunConfigError(f"num_mp={num_mp}: tensor (model) parallelism is not "
                                   "implemented in dsrun; use PipeDataParallelTopology(num_pp, "
                                   "num_dp)")
        super().__init__(num_pp, num_dp, model_axis=True)


def as_pipe_topology(topology: ProcessTopology) -> PipeTopology:
    """A ``ProcessTopology`` a pipeline can run on: axes ``pipe``, ``data``
    (and ``model`` of size 1) in that order, the layout of every dsrun
    pipeline."""
    if isinstance(topology, PipeTopology):
        return topology
    axes, dims = topology.get_axis_names(), topology.dims
    if axes[:2] == ["pipe", "data"] and (axes[2:] == [] or (axes[2:] == ["model"]
                                                           and dims[2] == 1)):
        return PipeTopology(dims[0], dims[1], model_axis=len(axes) == 3)
    raise DsrunConfigError(
        f"a pipeline runs on axes ['pipe', 'data'] in that order (the data-parallel "
        f"coordinate fastest, as DeepSpeed's PipeDataParallelTopology); got {topology} "
        "(tensor parallelism is not implemented)")


def topology_for(world_size: int, num_stages: object = None, topology: object = None,
                 ) -> PipeTopology:
    """The topology of a ``PipelineModule(num_stages=..., topology=...)`` on
    ``world_size`` ranks: exactly one of the two is needed (both must agree)."""
    if topology is None and num_stages is None:
        raise PipeConfigRuntimeError("PipelineModule needs num_stages= (or topology=)")
    if topology is not None:
        if not isinstance(topology, ProcessTopology):
            raise DsrunConfigError(
                f"topology= must be a PipeDataParallelTopology (dsrun.pipe), got "
                f"{type(topology).__name__}")
        topology = as_pipe_topology(topology)
        if num_stages is not None and num_stages != topology.stages:
            raise DsrunConfigError(f"num_stages={num_stages!r} disagrees with the topology "
                                   f"({topology.describe()})")
        if topology.world_size() != world_size:
            raise PipeAssertionError(f"the topology ({topology.describe()}) does not match "
                                     f"the world size {world_size}")
        return topology
    stages = _positive("num_stages", num_stages)
    if world_size % stages:
        raise PipeConfigRuntimeError(f"num_stages={stages} does not divide the world size "
                                     f"{world_size}: every data-parallel replica needs all "
                                     f"{stages} stages")
    return PipeTopology(stages, world_size // stages)


def default_topology(world_size: int) -> PipeTopology:
    """DeepSpeed's grid when none is given: the prime factors of
    ``world_size``, smallest first, dealt alternately to the stages and the
    replicas (12 = 2 * 2 * 3: 6 stages x 2 replicas)."""
    _positive("the world size", world_size)
    stages = replicas = 1
    n, factor, index = world_size, 2, 0
    while n > 1:
        while n % factor == 0:
            if index % 2 == 0:
                stages *= factor
            else:
                replicas *= factor
            n //= factor
            index += 1
        factor += 1
    return PipeTopology(stages, replicas)


def __getattr__(name: str) -> Any:
    if name == "PipelineParallelGrid":
        from dsrun.runtime.pipe.grid import PipelineGrid
        return PipelineGrid
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
