"""``PipelineModule``: a sequence of layers cut into pipeline stages.

Every rank gets the whole list of layers (specs, modules or functions) and
keeps only its stage's: :class:`~dsrun.runtime.pipe.layers.LayerSpec` layers
are built only there. ``forward(x)`` runs this stage's layers in order, each
taking the previous one's output as its single argument (a tensor or a
tuple); with one stage that is the whole model, which is also how to run
it in one process.

**Names are independent of the number of stages.** Layer ``i`` of
``layers`` is registered as submodule ``"i"``, whichever stage owns it, so
its parameters are ``"i.<name>"`` (``"3.weight"``); tied modules are
``"tied_modules.<key>.<name>"`` on every stage that holds them. The union of
all stages' ``named_parameters()`` (tied names once) is exactly the
single-stage model's: a checkpoint keyed by these names can be loaded into
any number of stages or replicas.

Construction is collective (it creates process groups): every rank builds
the same ``PipelineModule``, in the same order as other pipeline modules.
``seed_layers=True`` builds layer ``i`` under ``torch.manual_seed(base_seed
+ i)`` (a tied module under its first layer's index), restoring the RNG
after: the initial weights then do not depend on the partition.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from dsrun import checkpointing
from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.runtime.env import DistEnv
from dsrun.runtime.pipe.costs import layer_flops
from dsrun.runtime.pipe.grid import PipelineGrid, cached_group
from dsrun.runtime.pipe.layers import LayerSpec, TiedLayerSpec, count_parameters, layer_name
from dsrun.runtime.pipe.partition import partition_layers, type_matches
from dsrun.runtime.pipe.tied import TiedEntry, TiedWeights
from dsrun.runtime.pipe.topology import PipeTopology, topology_for
from dsrun.runtime.progress import ensure_visible

log = logging.getLogger("dsrun.runtime")


class PipelineError(DsrunError):
    """A pipeline used in a way it cannot work (DeepSpeed's name, also a
    :class:`~dsrun.errors.DsrunError`): ``engine.backward()`` or
    ``engine.step()`` on a pipeline engine."""


def _check_layers(layers: Iterable[Any]) -> list[Any]:
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise DsrunConfigError(f"PipelineModule layers= must be a sequence of LayerSpec, "
                               f"modules or functions, got {type(layers).__name__}")
    items = list(layers)
    if not items:
        raise DsrunConfigError("PipelineModule needs at least one layer")
    seen: dict[int, int] = {}
    tied_types: dict[str, tuple[int, type]] = {}
    for i, layer in enumerate(items):
        if isinstance(layer, TiedLayerSpec):
            first = tied_types.setdefault(layer.key, (i, layer.typename))
            if first[1] is not layer.typename:
                raise DsrunConfigError(f"layer {i}: TiedLayerSpec {layer.key!r} builds "
                                       f"{layer.name}, but layer {first[0]} with the same key "
                                       f"builds {first[1].__name__}")
        elif isinstance(layer, torch.nn.Module):
            if id(layer) in seen:
                raise DsrunConfigError(f"layer {i} is the same module object as layer "
                                       f"{seen[id(layer)]}: to share weights between layers, "
                                       "use TiedLayerSpec")
            seen[id(layer)] = i
        elif not isinstance(layer, LayerSpec) and not callable(layer):
            raise DsrunConfigError(f"layer {i} is a {type(layer).__name__}: a pipeline layer "
                                   "is a LayerSpec, TiedLayerSpec, torch.nn.Module or function")
    return items


def _module_of(func: Any) -> Optional[torch.nn.Module]:
    """The module behind a stage function (a tied layer's forward_fn is a partial)."""
    if isinstance(func, torch.nn.Module):
        return func
    if isinstance(func, functools.partial) and func.args and \
            isinstance(func.args[0], torch.nn.Module):
        return func.args[0]
    return None


def _as_parts(run: Callable[[Any], Any]) -> Callable[..., Any]:
    """``run`` taking a tuple, as a function of the tuple's items."""
    def parts(*items: Any) -> Any:
        return run(items)
    return parts


class PipelineModule(torch.nn.Module):
    """Layers partitioned over pipeline stages (module docstring).

    ``loss_fn(outputs, labels)`` computes the loss on the last stage (None:
    the last layer's output is the loss). ``partition_method``: see
    :mod:`~dsrun.runtime.pipe.partition`. ``activation_checkpoint_interval``
    N > 0: this stage's layers run in chunks of N, each under
    ``activation_checkpoint_func(function, *inputs)`` (default:
    :func:`dsrun.checkpointing.checkpoint`, DeepSpeed's default too, which
    follows :func:`dsrun.checkpointing.configure`) while gradients are enabled - only the
    chunk's input is kept and its activations are recomputed in backward.
    ``checkpointable_layers``: class names; a chunk is checkpointed only if
    all its layers are of these classes (default: if it has parameters).
    ``example_inputs`` (and optionally ``example_labels``): one micro-batch's
    input to the first layer (and its labels, for ``loss_fn``), needed by
    ``partition_method="flops"``; only shapes and dtypes are read, so meta
    tensors do (see :mod:`~dsrun.runtime.pipe.costs`).
    """

    def __init__(self, layers: Sequence[Any], num_stages: Optional[int] = None,
                 topology: Optional[PipeTopology] = None,
                 loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
                 seed_layers: bool = False, seed_fn: Optional[Callable[[int], Any]] = None,
                 base_seed: int = 1234, partition_method: Any = "parameters",
                 activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Optional[Callable[..., Any]] = None,
                 checkpointable_layers: Optional[Sequence[str]] = None,
                 example_inputs: Any = None, example_labels: Any = None,
                 dynamic_shape: bool = False) -> None:
        super().__init__()
        specs = _check_layers(layers)
        interval = _checked_interval(activation_checkpoint_interval)
        if loss_fn is not None and not callable(loss_fn):
            raise DsrunConfigError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not dist.is_initialized():
            from dsrun.runtime.dist import init_distributed
            init_distributed()
        self._topology = self._topo = topology_for(dist.get_world_size(), num_stages,
                                                   topology)
        self.dynamic_shape = dynamic_shape
        self.num_stages = self._topology.stages
        self.loss_fn = loss_fn
        self.seed_layers, self.base_seed = bool(seed_layers), base_seed
        self.seed_fn = seed_fn or torch.manual_seed
        self.activation_checkpoint_interval = interval
        self.activation_checkpoint_func = activation_checkpoint_func or checkpointing.checkpoint
        self.checkpointable_layers = None if checkpointable_layers is None \
            else set(checkpointable_layers)
        self.partition_method = partition_method
        self._num_layers = len(specs)
        names = [layer_name(layer) for layer in specs]
        method = partition_method.lower() if isinstance(partition_method, str) else None
        wants_counts = method == "parameters"
        counts = [count_parameters(layer) for layer in specs] if wants_counts \
            else [0] * len(specs)
        self.layer_flops = self._count_flops(specs, names, example_inputs, example_labels) \
            if method == "flops" else None
        self.parts = partition_layers(partition_method, self.num_stages, names, counts,
                                      self.layer_flops)
        self._grid = PipelineGrid(self._topology)
        self.stage_id = self._grid.stage_id
        # DeepSpeed's attributes: the world (the whole default group), this
        # rank in it and on its host, and the number of forward() calls
        self.world_group = dist.group.WORLD
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = DistEnv.detect().local_rank
        self.micro_offset = 0
        self._layer_names = names
        self._tied_comms: Optional[dict[str, dict[str, Any]]] = None
        self._local_start = self.parts[self.stage_id]
        self._local_stop = self.parts[self.stage_id + 1]
        self.tied_modules = torch.nn.ModuleDict()
        self.forward_funcs: list[Callable[[Any], Any]] = []
        self._build(specs)
        self.tied_weights = self._tie(specs)
        if dist.get_rank() == 0:
            ensure_visible()
            log.info("%s", self.describe(names, counts if wants_counts else None))

    # ------------------------------------------------------------ building

    def _count_flops(self, specs: list[Any], names: list[str], example_inputs: Any,
                     example_labels: Any) -> list[int]:
        """Each layer's forward + backward flops on the example (for
        ``"flops"``); a layer activation checkpointing would recompute (by
        the per-chunk rule of :meth:`_checkpointable`, applied per layer)
        counts its forward twice."""
        if self.activation_checkpoint_interval == 0:
            again = [False] * len(specs)
        elif self.checkpointable_layers is not None:
            again = [name in self.checkpointable_layers for name in names]
        else:
            again = [count_parameters(layer) > 0 for layer in specs]
        return layer_flops(specs, example_inputs, example_labels=example_labels,
                           loss_fn=self.loss_fn, recomputed=again)

    def _seeded(self, index: int, build: Callable[[], Any]) -> Any:
        if not self.seed_layers:
            return build()
        with torch.random.fork_rng(devices=[]):
            self.seed_fn(self.base_seed + index)
            return build()

    def _build(self, specs: list[Any]) -> None:
        first_use = {}
        for i, layer in enumerate(specs):
            if isinstance(layer, TiedLayerSpec):
                first_use.setdefault(layer.key, i)
        for index in range(self._local_start, self._local_stop):
            layer = specs[index]
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    module = self._seeded(first_use[layer.key], layer.build)
                    layer.check_attrs(module)
                    self.tied_modules[layer.key] = module
                module = self.tied_modules[layer.key]
                func = functools.partial(layer.forward_fn, module) if layer.forward_fn \
                    else module
                self.forward_funcs.append(func)
            elif isinstance(layer, LayerSpec):
                module = self._seeded(index, layer.build)
                self.add_module(str(index), module)
                self.forward_funcs.append(module)
            elif isinstance(layer, torch.nn.Module):
                self.add_module(str(index), layer)
                self.forward_funcs.append(layer)
            else:
                self.forward_funcs.append(layer)

    def _tie(self, specs: list[Any]) -> TiedWeights:
        """Groups of the stages sharing each tied key (collective, all keys)."""
        owners: dict[str, list[int]] = {}
        attrs: dict[str, tuple[str, ...]] = {}
        for stage in range(self.num_stages):
            for index in range(self.parts[stage], self.parts[stage + 1]):
                layer = specs[index]
                if isinstance(layer, TiedLayerSpec):
                    attrs.setdefault(layer.key, layer.tied_weight_attr)
                    if stage not in owners.get(layer.key, []):
                        owners.setdefault(layer.key, []).append(stage)
        entries = []
        rank = dist.get_rank()
        for key in sorted(owners):
            stages = owners[key]
            for replica in range(self._topology.replicas):
                ranks = tuple(self._topology.rank(s, replica) for s in stages)
                group = cached_group(f"tied:{key}", ranks) if len(stages) > 1 else None
                if rank in ranks:
                    entries.append(TiedEntry(key, self.tied_modules[key], group,
                                             primary=rank == ranks[0], ranks=ranks,
                                             weight_attr=attrs[key]))
        return TiedWeights(entries)

    def describe(self, names: Sequence[str], counts: Optional[Sequence[int]]) -> str:
        lines = [f"pipeline: {self._topology.describe()}, partition_method="
                 f"{self.partition_method!r}"]
        for stage in range(self.num_stages):
            a, b = self.parts[stage], self.parts[stage + 1]
            kinds = ", ".join(dict.fromkeys(names[a:b]))
            params = f", {sum(counts[a:b]):,} parameters" if counts is not None else ""
            if self.layer_flops is not None:
                params += f", {sum(self.layer_flops[a:b]) / 1e9:.3g} GFLOP per micro-batch " \
                          "(forward + backward)"
            lines.append(f"  stage {stage}: layers {a}-{b - 1} ({kinds}){params}")
        return "\n".join(lines)

    # ------------------------------------------------------------ running

    def _run(self, start: int, stop: int) -> Callable[[Any], Any]:
        funcs = self.forward_funcs[start:stop]

        def run(x: Any) -> Any:
            for func in funcs:
                x = func(x)
            return x
        return run

    def _checkpointable(self, start: int, stop: int) -> bool:
        modules = [_module_of(f) for f in self.forward_funcs[start:stop]]
        if self.checkpointable_layers is not None:
            return all(m is not None and type(m).__name__ in self.checkpointable_layers
                       for m in modules)
        return any(m is not None and any(True for _ in m.parameters()) for m in modules)

    def forward(self, x: Any) -> Any:
        self.micro_offset += 1
        count = len(self.forward_funcs)
        interval = self.activation_checkpoint_interval
        if interval == 0 or not torch.is_grad_enabled():
            return self._run(0, count)(x)
        for start in range(0, count, interval):
            stop = min(start + interval, count)
            run = self._run(start, stop)
            if not self._checkpointable(start, stop):
                x = run(x)
            elif isinstance(x, tuple):
                # DeepSpeed's convention: the tensors as separate arguments, which
                # a reentrant checkpoint needs to track their gradients
                x = self.activation_checkpoint_func(_as_parts(run), *x)
            else:
                x = self.activation_checkpoint_func(run, x)
        return x

    # ---------------------------------------------------- DeepSpeed's accessors

    def topology(self) -> PipeTopology:
        return self._topology

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def partitions(self) -> tuple[int, ...]:
        """The stage boundaries: stage ``s`` owns layers ``[parts[s], parts[s + 1])``."""
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        """The stage that owns layer ``layer_idx``."""
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer {layer_idx} is outside 0-{self._num_layers - 1}")
        return next(s for s in range(self.num_stages) if layer_idx < self.parts[s + 1])

    def set_checkpoint_interval(self, interval: int) -> None:
        """Checkpoint activations every ``interval`` layers from the next forward on."""
        self.activation_checkpoint_interval = _checked_interval(interval)

    def get_additional_losses(self) -> Optional[dict[str, torch.Tensor]]:
        """Losses besides the main one to report: none (DeepSpeed's hook for
        models that add auxiliary losses)."""
        return None

    def mpu(self) -> PipelineGrid:
        return self._grid

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

    def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
        """DeepSpeed's file for this stage's layer ``local_layer_idx`` in a
        checkpoint (``layer_07-model_states.pt``). dsrun's checkpoints do not
        use these files: they store the model by parameter name
        (:mod:`~dsrun.runtime.pipe.checkpoint`)."""
        path = os.path.join(ckpt_dir, f"layer_{local_layer_idx + self._local_start:02d}")
        rank_repr = self._topology.get_rank_repr(rank=self.global_rank)
        if rank_repr:
            path += f"-{rank_repr}"
        return path + "-model_states.pt"

    def _find_layer_type(self, layername: str) -> list[int]:
        """The indices of the layers whose class name matches the regular
        expression ``layername`` (case-insensitive search), as
        ``partition_method="type:..."`` counts them."""
        return [i for i, hit in enumerate(type_matches(layername, self._layer_names)) if hit]

    @property
    def grid(self) -> PipelineGrid:
        return self._grid

    @property
    def layer_range(self) -> tuple[int, int]:
        """``[start, stop)`` of this stage's layers in ``layers``."""
        return self._local_start, self._local_stop

    @property
    def num_layers(self) -> int:
        return self._num_layers


def _checked_interval(interval: Any) -> int:
    """An ``activation_checkpoint_interval``: an integer >= 0 (0: none)."""
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise DsrunConfigError(f"activation_checkpoint_interval must be an integer >= 0, "
                               f"got {interval!r}")
    return interval
