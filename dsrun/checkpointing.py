"""``dsrun.checkpointing``: what DeepSpeed scripts use as ``deepspeed.checkpointing``.

Activation checkpointing with DeepSpeed's API: :func:`checkpoint`
``(function, *args, **kwargs)`` runs ``function`` without keeping its
intermediate activations and runs it again in backward, as
``torch.utils.checkpoint`` does (non-reentrant, so it works with inputs that
do not require grad, keyword arguments and ``torch.autograd.grad``), with
what DeepSpeed adds:

* **RNG.** The recomputation sees the random state the forward saw: torch's
  default generators (CPU and the rank's GPU), and also every state of the
  model-parallel RNG tracker (:func:`get_cuda_rng_tracker`), so dropout
  inside ``tracker.fork()`` draws the same mask twice (Megatron-style
  models).
* :func:`configure` ``(mpu_, deepspeed_config=None, ...)`` with DeepSpeed's
  keywords, or the config's ``activation_checkpointing`` section:
  ``cpu_checkpointing`` keeps the checkpointed inputs in host memory until
  backward (a GPU rank's device memory is freed; nothing changes on CPU
  ranks); ``synchronize_checkpoint_boundary`` synchronises the GPU before
  and after each checkpointed forward and recomputation;
  ``profile`` logs each one's time (rank 0).
* ``partition_activations`` splits the checkpointed inputs across a
  tensor-parallel group in DeepSpeed. dsrun has no tensor parallelism: with
  no ``mpu``, or a model-parallel group of one rank, there is nothing to
  split (DeepSpeed does nothing then either); a larger model-parallel group
  is refused. ``contiguous_memory_optimization`` and ``number_checkpoints``
  arrange those partitions in one buffer, so they have nothing to do here
  either (their consistency rules are still checked).

:func:`model_parallel_cuda_manual_seed` seeds the default generator with
``seed`` and the tracker's ``"model-parallel-rng"`` state with ``seed +
2718 + tensor-parallel rank``, DeepSpeed's (and Megatron's) numbers. The
tracker works on the accelerator's generator: CUDA on GPU ranks, torch's
CPU generator on CPU ranks.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.runtime.dist import group_uses_nccl

log = logging.getLogger("dsrun.runtime")

MODEL_PARALLEL_RNG = "model-parallel-rng"  # DeepSpeed's / Megatron's tracker name
SEED_OFFSET = 2718  # DeepSpeed's / Megatron's model-parallel seed offset

__all__ = [
    "CheckpointSettings", "RNGStatesTracker", "checkpoint", "configure",
    "get_cuda_rng_tracker", "is_configured", "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed", "non_reentrant_checkpoint", "reset",
    "set_num_layers", "settings",
]


@dataclass(frozen=True)
class CheckpointSettings:
    """What :func:`configure` set (module docstring)."""

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: Optional[int] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


_settings = CheckpointSettings()
_configured = False
_mpu: Any = None


def settings() -> CheckpointSettings:
    return _settings


def is_configured() -> bool:
    """True once :func:`configure` was called (DeepSpeed's meaning)."""
    return _configured


# ------------------------------------------------------------ the RNG tracker


def _on_gpu() -> bool:
    return group_uses_nccl()


def _get_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _on_gpu() else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    if _on_gpu():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if _on_gpu():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states for model-parallel regions (DeepSpeed's
    ``CudaRNGStatesTracker``): :meth:`add` seeds one, :meth:`fork` runs a
    block with it and keeps where the block left it."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return copy.copy(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise DsrunError(f"RNG tracker: seed {seed} is in use already")
        if name in self.states_:
            raise DsrunError(f"RNG tracker: state {name!r} exists already")
        self.seeds_.add(seed)
        outside = _get_rng_state()
        _manual_seed(seed)
        self.states_[name] = _get_rng_state()
        _set_rng_state(outside)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states_:
            raise DsrunError(f"RNG tracker: no state {name!r} (add it first, e.g. with "
                             "model_parallel_cuda_manual_seed)")
        outside = _get_rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _set_rng_state(outside)


_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (on the CPU generator on CPU ranks)."""
    return _TRACKER


def _tp_rank() -> int:
    if _mpu is None:
        return 0
    for name in ("get_tensor_model_parallel_rank", "get_model_parallel_rank"):
        if hasattr(_mpu, name):
            return int(getattr(_mpu, name)())
    return 0


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator with ``seed`` and the tracker's
    model-parallel state with ``seed + 2718 + tensor-parallel rank``."""
    _TRACKER.reset()
    _manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + SEED_OFFSET + _tp_rank())


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Reseed the tracker's model-parallel state (same offsets)."""
    with _TRACKER.fork():
        _manual_seed(seed + SEED_OFFSET + _tp_rank())


# ------------------------------------------------------------ configuration


def _mp_world_size(mpu: Any) -> int:
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 1


