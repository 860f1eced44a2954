"""The process groups of a pipeline x data-parallel job, and the ``mpu``
interface (DeepSpeed/Megatron's name for it) the engine and data loading use.

Groups, for a :class:`~dsrun.runtime.pipe.topology.PipeTopology`:

* one **data-parallel group** per stage (that stage in every replica):
  gradients are averaged there, ZeRO partitions there;
* one **pipeline group** per replica (all its stages): the batch loss is
  broadcast there from the last stage;
* one **channel** per direction between neighbouring stages of a replica
  (activations forward, gradients back) and one from the first stage to
  the last (labels). Each channel is a group of its own: NCCL serialises
  the operations of one communicator on one stream, so a send of
  activations could otherwise wait behind a receive of gradients between
  the same two ranks. Within a channel, messages keep their order.

``PipelineGrid(topology=None, process_group=None)`` is also DeepSpeed's
``PipelineParallelGrid`` constructor (importable under that name from
:mod:`~dsrun.runtime.pipe.topology`): without a topology, the world's prime
factors are dealt alternately to stages and replicas, as DeepSpeed does;
the grid always spans the whole world.

DeepSpeed's attributes name these: ``dp_groups`` / ``pipe_groups`` (every
data-parallel / pipeline group's ranks), ``dp_group`` / ``pp_group`` (this
rank's), ``dp_proc_group`` / ``pp_proc_group`` (its process groups),
``slice_group`` / ``slice_proc_group`` (this rank alone: no tensor
parallelism) and ``p2p_groups``. DeepSpeed's ``ds_model_proc_group`` (its
model-parallel group, the pipeline of a replica) is not there: dsrun's
model-parallel group is this rank alone (``get_model_parallel_group()``),
and the pipeline's group is ``pp_proc_group``.

``torch.distributed.new_group`` is collective over the whole world: every
rank creates every group, in the same order. Groups are cached per default
process group and purpose (:func:`cached_group`), so building several
pipeline modules over one topology creates them once.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch.distributed as dist

from dsrun.errors import DsrunConfigError
from dsrun.runtime.pipe.topology import (
    PipeTopology,
    ProcessTopology,
    default_topology,
    topology_for,
)

_CACHE: dict[Any, Any] = {}


def cached_group(purpose: str, ranks: tuple[int, ...]) -> Any:
    """``dist.new_group(ranks)`` once per (purpose, ranks) and default group.
    Collective: all ranks must ask for the same groups in the same order."""
    world = dist.group.WORLD
    if _CACHE.get("world") is not world:
        _CACHE.clear()
        _CACHE["world"] = world
    key = (purpose, ranks)
    if key not in _CACHE:
        _CACHE[key] = dist.new_group(list(ranks))
    return _CACHE[key]


class Channel(NamedTuple):
    """One direction of point-to-point traffic: to or from ``peer`` (a global rank)."""

    peer: int
    group: Any
    name: str  # for messages: "activations from stage 0"


class PipelineGrid:
    """This rank's place in the topology, its groups and channels (module docstring)."""

    def __init__(self, topology: Optional[ProcessTopology] = None,
                 process_group: Any = None) -> None:
        world = dist.get_world_size()
        if process_group is not None and dist.get_world_size(process_group) != world:
            raise DsrunConfigError(
                f"PipelineParallelGrid(process_group=...): a group of "
                f"{dist.get_world_size(process_group)} of the {world} ranks; a pipeline grid "
                "spans the whole world (pass process_group=None)")
        topology = default_topology(world) if topology is None else \
            topology_for(world, None, topology)
        self._topo = topology
        self._model_group: Any = None
        self.global_rank = dist.get_rank()
        # DeepSpeed's attributes
        self.world_size = world
        self.pipe_parallel_size = topology.stages
        self.data_parallel_size = topology.replicas
        self.model_parallel_size = self.slice_parallel_size = 1  # no tensor parallelism
        self.stage_id, self.data_parallel_id = topology.coords(self.global_rank)
        stages, replicas = topology.stages, topology.replicas
        # DeepSpeed's names: *_groups every group's ranks, *_group this
        # rank's ranks, *_proc_group this rank's process group
        self.dp_groups = [list(topology.stage_ranks(stage)) for stage in range(stages)]
        self.dp_group = self.dp_groups[self.stage_id]
        self.dp_proc_group: Any = None
        for stage in range(stages):
            group = cached_group("data", topology.stage_ranks(stage))
            if stage == self.stage_id:
                self.dp_proc_group = group
        self.pipe_groups = [list(topology.pipeline_ranks(r)) for r in range(replicas)]
        self.pp_group = self.pipe_groups[self.data_parallel_id]
        self.pipe_group: Any = None  # dsrun's name; DeepSpeed's is pp_proc_group
        for replica in range(replicas):
            group = cached_group("pipe", topology.pipeline_ranks(replica))
            if replica == self.data_parallel_id:
                self.pipe_group = group
        self.pp_proc_group = self.pipe_group
        self.slice_group = [self.global_rank]  # no tensor parallelism: this rank alone
        self._channels: dict[tuple[str, int, int], Channel] = {}
        for replica in range(replicas):
            for stage in range(stages - 1):
                self._channel("act", replica, stage, stage + 1)
                self._channel("grad", replica, stage + 1, stage)
            if stages > 1:
                self._channel("labels", replica, 0, stages - 1)

    def _channel(self, kind: str, replica: int, src: int, dst: int) -> None:
        a, b = self._topo.rank(src, replica), self._topo.rank(dst, replica)
        group = cached_group(f"{kind}:{src}->{dst}", (min(a, b), max(a, b)))
        if self.global_rank in (a, b):
            peer = b if self.global_rank == a else a
            self._channels[(kind, src, dst)] = Channel(peer, group, f"{kind} stage {src}->{dst}")

    def channel(self, kind: str, src: int, dst: int) -> Channel:
        """The channel of ``kind`` ("act", "grad", "labels") from stage ``src``
        to ``dst`` in this rank's replica (this rank is one end)."""
        return self._channels[(kind, src, dst)]

    @property
    def origin(self) -> str:
        """Where the data-parallel size comes from, for messages."""
        return f"the pipeline topology ({self._topo.describe()})"

    @property
    def stages(self) -> int:
        return self._topo.stages

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self._topo.stages - 1

    def stage_to_global(self, stage_id: int, **coords: int) -> int:
        """The global rank of stage ``stage_id`` at this rank's other
        coordinates, or those given (DeepSpeed's: ``stage_to_global(1, data=0)``)."""
        others = [axis for axis in self._topo.get_axis_names() if axis != "pipe"]
        unknown = sorted(set(coords) - set(others))
        if unknown:
            raise ValueError(f"stage_to_global(): {', '.join(unknown)} is not a coordinate "
                             f"besides the stage (the others are {others})")
        here = self._topo.get_coord(self.global_rank)._replace(pipe=stage_id, **coords)
        return self._topo.get_rank(**here._asdict())

    @property
    def p2p_groups(self) -> list[list[int]]:
        """DeepSpeed's: for every rank in order, ``[rank, the rank of the next
        stage in its pipeline]`` (the last stage wraps to the first). dsrun
        sends over the channels above, not over groups built from these."""
        pairs = []
        for rank in range(self._topo.world_size()):
            stage, replica = self._topo.coords(rank)
            pairs.append([rank, self._topo.rank((stage + 1) % self.stages, replica)])
        return pairs

    # ------------------------------------------- mpu interface (DeepSpeed's names)

    def topology(self) -> PipeTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_group(self) -> Any:
        return self.dp_proc_group

    def get_data_parallel_world_size(self) -> int:
        return self._topo.replicas

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    def get_pipe_parallel_group(self) -> Any:
        return self.pipe_group

    def get_pipe_parallel_world_size(self) -> int:
        return self._topo.stages

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_group(self) -> Any:
        """This rank alone (no tensor parallelism): a group of one rank, made
        on first use by this rank only."""
        if self._model_group is None:
            self._model_group = dist.new_group([self.global_rank],
                                               use_local_synchronization=True)
        return self._model_group

    get_slice_parallel_group = get_model_parallel_group

    @property
    def slice_proc_group(self) -> Any:
        """DeepSpeed's: the group of :attr:`slice_group`, this rank alone
        (made on first use)."""
        return self.get_model_parallel_group()

    get_slice_parallel_world_size = get_model_parallel_world_size
    get_slice_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
