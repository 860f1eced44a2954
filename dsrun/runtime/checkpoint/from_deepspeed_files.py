"""Reading a DeepSpeed checkpoint's files, without DeepSpeed (for :mod:`.from_deepspeed`).

A DeepSpeed ``save_checkpoint`` writes ``DS_DIR/TAG/`` with

* ``mp_rank_00_model_states.pt`` (ZeRO stages 0-2, data-parallel rank 0)
  or ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (stage 3, every rank):
  the module's state dict, parameter shapes by flat group, frozen
  parameters, the LR scheduler, the counters and the client's extra keys;
* ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` (stages 1-3, every
  rank): that rank's flat fp32 partitions and the inner optimizer's state
  over them, the loss scaler;

and ``DS_DIR/latest`` names the newest tag. :func:`inventory` names the
files of a tag and refuses, before reading any tensor, what the importer
does not convert - pipeline-parallel ``layer_*`` files, model/tensor
parallel ``mp_rank_01``, mixture-of-experts files, universal checkpoints
(``zero/``), NVMe-offloaded state - with :class:`UnsupportedCheckpoint`
naming the file; a missing file is a :class:`~dsrun.errors.CheckpointError`
naming it.

:func:`load` reads one file with ``torch.load`` and an unpickler that
turns DeepSpeed's own classes (its loss scaler, ``ZeroStageEnum``,
``fragment_address``) into :class:`DeepSpeedObject` records, so neither
DeepSpeed nor its version has to be installed. Everything else in the
files is unpickled as ``torch.load(weights_only=False)`` does (a client
state may hold any object): load only checkpoints you trust.
:func:`check_version` accepts the DeepSpeed versions whose format the
importer was verified against (:data:`VERSIONS`).
"""

from __future__ import annotations

import os
import pickle
import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.from_deepspeed_kinds import (
    LATEST,
    MODEL_STATES,
    OPTIM_STATES,
    REFUSED_DIRS,
    ZERO3_MODEL_STATES,
    natural_key,
    refused_kind,
)
from dsrun.runtime.checkpoint.manifest import MANIFEST

# (major, minor) of the DeepSpeed versions whose files this importer reads:
# the format (flat partitions, paddings, key names) was checked against 0.19.8
VERSIONS = frozenset({(0, 19)})


class UnsupportedCheckpoint(CheckpointError):
    """A DeepSpeed checkpoint of a kind the importer does not convert."""

    exit_code = 2


class DeepSpeedObject:
    """A DeepSpeed class instance read from a checkpoint: its class path,
    constructor ``args`` (enums) and ``state`` (attributes)."""

    ds_class = "deepspeed"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.state: dict[str, Any] = dict(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, __slots__ values)
            state = {**(state[0] or {}), **(state[1] or {})}
        self.state = dict(state) if isinstance(state, Mapping) else {"value": state}
        self.args = getattr(self, "args", ())

    def __repr__(self) -> str:
        return f"<{self.ds_class} {self.state or self.args}>"


_STUBS: dict[str, type] = {}


def _stub(module: str, name: str) -> type:
    path = f"{module}.{name}"
    if path not in _STUBS:
        _STUBS[path] = type(name, (DeepSpeedObject,), {"ds_class": path, "__module__": module})
    return _STUBS[path]


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "deepspeed" or module.startswith("deepspeed."):
            return _stub(module, name)
        return super().find_class(module, name)


_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="pickle")