def configure(mpu_: Any = None, deepspeed_config: Any = None,
              partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None,
              num_checkpoints: Optional[int] = None, checkpoint_in_cpu: Optional[bool] = None,
              synchronize: Optional[bool] = None, profile: Optional[bool] = None) -> None:
    """DeepSpeed's ``checkpointing.configure``: defaults, then the
    ``activation_checkpointing`` section of ``deepspeed_config`` (a dict, a
    JSON path, or a resolved :class:`~dsrun.runtime.config.DsrunConfig`),
    then the keywords given."""
    global _settings, _configured, _mpu
    from dsrun.runtime.config import activation_checkpointing_section

    if mpu_ is not None:
        _mpu = mpu_
    new = CheckpointSettings()
    if deepspeed_config is not None:
        section = getattr(deepspeed_config, "activation_checkpointing", None)
        if section is None:
            section = activation_checkpointing_section(deepspeed_config)
        new = CheckpointSettings(**{f: getattr(section, f)
                                    for f in CheckpointSettings.__dataclass_fields__})
    given = {"partition_activations": partition_activations,
             "contiguous_memory_optimization": contiguous_checkpointing,
             "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
             "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    new = replace(new, **{k: v for k, v in given.items() if v is not None})
    if new.contiguous_memory_optimization and not new.partition_activations:
        raise DsrunConfigError("activation checkpointing: contiguous memory optimization needs "
                               "partition_activations")
    if new.contiguous_memory_optimization and new.number_checkpoints is None:
        raise DsrunConfigError("activation checkpointing: contiguous memory optimization needs "
                               "the number of checkpoints (num_checkpoints / "
                               "number_checkpoints)")
    mp_size = _mp_world_size(_mpu) if _mpu is not None else 1
    if new.partition_activations and mp_size > 1:
        raise DsrunConfigError(
            f"activation checkpointing: partition_activations splits checkpoints across the "
            f"model-parallel group ({mp_size} ranks here), and dsrun has no tensor "
            "parallelism; turn partition_activations off")
    _settings, _configured = new, True
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info("activation checkpointing: %s", new)


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's ``set_num_layers`` (the checkpoints per forward)."""
    global _settings
    _settings = replace(_settings, number_checkpoints=int(nlayers))


def reset() -> None:
    """DeepSpeed frees its contiguous checkpoint buffers here; dsrun keeps
    none, so there is nothing to free."""


# ------------------------------------------------------------ checkpoint


def _sync_gpu() -> None:
    if _settings.synchronize_checkpoint_boundary and torch.cuda.is_available() \
            and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextlib.contextmanager
def _boundary(what: str) -> Iterator[None]:
    """Synchronise and/or time one checkpointed forward or recomputation."""
    _sync_gpu()
    start = time.perf_counter()
    try:
        yield
    finally:
        _sync_gpu()
        if _settings.profile and (not dist.is_initialized() or dist.get_rank() == 0):
            log.info("activation checkpoint %s: %.2f ms", what,
                     (time.perf_counter() - start) * 1e3)


def _contexts() -> tuple[Any, Any]:
    """(forward context, recomputation context) for torch's checkpoint: the
    recomputation runs with the tracker states the forward started with."""
    saved = {name: state.clone() for name, state in _TRACKER.states_.items()}

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        current = _TRACKER.get_states()
        _TRACKER.set_states({**current, **{k: v.clone() for k, v in saved.items()}})
        try:
            with _boundary("recomputation"):
                yield
        finally:
            _TRACKER.set_states(current)

    return _boundary("forward"), recompute()


def _to_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.to("cpu", non_blocking=False)
    return value


def anchor_devices(devices: list[Optional[torch.device]]) -> list[torch.device]:
    """The devices that get an empty anchor argument when ``cpu_checkpointing``
    moves the arguments to the host (each non-CPU device once, in order)."""
    return list(dict.fromkeys(d for d in devices if d is not None and d.type != "cpu"))


def _on_host(function: Callable[..., Any],
             args: tuple[Any, ...]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(function, args) with the tensor arguments in host memory until the
    recomputation moves them back (unchanged when none is off the host).
    torch's checkpoint saves and restores the
    RNG state only of the devices its tensor arguments are on, so each device
    the arguments came from is kept as an empty anchor argument (no memory):
    the recomputation then draws the forward's dropout masks on the GPU too,
    as DeepSpeed's CheckpointFunction does by saving the CUDA RNG state."""
    devices = [a.device if isinstance(a, torch.Tensor) else None for a in args]
    off_host = anchor_devices(devices)
    if not off_host:
        return function, args
    anchors = tuple(torch.empty(0, device=d) for d in off_host)
    count = len(args)

    def run(*host: Any, **kw: Any) -> Any:
        back = [h.to(d) if d is not None and isinstance(h, torch.Tensor) else h
                for h, d in zip(host[:count], devices)]
        return function(*back, **kw)

    return run, (*(_to_host(a) for a in args), *anchors)


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, recomputed in backward instead of
    keeping its activations (module docstring)."""
    run = function
    if _settings.cpu_checkpointing:
        run, args = _on_host(function, args)
    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False,
                                             context_fn=_contexts, **kwargs)


non_reentrant_checkpoint = checkpoint
