"""What a DeepSpeed engine answers about its process groups and parallel
sizes (data, model, tensor, sequence, pipeline): a mixin of
:class:`~dsrun.runtime.engine_info.EngineInfo`. dsrun's only parallelism
of its own is data (and pipeline) parallelism; the model-parallel answers
come from the client's mpu when there is one."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class GroupInfo:
    """DeepSpeed's process-group accessors (module docstring)."""

    dp_group: Any
    dp_world_size: int
    mpu: Any
    is_pipe_parallel: bool

    @property
    def data_parallel_group(self) -> Any:
        """The data-parallel process group: the mpu's, else the world group."""
        return self.dp_group if self.dp_group is not None else dist.group.WORLD

    @property
    def mp_world_size(self) -> int:
        """Model-parallel size: the mpu's, else 1 (DeepSpeed's attribute)."""
        if self.mpu is None:
            return 1
        return int(self.mpu.get_model_parallel_world_size())

    def get_model_parallel_rank(self) -> int:
        """This rank in its model-parallel group: the mpu's, else 0."""
        if self.mpu is None:
            return 0
        return int(self.mpu.get_model_parallel_rank())

    def get_data_parallel_rank(self) -> int:
        """This rank in :attr:`data_parallel_group`. (DeepSpeed 0.19.8 answers
        only once AutoTP made its groups; otherwise its assertion fails.)"""
        return dist.get_rank(self.data_parallel_group)

    def get_tensor_parallel_rank(self) -> int:
        """This rank in its tensor-parallel group: the mpu's (its
        ``get_tensor_model_parallel_rank``, ``get_slice_parallel_rank`` or
        ``get_model_parallel_rank``), else 0 - dsrun has no tensor parallelism
        of its own. (DeepSpeed 0.19.8 answers only under AutoTP, as
        :meth:`get_data_parallel_rank`.)"""
        from dsrun.runtime.norms import tensor_model_parallel_rank

        return tensor_model_parallel_rank(self.mpu)

    @property
    def seq_dp_world_size(self) -> int:
        """DeepSpeed's sequence-and-data-parallel size: the data-parallel
        size (:attr:`sequence_parallel_size` is 1); checkpoints record it."""
        return self.dp_world_size

    def autotp_size(self) -> int:
        """DeepSpeed's AutoTP (tensor-parallel) size: 0, its value when AutoTP
        is not configured. dsrun has no AutoTP: its ``tensor_parallel``
        section passes through unused, so a script that sizes its
        data-parallel split by this number gets the split dsrun runs."""
        return 0

    def get_sequence_parallel_group(self) -> Any:
        """None: dsrun has no sequence parallelism. (DeepSpeed 0.19.8 has the
        group only with sequence parallelism, and raises AttributeError
        without it.)"""
        return None

    @property
    def pipeline_parallelism(self) -> bool:
        """DeepSpeed's attribute: True on a pipeline engine."""
        return self.is_pipe_parallel

    @property
    def dist_backend(self) -> str:
        """The process group's backend name (``"nccl"``, ``"gloo"``), which is
        DeepSpeed's accelerator's communication backend."""
        return str(dist.get_backend())
