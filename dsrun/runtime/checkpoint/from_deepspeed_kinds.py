"""What a DeepSpeed checkpoint is, told by its file names (no torch).

Shared by the importer (:mod:`.from_deepspeed_files`, which refuses the
kinds it does not convert) and by dsrun's own readers - ``load_checkpoint``,
``checkpoint info``, ``to-fp32``, ``zero_to_fp32`` - which, given a
DeepSpeed save directory or one of its tag directories, answer with
:func:`deepspeed_advice`: the ``dsrun checkpoint from-deepspeed`` command
that imports it, or, for a kind the importer refuses (pipeline-parallel
``layer_*`` files, tensor-parallel ``mp_rank_01``, mixture-of-experts,
universal ``zero/``, NVMe-offloaded state), that no dsrun command reads it.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence
from typing import Any, Optional

from dsrun.runtime.checkpoint.manifest import LATEST, MANIFEST

MODEL_STATES = re.compile(r"mp_rank_(\d+)_model_states\.pt")
ZERO3_MODEL_STATES = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
OPTIM_STATES = re.compile(r"(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
# what the importer refuses, by file name: (pattern, what it is). DeepSpeed
# 0.19.8's PipelineModule writes layer_NN-model_states.pt, with -model_NN
# before -model_states only under tensor parallelism
REFUSED_FILES = (
    (re.compile(r"layer_\d+(?:-model_\d+)?-model_states\.pt"),
     "a pipeline-parallel checkpoint (PipelineModule layer files)"),
    (re.compile(r"(?:layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt"),
     "a mixture-of-experts checkpoint (expert files)"),
    (re.compile(r"expp_rank_\d+_mp_rank_\d+_optim_states\.pt"),
     "a mixture-of-experts checkpoint (expert-parallel optimizer files)"),
)
REFUSED_DIRS = {
    "zero": "a universal checkpoint (ds_to_universal.py output)",
    "offloaded_tensors": "a checkpoint with NVMe-offloaded optimizer state",
}
# names a DeepSpeed save_checkpoint writes into a tag's directory
DEEPSPEED_FILES = ("mp_rank_", "zero_pp_rank_", "bf16_zero_pp_rank_", "fp16_zero_pp_rank_",
                   "layer_", "expert_", "expp_rank_")


def refused_kind(path: str, names: Sequence[str]) -> Optional[tuple[str, str]]:
    """(file, what it is) when tag directory ``path`` (holding ``names``) is
    of a kind the importer refuses, else None. Pipeline, expert and
    universal files are looked for first: such a checkpoint also holds
    ``mp_rank_01`` files, which alone would call it tensor-parallel."""
    for name in names:
        full = os.path.join(path, name)
        if name in REFUSED_DIRS and os.path.isdir(full):
            return full, REFUSED_DIRS[name]
        for pattern, what in REFUSED_FILES:
            if pattern.fullmatch(name):
                return full, what
    for name in names:
        match = MODEL_STATES.fullmatch(name) or ZERO3_MODEL_STATES.fullmatch(name) \
            or OPTIM_STATES.fullmatch(name)
        if match and int(match.groups()[-1]) != 0:
            return (os.path.join(path, name), "a tensor/model-parallel checkpoint (model-"
                    f"parallel rank {int(match.groups()[-1])})")
    return None


def _listing(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def is_deepspeed_tag(path: str) -> bool:
    """Whether directory ``path`` holds a DeepSpeed save's files (a universal
    or offloaded one has model states beside its ``zero/`` directory)."""
    return any(n.startswith(DEEPSPEED_FILES) and n.endswith(".pt") for n in _listing(path)) \
        and not os.path.exists(os.path.join(path, MANIFEST))


def import_command(root: str, tag: str) -> str:
    """The shell command that imports DeepSpeed checkpoint ``root``'s tag
    ``tag`` into a dsrun checkpoint (``--tag`` only when ``latest`` names
    another tag)."""
    try:
        with open(os.path.join(root, LATEST), encoding="utf-8") as f:
            latest: Optional[str] = f.read().strip()
    except OSError:
        latest = None
    extra = [] if latest == tag else ["--tag", tag]
    return shlex.join(["dsrun", "checkpoint", "from-deepspeed", root, "OUT_DIR", *extra])


def deepspeed_advice(root: str, tag: str) -> str:
    """Why dsrun does not read DeepSpeed tag directory ``root/tag``, and
    what to do instead (module docstring)."""
    path = os.path.join(root, tag)
    refused = refused_kind(path, _listing(path))
    if refused is not None:
        file, what = refused
        return (f"{path} is a DeepSpeed checkpoint, {what} ({file}), which neither dsrun "
                "reads nor `dsrun checkpoint from-deepspeed` imports: keep the weights with "
                "DeepSpeed's own tools, or resume it in DeepSpeed and save it without that "
                "parallelism")
    return (f"{path} is a DeepSpeed checkpoint, which dsrun does not read: import it once "
            f"with `{import_command(root, tag)}` and load OUT_DIR (weights, optimizer state, LR "
            "scheduler and counters carry over), or keep the weights only with DeepSpeed's "
            "zero_to_fp32.py and model.load_state_dict()")


def natural_key(name: str) -> list[Any]:
    """Sort key that orders the numbers in a name by value (``global_step3``
    before ``global_step12``)."""
    return [(0, int(part), part) if part.isdigit() else (1, 0, part)
            for part in re.split(r"(\d+)", name) if part]


def deepspeed_tag_advice(path: str, tag: Optional[str] = None) -> Optional[str]:
    """:func:`deepspeed_advice` when ``path`` (where a dsrun checkpoint was
    expected) is a DeepSpeed tag directory, or a save directory holding
    DeepSpeed tags - tag ``tag`` when given (None when ``path/tag`` is no
    DeepSpeed tag: :func:`~.tags.tag_dir` then says what it is), else the
    one ``latest`` names, else the newest - otherwise None."""
    path = os.path.abspath(path)
    if tag is not None and is_deepspeed_tag(os.path.join(path, tag)):
        return deepspeed_advice(path, tag)
    if is_deepspeed_tag(path):
        return deepspeed_advice(os.path.dirname(path), os.path.basename(path))
    if tag is not None:
        return None
    names = _listing(path)
    if any(os.path.exists(os.path.join(path, n, MANIFEST)) for n in ("", *names)):
        return None  # dsrun's own (DeepSpeed tags beside them are not in the way)
    tags = [n for n in names if is_deepspeed_tag(os.path.join(path, n))]
    if not tags:
        return None
    try:
        with open(os.path.join(path, LATEST), encoding="utf-8") as f:
            latest = f.read().strip()
    except OSError:
        latest = ""
    return deepspeed_advice(path, latest if latest in tags else max(tags, key=natural_key))
