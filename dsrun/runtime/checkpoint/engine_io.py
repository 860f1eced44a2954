"""``engine.save_checkpoint`` / ``load_checkpoint`` / ``save_16bit_model``.

The engine delegates here. This module knows the engine's attributes (its
module, optimizer, precision, scheduler, counters, dataloader) and turns
them into state sources (:mod:`.fragments`) plus the engine-level state:

* rank 0's ``engine_state.pt``: LR scheduler, loss scaler, ``client_state``,
  the counters (``global_steps``, ``global_samples``, ``skipped_steps``,
  ``micro_steps``) and DeepSpeed's ``ds_config`` / ``ds_version``
  (:mod:`.client_state`: what a load hands back besides the client's keys);
* every rank's record: its RNG states and dataloader position
  (:mod:`.rank_state`; a load leaves the dataloader alone with the config's
  ``"checkpoint": {"load_data_position": false}``, and a save warns once of
  training loaders whose position it does not keep).

What each rank exports, and the model-wide names the manifest records
(``state_dict_keys``, aliases, frozen parameters left out), come from the
engine's :class:`CheckpointLayout`: ``engine._checkpoint_layout()`` where
the engine defines it, else the default - a model whole on every rank of a
data-parallel group that is the whole world. An engine whose ranks hold
different parts of the model (a pipeline's stages,
:mod:`dsrun.runtime.pipe.checkpoint`) returns its own.

One :class:`Checkpointer` per engine holds the ``checkpoint`` settings, the
coordinator and the asynchronous save in flight.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

import dsrun
from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.async_save import AsyncSaver
from dsrun.runtime.checkpoint.client_state import (
    COUNTERS,
    client_state_problem,
    returned_client_state,
)
from dsrun.runtime.checkpoint.coord import Coordinator, raise_first
from dsrun.runtime.checkpoint.fragments import ExportedState, StateSource
from dsrun.runtime.checkpoint.rank_state import (
    capture_rng,
    loader_state,
    restore_loader,
    restore_rng,
    unsaved_loaders,
)
from dsrun.runtime.checkpoint.reader import Loaded, LoadRequest, load_state
from dsrun.runtime.checkpoint.settings import CheckpointSettings
from dsrun.runtime.checkpoint.sources import ModuleTensors, Stage0State, aliases, parameter_names
from dsrun.runtime.checkpoint.writer import SaveRequest, begin_save, save_state
from dsrun.runtime.config_schema import redact_secrets

log = logging.getLogger("dsrun.runtime.checkpoint")


class Checkpointer:
    """Per-engine checkpoint state (module docstring)."""

    def __init__(self, settings: CheckpointSettings) -> None:
        self.settings = settings
        self._coord: Optional[Coordinator] = None
        self.saver = AsyncSaver(settings.timeout_s)
        self.warned: set[str] = set()  # the warnings given once per engine

    @property
    def coord(self) -> Coordinator:
        if self._coord is None:
            self._coord = Coordinator(self.settings.timeout_s)
        return self._coord

    def wait(self) -> None:
        """Join an asynchronous save in flight; raise its failure on every rank.

        Only rank 0 commits a save (the rename, ``latest``), so when one was
        in flight the ranks then agree, carrying each rank's error: no rank
        goes on (reads ``latest``, starts the next save) before rank 0 has
        committed, and a failure seen by one rank's thread (rank 0's commit,
        rank 1's write) is raised, the same, on all of them. Every rank calls
        this at the same points (save, load, ``wait_for_checkpoint``,
        ``destroy``, ``save_16bit_model``), and every rank had the same saves
        in flight."""
        in_flight = self.saver.pending()
        error = self.saver.wait()
        if in_flight:
            seen = self.coord.agree("waiting for the asynchronous save", {"error": error})
            raise_first([e["error"] for e in seen], "the asynchronous save")
        # with nothing in flight the saver has no error to give (start()
        # resets it, wait() clears it with the thread)
        assert in_flight or error is None, error


def checkpointer(engine: Any) -> Checkpointer:
    found = getattr(engine, "_checkpointer", None)
    if found is None:
        found = Checkpointer(CheckpointSettings.from_config(getattr(engine.config, "checkpoint",
                                                                    None)))
        engine._checkpointer = found
    return found


def wait(engine: Any) -> None:
    """Wait for an asynchronous save in flight and raise its failure."""
    found = getattr(engine, "_checkpointer", None)
    if found is not None:
        found.wait()


def _replica(engine: Any) -> tuple[int, int]:
    return torch.distributed.get_rank(engine.dp_group), engine.dp_world_size


def state_sources(engine: Any, names: Mapping[int, str]) -> list[StateSource]:
    """The optimizer's source (ZeRO, or stage 0), then the module's other
    parameters and its buffers; replicated over the engine's data-parallel group."""
    sources: list[Any] = []
    if engine.zero_stage > 0:
        sources.append(engine.optimizer)
    elif engine.optimizer is not None:
        sources.append(Stage0State(engine.module, engine.optimizer, engine.precision,
                                   _replica(engine)))
    declared = [n for s in sources for n in s.export_state(names).tensors]
    sources.append(ModuleTensors(engine.module, declared, _replica(engine)))
    return sources


