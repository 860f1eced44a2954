"""``client_state``: checked before a save writes it and before a load changes anything,
and what ``load_checkpoint`` hands back with it (pure, no I/O).

The engine-level state of a checkpoint is rank 0's ``engine_state.pt``, a
dict with ``counters``, ``lr_scheduler``, ``loss_scaler``, the script's
``client_state`` and, since this module exists, the saving engine's
``ds_config`` (its resolved config as a DeepSpeed-style dict) and
``ds_version`` (``dsrun.__version__``, the version ``import deepspeed``
reports). Checkpoints of earlier dsrun versions lack the last two and load
as before; then those keys are not handed back. Checkpoints get copied and
shared, so the config's secrets (``comet.api_key``, any string under a key
naming an api_key, token, secret or password) are saved and handed back as
``"<redacted>"`` (:func:`~dsrun.runtime.config_schema.redact_secrets`; a
checkpoint saved before this holds them, and a load still does not hand
them back).

* :func:`client_state_problem` - at save: a ``client_state`` must be a
  mapping (DeepSpeed merges it into its own state dict with
  ``dict.update``, so anything else fails there; its keys become the
  checkpoint's own), or None for none.
* :func:`returned_client_state` - at load, before the engine changes: the
  dict ``load_checkpoint`` returns, or a :class:`CheckpointError` naming
  what in the file is wrong (a non-mapping client state an earlier dsrun
  saved without complaint).

What DeepSpeed 0.19.8's ``load_checkpoint`` hands back besides the
client's keys (its model-states file's other entries), and what dsrun
returns of them, with the same meaning and types:

==============================  ===============================================
``buffer_names``                persistent buffers, in ``state_dict()`` order
``param_shapes``                one ``OrderedDict`` name -> ``torch.Size`` per
                                param group (trained parameters); None when
                                saved at ZeRO stage 0
``frozen_param_shapes``         ``OrderedDict`` name -> ``torch.Size`` of the
                                frozen parameters; None unless saved at stage
                                2 or 3 without ``exclude_frozen_parameters``
``shared_params``               tied name -> the name holding the weight; None
                                when saved at stage 0
``global_samples``              always; with ``load_module_only=True`` also
                                ``global_steps``, ``skipped_steps``,
                                ``dp_world_size`` and ``mp_world_size`` (1)
``checkpoint_parallel_dimensions``  ``{"pp_degree": stages, "tp_degree": 1}``
``ds_config``, ``ds_version``   the saving engine's (above)
==============================  ===============================================

Not handed back: ``frozen_param_fragments`` (DeepSpeed's per-rank copies of
the frozen weights: the weights are loaded into the model), the stage-0
``optimizer`` state dict and, with ``load_lr_scheduler_states=False``, the
``lr_scheduler`` one (dsrun's layouts are its own), and ``data_sampler`` /
``random_ltd`` (None in DeepSpeed unless its curriculum learning ran). A key
the client saved under one of these names wins, as it overwrites
DeepSpeed's own in its file.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Optional

import torch

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.manifest import Manifest
from dsrun.runtime.config_schema import redact_secrets

COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
# every key of DeepSpeed's that a load may hand back (table above)
RETURNED_KEYS = ("buffer_names", "param_shapes", "frozen_param_shapes", "shared_params",
                 "skipped_steps", "global_steps", "global_samples", "dp_world_size",
                 "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version")


def client_state_problem(client_state: Any) -> Optional[str]:
    """Why ``save_checkpoint`` cannot save ``client_state``, or None."""
    if client_state is None or isinstance(client_state, Mapping):
        return None
    return (f"save_checkpoint(client_state=...) must be a dict (a Mapping), got "
            f"{type(client_state).__name__} {_short(client_state)}: DeepSpeed merges it into "
            "its checkpoint's own dict, so its keys are names; wrap the value, e.g. "
            "client_state={'data': value} (nothing was written)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def saved_problem(state: Any) -> Optional[str]:
    """Why the unpickled ``engine_state.pt`` cannot be installed, or None."""
    if state is None:
        return None
    if not isinstance(state, Mapping):
        return f"engine_state.pt holds a {type(state).__name__}, not a dict"
    client = state.get("client_state")
    if client is not None and not isinstance(client, Mapping):
        return (f"its client_state is a {type(client).__name__} {_short(client)}, not a dict "
                "(an earlier dsrun saved it without complaint; DeepSpeed refuses it at save): "
                "load_checkpoint cannot return it. The weights are intact: `dsrun checkpoint "
                "to-fp32` or get_fp32_state_dict() reads them")
    counters = state.get("counters") or {}
    if not isinstance(counters, Mapping) or not all(
            isinstance(v, int) for k, v in counters.items() if k in COUNTERS):
        return f"its counters are not whole numbers: {_short(counters)}"
    return None


def _ordered(manifest: Manifest) -> list[str]:
    """The checkpoint's tensor names, in the saved model's ``state_dict()`` order."""
    keys = [k for k in manifest.meta.get("state_dict_keys") or () if k in manifest.tensors]
    seen = set(keys)
    return keys + [k for k in manifest.tensors if k not in seen]


def _frozen(manifest: Manifest) -> set[str]:
    """Parameters frozen when saved (``meta["frozen"]``; earlier checkpoints:
    the parameters in no param group)."""
    if "frozen" in manifest.meta:
        return set(manifest.meta["frozen"] or ())
    return {n for n, e in manifest.tensors.items() if e.kind == "param" and e.group is None}


def deepspeed_keys(state: Mapping[str, Any], manifest: Manifest, module_only: bool
                   ) -> dict[str, Any]:
    """DeepSpeed's own entries of the returned client state (module docstring)."""
    meta = manifest.meta
    stage = int(meta.get("zero_stage") or 0)
    names, frozen = _ordered(manifest), _frozen(manifest)
    entries = manifest.tensors
    out: dict[str, Any] = {"buffer_names": [n for n in names if entries[n].kind == "buffer"]}
    groups = [n for n in names if entries[n].kind == "param" and entries[n].group is not None
              and n not in frozen]
    count = max([len(manifest.param_groups)] + [entries[n].group + 1 for n in groups])
    shapes: list[OrderedDict[str, torch.Size]] = [OrderedDict() for _ in range(count)]
    for name in groups:
        shapes[entries[name].group][name] = torch.Size(entries[name].shape)
    out["param_shapes"] = shapes if stage > 0 else None
    kept = stage >= 2 and not meta.get("excluded_frozen")
    out["frozen_param_shapes"] = OrderedDict(
        (n, torch.Size(entries[n].shape)) for n in names if n in frozen) if kept else None
    params = {n for n in names if entries[n].kind == "param"} | set(meta.get("excluded_frozen")
                                                                     or ())
    out["shared_params"] = {a: t for a, t in manifest.aliases.items()
                            if t in params} if stage > 0 else None
    counters = state.get("counters") or {}
    for key in ("skipped_steps", "global_steps", "global_samples") if module_only \
            else ("global_samples",):
        if key in counters:
            out[key] = int(counters[key])
    if module_only and "dp_world_size" in meta:
        out.update(dp_world_size=int(meta["dp_world_size"]), mp_world_size=1)
    stages = (meta.get("pipeline") or {}).get("stages", 1)
    out["checkpoint_parallel_dimensions"] = {"pp_degree": int(stages), "tp_degree": 1}
    if "ds_config" in state:
        out["ds_config"] = redact_secrets(state["ds_config"])
    if "ds_version" in state:
        out["ds_version"] = state["ds_version"]
    return out


def returned_client_state(state: Optional[Mapping[str, Any]], manifest: Manifest,
                          module_only: bool, path: str) -> dict[str, Any]:
    """What ``load_checkpoint`` returns as its client state: DeepSpeed's
    keys, then the saved ``client_state``'s (which win). Raises before the
    engine changes when the saved state cannot be installed."""
    problem = saved_problem(state)
    if problem:
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {problem}")
    state = state or {}
    out = deepspeed_keys(state, manifest, module_only)
    out.update(state.get("client_state") or {})
    return out
