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

:class:`CheckpointFunction` is DeepSpeed's reentrant checkpoint
(``CheckpointFunction.apply(function, all_outputs, *args)``), with the same
RNG replay, ``cpu_checkpointing``, synchronisation and profiling; its
helpers ``extract_tensors`` / ``merge_tensors`` / ``detach_variable`` and
``get_partition_start`` / ``get_partition_size`` are DeepSpeed's too.
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
    "CheckpointFunction", "CheckpointSettings", "CudaRNGStatesTracker", "RNGStatesTracker",
    "checkpoint", "configure", "detach_variable", "extract_tensors", "get_cuda_rng_tracker",
    "get_partition_size", "get_partition_start", "is_configured", "merge_tensors",
    "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed",
    "non_reentrant_checkpoint", "partition_activations_in_checkpoint", "reset",
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


CudaRNGStatesTracker = RNGStatesTracker  # DeepSpeed's name

_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (on the CPU generator on CPU ranks)."""
    return _TRACKER


def _tp_rank() -> int:
    from dsrun.runtime.norms import tensor_model_parallel_rank

    return tensor_model_parallel_rank(_mpu)


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
    _refuse_partitioning(new)
    _settings, _configured = new, True
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info("activation checkpointing: %s", new)


def _mp_rank_and_size() -> tuple[int, int]:
    """(tensor-parallel rank, size) of the mpu :func:`configure` got, else (0, 1)."""
    return (_tp_rank(), _mp_world_size(_mpu)) if _mpu is not None else (0, 1)


def _refuse_partitioning(new: CheckpointSettings) -> None:
    mp_size = _mp_rank_and_size()[1]
    if new.partition_activations and mp_size > 1:
        raise DsrunConfigError(
            f"activation checkpointing: partition_activations splits checkpoints across the "
            f"model-parallel group ({mp_size} ranks here), and dsrun has no tensor "
            "parallelism; turn partition_activations off")


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """DeepSpeed's switch for ``partition_activations`` alone (refused on
    for a model-parallel group of more ranks than one, as in :func:`configure`)."""
    global _settings
    new = replace(_settings, partition_activations=bool(partition_activation))
    _refuse_partitioning(new)
    _settings = new
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info("activation checkpointing: partition_activations %s", new.partition_activations)


def get_partition_start(item: torch.Tensor) -> int:
    """Where this tensor-parallel rank's part of ``item`` starts (DeepSpeed's)."""
    rank, size = _mp_rank_and_size()
    return item.numel() * rank // size


def get_partition_size(item: torch.Tensor) -> int:
    """The elements of ``item`` each tensor-parallel rank holds (DeepSpeed's)."""
    size = _mp_rank_and_size()[1]
    if item.numel() % size:
        raise DsrunError(f"activation partitioning: {item.numel()} elements do not split "
                         f"evenly over the {size} model-parallel ranks")
    return item.numel() // size


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


# ------------------------------------------------------------ DeepSpeed's reentrant one


def extract_tensors(all_objects: Any) -> tuple[Any, Any, Any]:
    """(tensors, non-tensors, per-position "is a tensor" flags) of a list or
    tuple, each in order; tuples for a tuple, else lists (DeepSpeed's)."""
    tensors = [v for v in all_objects if torch.is_tensor(v)]
    others = [v for v in all_objects if not torch.is_tensor(v)]
    flags = [torch.is_tensor(v) for v in all_objects]
    if type(all_objects) is tuple:
        return tuple(tensors), tuple(others), tuple(flags)
    return tensors, others, flags


def merge_tensors(tensor_objects: Any, non_tensor_objects: Any, tensor_flags: Any
                  ) -> tuple[Any, ...]:
    """The tuple :func:`extract_tensors` split (DeepSpeed's; its extra
    flags for partitioned activations' sizes never arise here)."""
    tensors, others = iter(tensor_objects), iter(non_tensor_objects)
    return tuple(next(tensors) if flag else next(others) for flag in tensor_flags)


def detach_variable(inputs: tuple[Any, ...], device: Any = None) -> tuple[Any, ...]:
    """Each tensor of the tuple detached (moved to ``device`` first, if
    given), keeping its ``requires_grad``; other values as they are."""
    if not isinstance(inputs, tuple):
        raise DsrunError(f"detach_variable takes a tuple, got {type(inputs).__name__}")
    out = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            moved = value if device is None else value.to(device=device)
            detached = moved.detach()
            detached.requires_grad = value.requires_grad
            value = detached
        out.append(value)
    return tuple(out)


def _rng_snapshot() -> tuple[torch.Tensor, Optional[torch.Tensor], dict[str, torch.Tensor]]:
    """(CPU generator, the rank's GPU generator or None, the tracker's states)."""
    return (torch.get_rng_state(), torch.cuda.get_rng_state() if _on_gpu() else None,
            _TRACKER.get_states())


def _set_rng_snapshot(snap: tuple[torch.Tensor, Optional[torch.Tensor],
                                  dict[str, torch.Tensor]]) -> None:
    torch.set_rng_state(snap[0])
    if snap[1] is not None:
        torch.cuda.set_rng_state(snap[1])
    _TRACKER.set_states(dict(snap[2]))  # a copy: fork() replaces its entries


def _is_activation(value: Any) -> bool:
    return torch.is_tensor(value) and value.is_floating_point()


def _kept_on_host(value: torch.Tensor) -> torch.Tensor:
    """``value`` in host memory until backward, still asking for its grad."""
    host = _to_host(value.detach())
    host.requires_grad = value.requires_grad
    return host


class CheckpointFunction(torch.autograd.Function):
    """DeepSpeed's reentrant checkpoint: ``apply(function, all_outputs,
    *args)`` runs ``function(*args)`` without grad, appends all its outputs
    to the list ``all_outputs`` and returns its tensors; backward reruns it
    with the forward's random state (generators and tracker) and
    backpropagates through the rerun. As with every reentrant checkpoint,
    only arguments that require grad get one (not the parameters of a block
    whose inputs do not), and ``torch.autograd.grad`` is refused."""

    @staticmethod
    def forward(ctx: Any, run_function: Callable[..., Any], all_outputs: list[Any],
                *args: Any) -> Any:
        ctx.run_function = run_function
        ctx.rng = _rng_snapshot()
        ctx.devices = [a.device if _is_activation(a) else None for a in args]
        saved = tuple(_kept_on_host(a) if _settings.cpu_checkpointing and _is_activation(a)
                      else a for a in args)
        ctx.saved_args = extract_tensors(saved)
        with torch.no_grad(), _boundary("forward"):
            outputs = run_function(*args)
        tensors = (outputs,) if torch.is_tensor(outputs) else extract_tensors(tuple(outputs))[0]
        ctx.mark_non_differentiable(*(t for t in tensors if not t.is_floating_point()))
        if torch.is_tensor(outputs):
            all_outputs.append(outputs)
            return outputs
        all_outputs.extend(outputs)
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if not torch.autograd._is_checkpoint_valid():
            raise DsrunError("CheckpointFunction (reentrant) does not work with "
                             "torch.autograd.grad(): use .backward(), or checkpoint()")
        tensors, others, flags = ctx.saved_args
        devices = [d for d, flag in zip(ctx.devices, flags) if flag]
        back = tuple(t if d is None else t.to(d) for t, d in zip(tensors, devices))
        inputs = merge_tensors(detach_variable(back), others, flags)
        now = _rng_snapshot()
        _set_rng_snapshot(ctx.rng)
        try:
            with torch.enable_grad(), _boundary("recomputation"):
                outputs = ctx.run_function(*inputs)
        finally:
            _set_rng_snapshot(now)
        outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        pairs = [(out, grad) for out, grad in zip(extract_tensors(outputs)[0], grads)
                 if out.requires_grad]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        ctx.saved_args = None
        return (None, None, *(v.grad if torch.is_tensor(v) else None for v in inputs))