def frozen_names(module: torch.nn.Module) -> list[str]:
    return sorted(n for n, p in module.named_parameters() if not p.requires_grad)


@dataclass(frozen=True)
class SaveParts:
    """What a layout contributes to one save: this rank's exports, the
    model-wide meta (``state_dict_keys``, ``excluded_frozen``, ``frozen``:
    the parameters frozen when saved, ...), the
    model's aliases and entries of this rank's record that replace the
    engine's (e.g. ``data``)."""

    exports: list[ExportedState]
    meta: dict[str, Any]
    aliases: dict[str, str]
    extra: dict[str, Any] = field(default_factory=dict)


class CheckpointLayout:
    """How an engine's state maps onto a checkpoint (module docstring): the
    default, for a module that is the whole model on every rank."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def sources(self, names: Mapping[int, str]) -> list[StateSource]:
        if self.engine.dp_world_size != self.engine.world_size:
            raise CheckpointError("checkpoints of engines whose data-parallel group is not the "
                                  "whole world (model parallelism through mpu=) are not "
                                  "implemented in dsrun yet")
        return state_sources(self.engine, names)

    def save_parts(self, names: Mapping[int, str], exclude_frozen: bool,
                   coord: Coordinator) -> SaveParts:
        module = self.engine.module
        exports = [s.export_state(names) for s in self.sources(names)]
        frozen = frozen_names(module)
        excluded = frozen if exclude_frozen else []
        if excluded:
            exports = [without(e, set(excluded)) for e in exports]
        keys = [k for k in module.state_dict(keep_vars=True) if k not in excluded]
        return SaveParts(exports, {"excluded_frozen": excluded, "frozen": frozen,
                                   "state_dict_keys": keys}, aliases(module))

    def load_aliases(self, coord: Coordinator) -> dict[str, str]:
        """The model's aliases; equal on every rank (the load compares with them)."""
        return aliases(self.engine.module)


def layout_of(engine: Any) -> CheckpointLayout:
    """The engine's own layout (``_checkpoint_layout()``), else the default."""
    make = getattr(engine, "_checkpoint_layout", None)
    return make() if make is not None else CheckpointLayout(engine)


def without(export: ExportedState, names: set[str]) -> ExportedState:
    return ExportedState({k: v for k, v in export.tensors.items() if k not in names},
                         tuple(f for f in export.fragments if f.name not in names),
                         export.groups, export.optimizer, export.replica)


