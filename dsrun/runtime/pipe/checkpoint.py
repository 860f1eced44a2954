"""Pipeline checkpoints: the checkpoint layout of a :class:`~.engine.PipelineEngine`.

A pipeline engine saves and loads with the engine's ``save_checkpoint`` /
``load_checkpoint`` (:mod:`dsrun.runtime.checkpoint`: one format keyed by
parameter name, tag agreement with a deadline, crash-safe commits,
verified loads, asynchronous saves). What differs is what each rank holds,
and :class:`PipelineLayout` says it:

* **Exports.** Each rank exports its own stage's state: its share of the
  stage's data-parallel group (its ZeRO-1/2 partitions, or its split of the
  replicated stage-0 tensors). A tensor that several stages hold under one
  name is written by one of them only: a tied module's by the lowest (tied
  weights are kept bitwise equal), ``loss_fn``'s by the highest - the last
  stage, the only one that runs ``loss_fn``, so the only one whose copy of
  a trainable ``loss_fn`` parameter or a buffer it updates moves
  (:func:`writing_stages`; :func:`save_16bit_model` picks the same copy).
* **Model-wide names.** The manifest's ``state_dict_keys`` (the order
  ``dsrun checkpoint to-fp32`` writes), its aliases and the frozen
  parameters left out are the whole model's, learnt in one exchange among
  the ranks - after an agreement with a deadline, so a rank that does not
  call ``save_checkpoint`` is named rather than waited for. The stages' key
  lists merge into the one-stage model's order
  (:func:`merge_state_dict_keys`). Names do not depend on the number of
  stages (:mod:`.module`): a pipeline checkpoint is the one-stage model's
  checkpoint, and loads into any number of stages or replicas, or into a
  plain engine whose module has the same names (and the other way round).
* **Data position.** Only a replica's first stage reads data: every rank
  records its replica's first stage's dataloader position, so a load into
  any layout continues with the next batch.
* **Param groups.** A checkpoint holds one set of param-group
  hyperparameters: stages whose optimizers' groups differ cannot be saved
  into one (an error naming the stages and the first difference).
* ``meta["pipeline"]``: stages, replicas and layer boundaries, for
  ``dsrun checkpoint info``.

A load needs only the whole model's aliases (the same exchange): every rank
asks for the ranges of its stage's tensors wherever they were saved, and
every holder of a tied tensor loads the same saved value, so tied copies
stay tied in any layout.

:func:`save_16bit_model` writes the whole model's weights into one file
(the engine's version would write rank 0's stage only).
"""

from __future__ import annotations

import collections
import io
import os
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import torch

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.coord import Coordinator, raise_failures
from dsrun.runtime.checkpoint.engine_io import (
    CheckpointLayout,
    SaveParts,
    checkpointer,
    frozen_names,
    state_sources,
    wait,
    without,
)
from dsrun.runtime.checkpoint.fragments import ExportedState, StateSource
from dsrun.runtime.checkpoint.manifest import encode
from dsrun.runtime.checkpoint.model16 import state_dict16
from dsrun.runtime.checkpoint.rank_state import loader_state
from dsrun.runtime.checkpoint.sources import aliases
from dsrun.runtime.checkpoint.storage import atomic_write

# ------------------------------------------------------------ pure helpers


def _is_layer_key(key: str) -> bool:
    return key.split(".", 1)[0].isdigit()


def merge_state_dict_keys(per_stage: Sequence[Sequence[str]]) -> list[str]:
    """The one-stage model's ``state_dict()`` key order, from each stage's
    (in stage order). A stage's keys are the module-level ones registered
    before its layers (``loss_fn``'s, the tied modules'), its layers'
    (``"<index>.<name>"``, in layer order), then any registered after; the
    module-level keys several stages share appear once, where first seen."""
    head: list[str] = []
    layers: list[str] = []
    tail: list[str] = []
    seen: set[str] = set()
    for keys in per_stage:
        marks = [i for i, key in enumerate(keys) if _is_layer_key(key)]
        first, last = (marks[0], marks[-1] + 1) if marks else (len(keys), len(keys))
        for into, part in ((head, keys[:first]), (tail, keys[last:])):
            for key in part:
                if key not in seen:
                    seen.add(key)
                    into.append(key)
        layers.extend(keys[first:last])
    return head + layers + tail