def load(path: str) -> dict[str, Any]:
    """One DeepSpeed file (module docstring); a missing, unreadable or
    corrupt file is a CheckpointError naming it."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - zip, pickle and torch errors alike
        raise CheckpointError(f"{path} is corrupt or not a torch.save file "
                              f"({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not DeepSpeed's dict: it "
                              "is not a DeepSpeed checkpoint file")
    return data


def fields(value: Any) -> dict[str, Any]:
    """The attributes of a :class:`DeepSpeedObject` (a dict as it is)."""
    if isinstance(value, DeepSpeedObject):
        return value.state
    return dict(value) if isinstance(value, Mapping) else {}


def enum_value(value: Any) -> Any:
    """``ZeroStageEnum.gradients`` -> 2 (an int stays an int)."""
    if isinstance(value, DeepSpeedObject) and value.args:
        return value.args[0]
    return value


def check_version(data: Mapping[str, Any], path: str) -> str:
    version = data.get("ds_version")
    match = re.match(r"(\d+)\.(\d+)", str(version))
    if match is None or (int(match.group(1)), int(match.group(2))) not in VERSIONS:
        known = ", ".join(f"{a}.{b}.x" for a, b in sorted(VERSIONS))
        raise UnsupportedCheckpoint(
            f"{path} was written by DeepSpeed {version}; this importer reads the format of "
            f"DeepSpeed {known} only (other versions lay their files out differently): load it "
            "with that DeepSpeed version and save it again, or convert it with DeepSpeed's "
            "zero_to_fp32.py and load the weights with model.load_state_dict()")
    return str(version)


@dataclass(frozen=True)
class Inventory:
    """The files of one DeepSpeed tag (module docstring)."""

    root: str
    tag: str
    path: str
    model_files: tuple[str, ...]   # stage 0-2: rank 0's; stage 3: one per rank
    optim_files: tuple[str, ...]   # by data-parallel rank; empty at stage 0

    @property
    def stage3(self) -> bool:
        return len(self.model_files) > 1 or os.path.basename(
            self.model_files[0]).startswith("zero_pp_rank_")


def resolve_tag(root: str, tag: Optional[str]) -> str:
    """``tag``, else the one ``root/latest`` names."""
    if not os.path.isdir(root):
        raise CheckpointError(f"the DeepSpeed checkpoint directory {root} does not exist"
                              if not os.path.exists(root) else f"{root} is not a directory")
    if tag is not None:
        return str(tag)
    latest = os.path.join(root, LATEST)
    try:
        with open(latest, encoding="utf-8") as f:
            found = f.read().strip()
    except FileNotFoundError:
        _not_dsrun(root)
        if any(MODEL_STATES.fullmatch(n) or ZERO3_MODEL_STATES.fullmatch(n)
               for n in os.listdir(root)):
            raise CheckpointError(f"{root} is a DeepSpeed tag directory: pass the directory "
                                  f"above it and --tag {os.path.basename(root)}") from None
        raise CheckpointError(f"{root} has no {LATEST} file: pass --tag (the tags are the "
                              "directories DeepSpeed saved into)") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {latest}: {exc}") from None
    if not found or "/" in found or found in (".", ".."):
        raise CheckpointError(f"{latest} does not name a tag ({found!r})")
    return found


def _not_dsrun(path: str) -> None:
    if os.path.exists(os.path.join(path, MANIFEST)):
        raise CheckpointError(f"{path} is already a dsrun checkpoint (it has a {MANIFEST}), not "
                              "a DeepSpeed one: there is nothing to import; load it with "
                              "engine.load_checkpoint() as it is")


def _refuse(path: str, names: Sequence[str]) -> None:
    _not_dsrun(path)
    refused = refused_kind(path, names)
    if refused is not None:
        file, what = refused
        advice = "import the DeepSpeed checkpoint it came from" \
            if os.path.basename(file) in REFUSED_DIRS else \
            "only data-parallel ZeRO checkpoints are"
        raise UnsupportedCheckpoint(f"{file}: {what}, which dsrun does not import ({advice})")


def _by_rank(path: str, names: Sequence[str], pattern: re.Pattern[str], what: str
             ) -> tuple[str, ...]:
    """The files of ``pattern`` for ranks 0..N-1; a gap names the missing file."""
    ranks = {int(m.group(1)): n for n in names if (m := pattern.fullmatch(n))}
    if not ranks:
        return ()
    for rank in range(max(ranks) + 1):
        if rank not in ranks:
            example = ranks[max(ranks)].replace(f"rank_{max(ranks)}_", f"rank_{rank}_", 1)
            have = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))
            raise CheckpointError(f"{os.path.join(path, example)} is missing: the {what} of "
                                  f"{have} are there, not rank {rank}'s (the save did not finish "
                                  "on every rank?)")
    return tuple(os.path.join(path, ranks[r]) for r in range(len(ranks)))


def inventory(root: str, tag: Optional[str]) -> Inventory:
    """The files of ``root``'s tag ``tag`` (default: ``latest``), or an
    error naming what is missing or unsupported (module docstring)."""
    root = os.path.abspath(root)
    tag = resolve_tag(root, tag)
    path = os.path.join(root, tag)
    if not os.path.isdir(path):
        tags = sorted((n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n))),
                      key=natural_key)
        raise CheckpointError(f"{path} does not exist: no tag {tag!r} in {root} (tags there: "
                              f"{', '.join(tags) or 'none'})")
    names = sorted(os.listdir(path), key=natural_key)
    _refuse(path, names)
    optim = _by_rank(path, names, OPTIM_STATES, "optimizer state files")
    zero3 = _by_rank(path, names, ZERO3_MODEL_STATES, "model state files")
    if zero3:
        model = zero3
    elif "mp_rank_00_model_states.pt" in names:
        model = (os.path.join(path, "mp_rank_00_model_states.pt"),)
    elif optim or any(n.endswith(".pt") for n in names):
        raise CheckpointError(f"{os.path.join(path, 'mp_rank_00_model_states.pt')} is missing "
                              "(DeepSpeed's model states: module, shapes, counters)")
    else:
        raise CheckpointError(f"{path} is not a DeepSpeed checkpoint: it has no "
                              "mp_rank_00_model_states.pt or zero_pp_rank_*_model_states.pt")
    if zero3 and optim and len(zero3) != len(optim):
        raise CheckpointError(f"{path} has model state files of {len(zero3)} ranks and "
                              f"optimizer state files of {len(optim)}: the save is incomplete")
    return Inventory(root, tag, path, model, optim)
