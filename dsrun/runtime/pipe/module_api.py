"""DeepSpeed's ``PipelineModule`` methods that describe or act on a built
module: topology and partition queries, tied weights, checkpoint file
names, ``compile``. A mixin of :class:`~dsrun.runtime.pipe.module.PipelineModule`,
which builds and runs the layers.

Everything here has dsrun's real behaviour behind DeepSpeed's name. Tied
modules: dsrun keeps *every* parameter of a tied module equal across the
stages that hold it (:mod:`~.tied`); ``tied_comms`` and
``get_tied_weights_and_groups`` still list DeepSpeed's view, the
``tied_weight_attr`` parameters. The checkpoint names are DeepSpeed's file
names; dsrun's own checkpoints store the model by parameter name instead
(:mod:`~.checkpoint`), so only scripts reading DeepSpeed's files need them.
"""

from __future__ import annotations

import glob
import os
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from dsrun.runtime.pipe.errors import PipeAssertionError
from dsrun.runtime.pipe.grid import PipelineGrid
from dsrun.runtime.pipe.partition import type_matches
from dsrun.runtime.pipe.topology import PipeTopology


def recursive_getattr(module: torch.nn.Module, attr_name: str) -> Any:
    """``module.a.b`` for ``"a.b"`` (DeepSpeed's ``_recursive_getattr``)."""
    value: Any = module
    for part in attr_name.split("."):
        value = getattr(value, part)
    return value


class PipelineModuleAPI:
    """DeepSpeed's accessors of a built pipeline module (module docstring)."""

    # set by PipelineModule
    _topology: PipeTopology
    _grid: PipelineGrid
    _num_layers: int
    _layer_names: list[str]
    _local_start: int
    _local_stop: int
    _tied_comms: Optional[dict[str, dict[str, Any]]]
    parts: tuple[int, ...]
    num_stages: int
    global_rank: int
    tied_weights: Any
    tied_modules: torch.nn.ModuleDict
    forward_funcs: list[Callable[[Any], Any]]
    activation_checkpoint_interval: int

    # ------------------------------------------------------------ the layout

    def topology(self) -> PipeTopology:
        return self._topology

    def mpu(self) -> PipelineGrid:
        return self._grid

    @property
    def grid(self) -> PipelineGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def partitions(self) -> tuple[int, ...]:
        """The stage boundaries: stage ``s`` owns layers ``[parts[s], parts[s + 1])``."""
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        """The stage that owns layer ``layer_idx``."""
        if not 0 <= layer_idx < self._num_layers:
            raise PipeAssertionError(f"layer {layer_idx} is outside 0-{self._num_layers - 1}")
        return next(s for s in range(self.num_stages) if layer_idx < self.parts[s + 1])

    @property
    def layer_range(self) -> tuple[int, int]:
        """``[start, stop)`` of this stage's layers in ``layers``."""
        return self._local_start, self._local_stop

    @property
    def num_layers(self) -> int:
        return self._num_layers

    def _find_layer_type(self, layername: str) -> list[int]:
        """The indices of the layers whose class name matches the regular
        expression ``layername`` (case-insensitive search), as
        ``partition_method="type:..."`` counts them."""
        return [i for i, hit in enumerate(type_matches(layername, self._layer_names)) if hit]

    def get_additional_losses(self) -> Optional[dict[str, torch.Tensor]]:
        """Losses besides the main one to report: none (DeepSpeed's hook for
        models that add auxiliary losses)."""
        return None

    # ------------------------------------------------------------ tied weights

    @property
    def tied_comms(self) -> dict[str, dict[str, Any]]:
        """DeepSpeed's index of this rank's tied modules, key ->
        ``{"ranks", "group", "weight_attr", "module"}``: the ranks of this
        replica that hold the module (lowest stage first), their group (a
        group of this rank alone when it is the only owner, made on first
        use), the ``tied_weight_attr`` names and the module. Empty with one
        stage, as DeepSpeed's."""
        if self._tied_comms is None:
            comms: dict[str, dict[str, Any]] = {}
            for entry in self.tied_weights.held if self.num_stages > 1 else ():
                group = entry.group if entry.group is not None else dist.new_group(
                    [self.global_rank], use_local_synchronization=True)
                comms[entry.key] = {"ranks": list(entry.ranks), "group": group,
                                    "weight_attr": list(entry.weight_attr),
                                    "module": entry.module}
            self._tied_comms = comms
        return self._tied_comms

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum each tied module's gradients over the stages that hold it
        (collective over those ranks), what ``train_batch`` does before its
        step. All the module's parameters, not only ``tied_weight_attr``'s
        (dsrun keeps them all equal); a parameter no owner has a gradient
        for keeps ``grad = None``."""
        self.tied_weights.reduce_grads()

    def get_tied_weights_and_groups(self) -> list[tuple[torch.nn.Parameter, Any]]:
        """``(parameter, group)`` for each ``tied_weight_attr`` of each key in
        :attr:`tied_comms`, as DeepSpeed lists them."""
        return [(recursive_getattr(comm["module"], attr), comm["group"])
                for comm in self.tied_comms.values() for attr in comm["weight_attr"]]

    # ------------------------------------------------------------ checkpoint names

    def ckpt_prefix(self, checkpoints_path: str, tag: Any) -> str:
        """DeepSpeed's prefix of this rank's files in checkpoint ``tag``:
        ``<path>/<tag>/module-pipe_01`` (every axis but ``data``)."""
        coord = self._topology.get_coord(self.global_rank)
        name = "module" + "".join(f"-{axis}_{getattr(coord, axis):02d}"
                                  for axis in self._topology.get_axis_names() if axis != "data")
        return os.path.join(checkpoints_path, str(tag), name)

    def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
        """DeepSpeed's file for this stage's layer ``local_layer_idx`` in a
        checkpoint (``layer_07-model_states.pt``)."""
        path = os.path.join(ckpt_dir, f"layer_{local_layer_idx + self._local_start:02d}")
        rank_repr = self._topology.get_rank_repr(rank=self.global_rank)
        if rank_repr:
            path += f"-{rank_repr}"
        return path + "-model_states.pt"

    def ckpt_layer_path_list(self, ckpt_dir: str, local_layer_idx: int) -> list[str]:
        """The files of this stage's layer ``local_layer_idx`` that exist in
        the DeepSpeed checkpoint directory ``ckpt_dir`` (every model-parallel
        slice), sorted."""
        index = local_layer_idx + self._local_start
        pattern = os.path.join(glob.escape(ckpt_dir), f"layer_{index:02d}-*model_states.pt")
        return sorted(glob.glob(pattern))

    # ------------------------------------------------------------ running

    def set_checkpoint_interval(self, interval: int) -> None:
        """Checkpoint activations every ``interval`` layers from the next forward on."""
        self.activation_checkpoint_interval = checked_interval(interval)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``torch.compile`` each layer of this stage, as DeepSpeed: a module
        in place (``nn.Module.compile(*args, **kwargs)``), a function
        replaced by its compiled form. The stage's loop over its layers, the
        seeding and the activation checkpointing stay uncompiled."""
        for index, func in enumerate(self.forward_funcs):
            if isinstance(func, torch.nn.Module):
                func.compile(*args, **kwargs)
            else:
                self.forward_funcs[index] = torch.compile(func, *args, **kwargs)


def checked_interval(interval: Any) -> int:
    """An ``activation_checkpoint_interval``: an integer >= 0 (0: none)."""
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise PipeAssertionError(f"activation_checkpoint_interval must be an integer >= 0, "
                                 f"got {interval!r}")
    return interval