def _last_stage_owns(key: str) -> bool:
    """A name whose live copy is the highest stage's: ``loss_fn`` runs on the
    last stage only, so only there do its parameters train and its buffers
    update (the other stages' copies keep their initial values)."""
    return key.startswith("loss_fn.")


def writing_stages(per_stage: Sequence[Sequence[str]]) -> dict[str, int]:
    """``name -> stage`` that writes it: the lowest stage holding it, but the
    highest for ``loss_fn``'s names (:func:`_last_stage_owns`)."""
    out: dict[str, int] = {}
    for stage, keys in enumerate(per_stage):
        for key in keys:
            if _last_stage_owns(key):
                out[key] = stage
            else:
                out.setdefault(key, stage)
    return out


def group_difference(per_stage: Sequence[Optional[Sequence[Mapping[str, Any]]]]
                     ) -> Optional[str]:
    """The first difference between the stages' param-group hyperparameters
    (None for a stage without an optimizer), or None when they agree."""
    known = [(s, g) for s, g in enumerate(per_stage) if g is not None]
    if not known:
        return None
    base_stage, base = known[0]
    for stage, groups in known[1:]:
        if len(groups) != len(base):
            return (f"stage {base_stage} has {len(base)} param group(s), stage {stage} has "
                    f"{len(groups)}")
        for index, (a, b) in enumerate(zip(base, groups)):
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    return (f"param group {index} has {key}={a.get(key)!r} on stage "
                            f"{base_stage} and {key}={b.get(key)!r} on stage {stage}")
    return None


def _encoded_groups(exports: Sequence[ExportedState]) -> Optional[list[dict[str, Any]]]:
    for export in exports:
        if export.optimizer:
            return [{k: encode(v) for k, v in group.items()} for group in export.groups]
    return None


def _keep_fragments(export: ExportedState, drop: set[str]) -> ExportedState:
    """``export`` without the fragments of ``drop`` (still declared: another
    stage writes them)."""
    return ExportedState(export.tensors, tuple(f for f in export.fragments if f.name not in drop),
                         export.groups, export.optimizer, export.replica)


# ------------------------------------------------------------ the layout


