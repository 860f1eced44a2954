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

``seed_layers=True`` seeds as DeepSpeed does, with ``seed_fn`` (default
:func:`dsrun.runtime.utils.set_random_seed`: Python's, numpy's and torch's
generators) and without restoring the generators after: before building
layer ``i`` with ``base_seed + i``, so the initial weights do not depend on
the partition (a tied module a later stage also holds is built under its
first layer's seed there too, then that layer's seed is set); and before
running layer ``i`` in the ``n``-th ``forward`` call with ``base_seed * (n
+ 1) + i`` (``n`` is :attr:`micro_offset`), so dropout masks depend on the
layer and the micro-batch, not on the stage, and a recomputation under
activation checkpointing sees the same ones. (DeepSpeed's chunked forward
numbers the layers of a checkpointed chunk from the stage's first layer,
repeating seeds across chunks; dsrun uses the layer's index.)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from dsrun import checkpointing
from dsrun.errors import DsrunConfigError
from dsrun.runtime.env import DistEnv
from dsrun.runtime.pipe.costs import layer_flops
from dsrun.runtime.pipe.errors import PipelineError, PipeNotImplementedError
from dsrun.runtime.pipe.grid import PipelineGrid, cached_group
from dsrun.runtime.pipe.layers import LayerSpec, TiedLayerSpec, count_parameters, layer_name
from dsrun.runtime.pipe.module_api import PipelineModuleAPI, checked_interval
from dsrun.runtime.pipe.partition import partition_layers
from dsrun.runtime.pipe.tied import TiedEntry, TiedWeights
from dsrun.runtime.pipe.topology import PipeTopology, topology_for
from dsrun.runtime.progress import ensure_visible
from dsrun.runtime.utils import set_random_seed

log = logging.getLogger("dsrun.runtime")

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec"]


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
        elif isinstance(layer, PipelineModule):
            raise PipeNotImplementedError(
                f"layer {i} is a PipelineModule: a pipeline inside a pipeline is not "
                "implemented (nor in DeepSpeed); put its layers in this one's list")
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
    """The module behind a stage function (a tied layer's forward_fn is a
    partial, perhaps compiled)."""
    func = getattr(func, "_torchdynamo_orig_callable", func)
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


def held_parameters(counts: Sequence[int], tied_keys: Sequence[Optional[str]], start: int,
                    stop: int) -> int:
    """The parameters layers ``[start, stop)`` hold: a tied module used by
    several of them is one module there and counts once (the partition itself
    weighs every use, as DeepSpeed's does)."""
    seen: set[str] = set()
    total = 0
    for index in range(start, stop):
        key = tied_keys[index]
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        total += counts[index]
    return total


class PipelineModule(PipelineModuleAPI, torch.nn.Module):
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

    DeepSpeed's attributes: ``forward_funcs`` (this stage's layers as
    called), ``fwd_map`` (``str(i)`` of each module layer -> its index in
    ``forward_funcs``), ``tied_modules`` and ``tied_weight_attrs`` (key ->
    its ``tied_weight_attr`` names) of this stage, ``parts``, ``stage_id``,
    ``num_stages``, ``micro_offset`` (``forward`` calls), ``curr_layer``
    (the layer running or last run), ``global_rank``, ``local_rank``,
    ``world_size``, ``world_group``; the methods are
    :class:`~.module_api.PipelineModuleAPI`'s.
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
        interval = checked_interval(activation_checkpoint_interval)
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
        self.seed_fn = seed_fn  # None: set_random_seed, as DeepSpeed
        self.activation_checkpoint_interval = interval
        self.activation_checkpoint_func = activation_checkpoint_func or checkpointing.checkpoint
        self.checkpointable_layers = None if checkpointable_layers is None \
            else list(checkpointable_layers)
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
        self.curr_layer: Optional[int] = None
        self._layer_names = names
        self._tied_comms: Optional[dict[str, dict[str, Any]]] = None
        self._local_start = self.parts[self.stage_id]
        self._local_stop = self.parts[self.stage_id + 1]
        self.tied_modules = torch.nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.forward_funcs: list[Callable[[Any], Any]] = []
        self.fwd_map: dict[str, int] = {}
        self._build(specs)
        self.tied_weights = self._tie(specs)
        if dist.get_rank() == 0:
            ensure_visible()
            tied_keys = [layer.key if isinstance(layer, TiedLayerSpec) else None
                         for layer in specs]
            log.info("%s", self.describe(names, counts if wants_counts else None, tied_keys))

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

    def _reseed(self, seed: int) -> None:
        """``seed_fn(seed)`` (module docstring: what ``seed_layers`` seeds when)."""
        (self.seed_fn or set_random_seed)(seed)

    def _build_tied(self, layer: TiedLayerSpec, first_use: int, index: int) -> Any:
        """The tied module of ``layer`` (layer ``index``, the key's first
        layer ``first_use``): built under ``first_use``'s seed so that every
        stage's copy starts equal, leaving ``index``'s seed set after, as
        DeepSpeed (which builds it under ``index``'s seed)."""
        if not self.seed_layers or first_use == index:
            return layer.build()
        self._reseed(self.base_seed + first_use)
        module = layer.build()
        self._reseed(self.base_seed + index)
        return module

    def _build(self, specs: list[Any]) -> None:
        first_use = {}
        for i, layer in enumerate(specs):
            if isinstance(layer, TiedLayerSpec):
                first_use.setdefault(layer.key, i)
        for index in range(self._local_start, self._local_stop):
            layer = specs[index]
            if self.seed_layers:  # before every layer, as DeepSpeed
                self._reseed(self.base_seed + index)
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    module = self._build_tied(layer, first_use[layer.key], index)
                    layer.check_attrs(module)
                    self.tied_modules[layer.key] = module
                    self.tied_weight_attrs[layer.key] = list(layer.tied_weight_attr)
                module = self.tied_modules[layer.key]
                func = functools.partial(layer.forward_fn, module) if layer.forward_fn \
                    else module
                self.forward_funcs.append(func)
            elif isinstance(layer, (LayerSpec, torch.nn.Module)):
                module = layer.build() if isinstance(layer, LayerSpec) else layer
                self.add_module(str(index), module)
                self.forward_funcs.append(module)
                self.fwd_map[str(index)] = len(self.forward_funcs) - 1
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

    def describe(self, names: Sequence[str], counts: Optional[Sequence[int]],
                 tied_keys: Optional[Sequence[Optional[str]]] = None) -> str:
        """The partition, one line per stage; ``counts`` (per layer): the
        parameters each stage holds, a tied module counted once per stage
        (:func:`held_parameters`; ``tied_keys``: each layer's tie key or None)."""
        lines = [f"pipeline: {self._topology.describe()}, partition_method="
                 f"{self.partition_method!r}"]
        for stage in range(self.num_stages):
            a, b = self.parts[stage], self.parts[stage + 1]
            kinds = ", ".join(dict.fromkeys(names[a:b]))
            params = "" if counts is None else \
                f", {held_parameters(counts, tied_keys or [None] * len(counts), a, b):,} parameters"
            if self.layer_flops is not None:
                params += f", {sum(self.layer_flops[a:b]) / 1e9:.3g} GFLOP per micro-batch " \
                          "(forward + backward)"
            lines.append(f"  stage {stage}: layers {a}-{b - 1} ({kinds}){params}")
        return "\n".join(lines)

    # ------------------------------------------------------------ running

    def _run(self, start: int, stop: int, offset: int) -> Callable[[Any], Any]:
        """This stage's layers ``[start, stop)`` (local indices) in order;
        with ``seed_layers``, each after reseeding for forward call
        ``offset`` (module docstring)."""
        funcs = self.forward_funcs[start:stop]
        first = self._local_start + start

        def run(x: Any) -> Any:
            for index, func in enumerate(funcs, start=first):
                self.curr_layer = index
                if self.seed_layers:
                    self._reseed(self.base_seed * offset + index)
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
        # DeepSpeed's seed base for this call, fixed here so that a
        # recomputation in backward draws the same random numbers
        offset = self.micro_offset + 1
        count = len(self.forward_funcs)
        interval = self.activation_checkpoint_interval
        if interval == 0 or not torch.is_grad_enabled():
            return self._run(0, count, offset)(x)
        for start in range(0, count, interval):
            stop = min(start + interval, count)
            run = self._run(start, stop, offset)
            if not self._checkpointable(start, stop):
                x = run(x)
            elif isinstance(x, tuple):
                # DeepSpeed's convention: the tensors as separate arguments, which
                # a reentrant checkpoint needs to track their gradients
                x = self.activation_checkpoint_func(_as_parts(run), *x)
            else:
                x = self.activation_checkpoint_func(run, x)
        return x