def _meta(engine: Any, model: Mapping[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {c: int(getattr(engine, c)) for c in COUNTERS}
    meta.update(zero_stage=engine.zero_stage, precision=engine.precision.name,
                dp_world_size=engine.dp_world_size,
                train_batch_size=engine.config.train_batch_size,
                gradient_accumulation_steps=engine.config.gradient_accumulation_steps,
                dsrun_version=dsrun.DSRUN_VERSION, torch_version=torch.__version__,
                created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                **model)
    return meta


def _engine_state(engine: Any, client_state: Any) -> dict[str, Any]:
    scaler = getattr(engine.precision, "scaler", None)
    sched = engine.lr_scheduler
    to_dict = getattr(engine.config, "to_dict", None)
    return {"counters": {c: int(getattr(engine, c)) for c in COUNTERS},
            "lr_scheduler": sched.state_dict() if sched is not None and
            hasattr(sched, "state_dict") else None,
            "loss_scaler": scaler.state_dict() if scaler is not None else None,
            "client_state": client_state,
            # DeepSpeed saves its config and version with every checkpoint and
            # load_checkpoint hands them back: the resolved config here, less
            # its secrets (checkpoints are shared more than logs are)
            "ds_config": redact_secrets(to_dict()) if callable(to_dict) else None,
            "ds_version": dsrun.__version__}


def save(engine: Any, save_dir: str, tag: Any = None, client_state: Any = None,
         save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    """``engine.save_checkpoint`` (DeepSpeed's signature; returns True)."""
    ck = checkpointer(engine)
    ck.wait()
    # stage 0: a scale the script wrote and no backward took yet is the one saved
    engine.precision.take_written_scale()
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    if engine.micro_in_round():
        log.warning("save_checkpoint at micro-step %d, inside a gradient accumulation round: "
                    "the gradients accumulated so far are not saved", engine.micro_steps)
    names = parameter_names(engine.module)
    parts = layout_of(engine).save_parts(names, exclude_frozen_parameters, ck.coord)
    rank = ck.coord.rank
    extra = {"rng": capture_rng(), "data": loader_state(engine.training_dataloader,
                                                        engine.dp_world_size)}
    if rank == 0:
        _warn_unsaved_loaders(engine, ck)
    # each rank's own client_state is checked (DeepSpeed fails on the rank
    # that passes a bad one); only rank 0's is saved, as in DeepSpeed
    problem = client_state_problem(client_state)
    request = SaveRequest(
        save_dir, tag, save_latest, _meta(engine, parts.meta), parts.aliases,
        _engine_state(engine, {} if client_state is None else client_state)
        if rank == 0 and not problem else None, {**extra, **parts.extra}, ck.settings.fsync,
        problem)
    exports = parts.exports
    if not ck.settings.async_save:
        save_state(request, exports, ck.coord, ck.settings.pause)
        return True
    write, commit = begin_save(request, exports, ck.coord, ck.settings.pause)
    ck.saver.start(write, commit if rank == 0 else None, tag, ck.coord.board())
    return True


def _warn_unsaved_loaders(engine: Any, ck: Checkpointer) -> None:
    """Once per engine: the training loaders whose position is not saved."""
    built = getattr(engine, "_train_io_loaders", None) or ()
    for warning in unsaved_loaders(engine.training_dataloader, list(built)):
        if warning not in ck.warned:
            ck.warned.add(warning)
            log.warning("save_checkpoint: %s", warning)


def before_step(engine: Any) -> None:
    """Called by ``engine.step()`` before it changes anything: an
    asynchronous save still copying the state must finish copying first."""
    found = getattr(engine, "_checkpointer", None)
    if found is not None:
        found.saver.wait_staged()


def load(engine: Any, load_dir: str, tag: Any = None, load_module_strict: bool = True,
         load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
         load_module_only: bool = False, custom_load_fn: Any = None
         ) -> tuple[Optional[str], Optional[Any]]:
    """``engine.load_checkpoint`` -> ``(path of the tag's directory,
    client_state)``; ``(None, None)`` when there is nothing to load. The
    client state comes back as saved, its tensors in host memory (loaded to
    the CPU on every rank, as DeepSpeed does)."""
    if custom_load_fn is not None:
        raise CheckpointError("load_checkpoint(custom_load_fn=...) is not supported by dsrun")
    ck = checkpointer(engine)
    ck.wait()
    # stage 0: a written scale goes to the scaler first, as ZeRO 1-3's setter
    # writes it: kept unless the optimizer states (the scaler) are loaded
    engine.precision.take_written_scale()
    names = parameter_names(engine.module)
    layout = layout_of(engine)
    optimizer_states = bool(load_optimizer_states) and not load_module_only \
        and engine.optimizer is not None and not engine._partition_only
    sources = layout.sources(names)
    module_only = bool(load_module_only)

    def client(found: Loaded) -> dict[str, Any]:  # before anything is installed
        return returned_client_state(found.engine_state, found.manifest, module_only,
                                     found.path)

    request = LoadRequest(str(load_dir), None if tag is None else str(tag),
                          bool(load_module_strict), optimizer_states,
                          layout.load_aliases(ck.coord), client)
    accumulating = engine.micro_in_round() != 0
    loaded = load_state(request, sources, names, ck.coord)
    if loaded is None:
        return None, None
    meta = loaded.manifest.meta
    engine.loaded_checkpoint_dp_world_size = int(meta.get("dp_world_size",
                                                          loaded.manifest.world_size))
    engine.loaded_checkpoint_mp_world_size = 1  # dsrun saves no model-parallel slices
    if accumulating:  # gradients of the interrupted accumulation round are stale now
        engine.zero_grad(set_to_none=False)
    state = loaded.engine_state or {}
    if not module_only:
        _restore_engine(engine, state, loaded.record, load_lr_scheduler_states,
                        bool(load_optimizer_states), loaded.saved_rank == ck.coord.rank)
    return loaded.path, loaded.prepared


def _restore_engine(engine: Any, state: Mapping[str, Any], record: Mapping[str, Any],
                    scheduler: bool, loss_scale: bool, own_record: bool) -> None:
    for name, value in (state.get("counters") or {}).items():
        if name in COUNTERS:
            setattr(engine, name, int(value))
    # A full accumulation round starts here, whatever the saved run's
    # accumulation steps were (another world size may have changed them).
    engine.start_accumulation_round()
    sched_state = state.get("lr_scheduler")
    if scheduler and sched_state is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(sched_state)
    scaler = getattr(engine.precision, "scaler", None)
    # DeepSpeed keeps the loss scaler in the optimizer's state: it is
    # loaded with that state only (a fresh scale after a collapse).
    if loss_scale and scaler is not None and state.get("loss_scaler") is not None:
        scaler.load_state_dict(state["loss_scaler"])
    if own_record and record.get("rng"):
        restore_rng(record["rng"])
    elif record.get("rng"):
        log.info("rank %d has no saved RNG state (the checkpoint has fewer ranks): its RNG "
                 "continues as it is", engine.global_rank)
    section = getattr(engine.config, "checkpoint", None)
    if getattr(section, "load_data_position", True):
        restore_loader(engine.training_dataloader, record.get("data"), engine.dp_world_size,
                       announce=engine.global_rank == 0)
    elif record.get("data") is not None and engine.global_rank == 0:
        log.info("dataloader: the checkpoint's data position is not restored "
                 "(checkpoint.load_data_position is false)")