class PipelineLayout(CheckpointLayout):
    """A pipeline engine's checkpoint layout (module docstring)."""

    def sources(self, names: Mapping[int, str]) -> list[StateSource]:
        # the data-parallel group is the stage's: replicated tensors are
        # split among its ranks, ZeRO partitions live there
        return state_sources(self.engine, names)

    def _everyone(self, coord: Coordinator, what: str, mine: dict[str, Any]
                  ) -> list[dict[str, Any]]:
        """Every rank's ``mine``: an agreement first (a missing rank is named
        within the checkpoint timeout), then one exchange."""
        coord.agree(what, {})
        return coord.exchange(mine)

    def save_parts(self, names: Mapping[int, str], exclude_frozen: bool,
                   coord: Coordinator) -> SaveParts:
        engine, grid = self.engine, self.engine.grid
        module = engine.module
        exports = [s.export_state(names) for s in self.sources(names)]
        frozen = frozen_names(module)
        excluded = frozen if exclude_frozen else []
        if excluded:
            exports = [without(e, set(excluded)) for e in exports]
        mine: dict[str, Any] = {"data": loader_state(engine.training_dataloader,
                                                     engine.dp_world_size)
                                if grid.is_first_stage else None}
        if grid.data_parallel_id == 0:  # one rank per stage tells the stage's names
            mine.update(keys=list(module.state_dict(keep_vars=True)), aliases=aliases(module),
                        excluded=excluded, frozen=frozen,
                        groups=_encoded_groups(exports))
        everyone = self._everyone(coord, "engine.save_checkpoint()", mine)
        stages = [everyone[grid.stage_to_global(s, data=0)] for s in range(grid.stages)]
        difference = group_difference([s["groups"] for s in stages])
        if difference:
            raise CheckpointError(
                f"the pipeline stages' optimizers have different param groups ({difference}): "
                "a checkpoint stores one set of param-group hyperparameters, so every stage's "
                "optimizer must have the same groups")
        per_stage = [s["keys"] for s in stages]
        others = {n for n, s in writing_stages(per_stage).items() if s != grid.stage_id}
        if others:
            exports = [_keep_fragments(e, others) for e in exports]
        left_out = sorted({n for s in stages for n in s["excluded"]})
        merged_aliases: dict[str, str] = {}
        for stage in stages:
            merged_aliases.update(stage["aliases"])
        meta = {"excluded_frozen": left_out,
                "frozen": sorted({n for s in stages for n in s["frozen"]}),
                "state_dict_keys": [k for k in merge_state_dict_keys(per_stage)
                                    if k not in left_out],
                "pipeline": {"stages": grid.stages, "replicas": grid.topology().replicas,
                             "parts": list(module.parts)}}
        data = everyone[grid.stage_to_global(0)]["data"]
        return SaveParts(exports, meta, merged_aliases, {"data": data})

    def load_aliases(self, coord: Coordinator) -> dict[str, str]:
        """The union of the stages' aliases (what the one-stage model has)."""
        grid = self.engine.grid
        mine = aliases(self.engine.module) if grid.data_parallel_id == 0 else {}
        merged: dict[str, str] = {}
        for theirs in self._everyone(coord, "engine.load_checkpoint()", mine):
            merged.update(theirs)
        return merged


# ------------------------------------------------------------ 16-bit model


def _status(run: Callable[[], None]) -> Optional[str]:
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - reported on every rank
        return f"{type(exc).__name__}: {exc}"
    return None


def _save(state: Mapping[str, torch.Tensor], path: str) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write(path, buffer.getvalue())


def _merge16(path: str, first: Mapping[str, torch.Tensor], parts: Sequence[str]) -> None:
    """Rank 0: stage 0's state and the other stages' part files -> ``path``."""
    try:
        states = [first, *(torch.load(p, map_location="cpu", weights_only=True) for p in parts)]
        owner = writing_stages([list(state) for state in states])
        values = {key: value for stage, state in enumerate(states)
                  for key, value in state.items() if owner[key] == stage}
        order = merge_state_dict_keys([list(state) for state in states])
        _save(collections.OrderedDict((key, values[key]) for key in order), path)
    finally:
        for part in parts:
            if os.path.exists(part):
                os.unlink(part)


def save_16bit_model(engine: Any, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """``engine.save_16bit_model`` of a pipeline: the one-stage model's state
    dict in the training's 16-bit dtype, in one file. Each stage's first
    replica collects its stage's; stages after the first write theirs next
    to the output, then rank 0 merges them in the one-stage model's key order
    and writes the file atomically (the parts are removed)."""
    wait(engine)
    grid = engine.grid
    coord = checkpointer(engine).coord
    path = os.path.join(os.path.abspath(str(save_dir)), save_filename)
    coord.agree("engine.save_16bit_model()", {"path": path})
    collect = grid.data_parallel_id == 0
    state = state_dict16(engine, exclude_frozen_parameters, keep=collect)
    parts = [f"{path}.stage{stage}.part" for stage in range(1, grid.stages)]
    status = None
    if collect and grid.stage_id > 0:
        def write() -> None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _save(state, parts[grid.stage_id - 1])
        status = _status(write)
    statuses = coord.exchange(status)
    if any(statuses) and coord.rank == 0:
        for part in parts:
            if os.path.exists(part):
                os.unlink(part)
    raise_failures(statuses, f"saving the 16-bit model to {path}")
    status = None
    if coord.rank == 0:
        def merge() -> None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _merge16(path, state, parts)
        status = _status(merge)
    raise_failures(coord.exchange(status), f"saving the 16-bit model to {path}")
    return True
