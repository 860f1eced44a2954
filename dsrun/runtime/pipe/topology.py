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

Invariants: :meth:`PipeTopology.coords` and :meth:`PipeTopology.rank` are
inverse bijections between ``range(world_size)`` and the grid; the
data-parallel groups partition the ranks, and so do the pipeline groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsrun.errors import DsrunConfigError


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DsrunConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class PipeTopology:
    """``stages`` pipeline stages x ``replicas`` data-parallel replicas."""

    stages: int
    replicas: int

    def __post_init__(self) -> None:
        _positive("the number of pipeline stages", self.stages)
        _positive("the number of data-parallel replicas", self.replicas)

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas

    def rank(self, stage: int, replica: int) -> int:
        if not (0 <= stage < self.stages and 0 <= replica < self.replicas):
            raise ValueError(f"(stage {stage}, replica {replica}) is outside {self}")
        return stage * self.replicas + replica

    def coords(self, rank: int) -> tuple[int, int]:
        """``(stage, replica)`` of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside {self} (world size {self.world_size})")
        return divmod(rank, self.replicas)

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """The data-parallel group of ``stage``: its ranks in every replica."""
        return tuple(self.rank(stage, r) for r in range(self.replicas))

    def pipeline_ranks(self, replica: int) -> tuple[int, ...]:
        """The ranks of one pipeline, first stage first."""
        return tuple(self.rank(s, replica) for s in range(self.stages))

    def describe(self) -> str:
        return (f"{self.stages} pipeline stage(s) x {self.replicas} data-parallel "
                f"replica(s) = {self.world_size} rank(s)")


def topology_for(world_size: int, num_stages: object = None, topology: object = None,
                 ) -> PipeTopology:
    """The topology of a ``PipelineModule(num_stages=..., topology=...)`` on
    ``world_size`` ranks: exactly one of the two is needed (both must agree)."""
    if topology is None and num_stages is None:
        raise DsrunConfigError("PipelineModule needs num_stages= (or topology=)")
    if topology is not None:
        if not isinstance(topology, PipeTopology):
            raise DsrunConfigError(
                f"topology= must be a PipeDataParallelTopology (dsrun.pipe), got "
                f"{type(topology).__name__}")
        if num_stages is not None and num_stages != topology.stages:
            raise DsrunConfigError(f"num_stages={num_stages!r} disagrees with the topology "
                                   f"({topology.describe()})")
        if topology.world_size != world_size:
            raise DsrunConfigError(f"the topology ({topology.describe()}) does not match the "
                                   f"world size {world_size}")
        return topology
    stages = _positive("num_stages", num_stages)
    if world_size % stages:
        raise DsrunConfigError(f"num_stages={stages} does not divide the world size "
                               f"{world_size}: every data-parallel replica needs all "
                               f"{stages} stages")
    return PipeTopology(stages, world_size // stages)


def PipeDataParallelTopology(num_pp: int, num_dp: int) -> PipeTopology:  # noqa: N802
    """DeepSpeed's name: ``num_pp`` stages x ``num_dp`` replicas."""
    return PipeTopology(stages=num_pp, replicas=num_dp)


def PipeModelDataParallelTopology(num_pp: int, num_mp: int, num_dp: int  # noqa: N802
                                  ) -> PipeTopology:
    """DeepSpeed's name; tensor (model) parallelism is not implemented, so
    ``num_mp`` must be 1."""
    if num_mp != 1:
        raise DsrunConfigError(f"num_mp={num_mp}: tensor (model) parallelism is not "
                               "implemented in dsrun; use PipeDataParallelTopology(num_pp, "
                               "num_dp)")
    return PipeTopology(stages=num_pp, replicas=num_dp)
