"""The base of dsrun's accelerators: what every device answers the same way.

A subclass answers for one kind of device (``torch.cuda`` or the host CPU);
the answers come from torch or the operating system at the time of the
call, never from constants that could go stale. DeepSpeed's compiled ops
are not part of dsrun: ``create_op_builder``/``get_op_builder`` (and
``op_builder_dir``/``build_extension``) raise.

``FloatTensor``, ``LongTensor``, ... are what DeepSpeed's accelerator of
the same kind returns: torch's legacy host types on the CPU
(``torch.FloatTensor``: ``FloatTensor(3)`` is 3 uninitialised elements,
``FloatTensor([1, 2])`` the data), and ``torch.tensor`` in the dtype on
CUDA (``FloatTensor([1, 2])`` the data; ``FloatTensor(3)`` the scalar 3.0,
as in DeepSpeed). Both answer ``isinstance``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from types import ModuleType
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from dsrun.errors import DsrunError

DeviceIndex = Optional[Union[int, str, torch.device]]


class TensorOf(functools.partial):  # type: ignore[type-arg]
    """``torch.tensor(data)`` in one dtype on one device, as DeepSpeed's CUDA
    accelerator gives its ``FloatTensor``/``HalfTensor``/...; unlike a plain
    ``functools.partial`` it also answers ``isinstance(t, acc.FloatTensor)``
    (a tensor of that dtype on that kind of device), where DeepSpeed's raises
    TypeError."""

    def __instancecheck__(self, instance: Any) -> bool:
        device = torch.device(self.keywords["device"])
        return (isinstance(instance, torch.Tensor) and instance.dtype == self.keywords["dtype"]
                and instance.device.type == device.type)


#: The legacy tensor types of the host, by dtype (``torch.FloatTensor``, ...).
HOST_TENSOR_TYPES: dict[torch.dtype, type] = {
    torch.float32: torch.FloatTensor, torch.float16: torch.HalfTensor,
    torch.bfloat16: torch.BFloat16Tensor, torch.float64: torch.DoubleTensor,
    torch.int32: torch.IntTensor, torch.int64: torch.LongTensor, torch.uint8: torch.ByteTensor}


def _tensor_type(dtype: torch.dtype) -> property:
    """The accelerator's ``tensor_type(dtype)`` as a property (DeepSpeed's
    ``FloatTensor``, ``HalfTensor``, ...)."""
    return property(lambda self: self.tensor_type(dtype),
                    doc=f"Makes {dtype} tensors on this accelerator's device (tensor_type).")


@functools.cache
def computes_in(dtype: torch.dtype, device_type: str) -> bool:
    """Whether torch can do a matrix product and a sum in ``dtype`` on
    ``device_type`` (probed once; half precision on an old CPU build may not)."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        return bool(torch.isfinite((a @ a).sum()).item())
    except (RuntimeError, TypeError):
        return False


class Accelerator:
    """What every accelerator answers the same way. Subclasses set ``_name``
    (DeepSpeed's attribute: ``"cuda"``/``"cpu"``)."""

    _name = ""
    #: whether ``range_push`` uses its ``domain`` (torch's NVTX has none)
    supports_nvtx_domain = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._name}>"

    # -- timing and ordering: a synchronous device needs no device events
    def is_synchronized_device(self) -> bool:
        raise NotImplementedError

    def use_host_timers(self) -> bool:
        """Timers may read the host clock (true where work runs synchronously)."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    # -- device
    def device_name(self, device_index: DeviceIndex = None) -> str:
        raise NotImplementedError

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this accelerator's kind of device."""
        return tensor.device.type == self._name

    # -- random numbers
    def random(self) -> ModuleType:
        """``torch.random`` (fork_rng, get_rng_state, ...)."""
        return torch.random

    # -- communication
    def communication_backend_name(self) -> str:
        """The backend of this rank's process group when one exists (a
        launcher may have chosen it), else the one dsrun picks for this
        device: NCCL for CUDA, gloo for the CPU."""
        if dist.is_available() and dist.is_initialized():
            return str(dist.get_backend())
        return self._default_backend()

    def _default_backend(self) -> str:
        raise NotImplementedError

    # -- data types
    def is_bf16_supported(self) -> bool:
        raise NotImplementedError

    def is_fp16_supported(self) -> bool:
        raise NotImplementedError

    def supported_dtypes(self) -> list[torch.dtype]:
        """fp32, and the 16-bit types this device computes in."""
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def is_fp64_supported(self) -> bool:
        """True: both devices compute in fp64 (DeepSpeed's default answer)."""
        return True

    def is_triton_supported(self) -> bool:
        raise NotImplementedError

    # -- tensor types: what DeepSpeed's accelerator of this kind returns
    def tensor_type(self, dtype: torch.dtype) -> Any:
        """What ``FloatTensor`` and the others give for ``dtype``."""
        raise NotImplementedError

    FloatTensor = _tensor_type(torch.float32)
    HalfTensor = _tensor_type(torch.float16)
    BFloat16Tensor = _tensor_type(torch.bfloat16)
    DoubleTensor = _tensor_type(torch.float64)
    IntTensor = _tensor_type(torch.int32)
    LongTensor = _tensor_type(torch.int64)
    ByteTensor = _tensor_type(torch.uint8)

    # -- memory: torch.cuda's older names (``memory_cached`` became
    # ``memory_reserved``), which DeepSpeed's accelerators still answer
    def memory_reserved(self, device_index: DeviceIndex = None) -> int:
        raise NotImplementedError

    def max_memory_reserved(self, device_index: DeviceIndex = None) -> int:
        raise NotImplementedError

    def reset_peak_memory_stats(self, device_index: DeviceIndex = None) -> None:
        raise NotImplementedError

    def memory_cached(self, device_index: DeviceIndex = None) -> int:
        """:meth:`memory_reserved`."""
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: DeviceIndex = None) -> int:
        """:meth:`max_memory_reserved`."""
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: DeviceIndex = None) -> None:
        """:meth:`reset_peak_memory_stats` (as ``torch.cuda.reset_max_memory_cached``)."""
        self.reset_peak_memory_stats(device_index)

    # -- pinned host memory
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in page-locked host memory."""
        return bool(tensor.is_pinned())

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True,
                   *, align_bytes: int = 1) -> torch.Tensor:
        """Host ``tensor`` in page-locked memory for fast copies to the device:
        a pinned copy, or with ``make_copy=False`` an uninitialised pinned
        buffer of its dtype and shape (flat with ``match_shape=False``), as
        DeepSpeed 0.19.8. ``align_bytes`` (the keyword of DeepSpeed's earlier
        releases) is accepted: torch aligns its pinned blocks itself."""
        check_align_bytes(align_bytes)
        if make_copy:
            return self._pinned_copy(tensor)
        shape = tuple(tensor.shape) if match_shape else (tensor.numel(),)
        return self._empty_host(shape, tensor.dtype)

    def _pinned_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def pin_memory_alignment(self) -> int:
        """The byte alignment host memory needs to be registered with the
        device: 1, none (torch's allocations are page-aligned)."""
        return 1

    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        """Page-lock existing host memory for the device; False: this device
        has no such registration."""
        return False

    def unregister_host_memory(self, address: int) -> None:
        """Undo :meth:`register_host_memory` (nothing here)."""
        return None

    def _empty_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor, page-locked where that helps this device."""
        raise NotImplementedError

    def pin_empty(self, *size: Any, dtype: torch.dtype, device: Any = "cpu") -> torch.Tensor:
        """An uninitialised host tensor of ``size`` (ints, or one sequence) and
        ``dtype`` for copies to this device (page-locked on CUDA; DeepSpeed's
        CPU accelerator pins nothing either). ``device`` must be the CPU."""
        _require_host(device, "pin_empty")
        one_sequence = len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size))
        shape = tuple(size[0]) if one_sequence else tuple(size)
        return self._empty_host(tuple(int(n) for n in shape), dtype)

    def pin_empty_like(self, tensor: torch.Tensor, device: Any = "cpu",
                       dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """:meth:`pin_empty` with ``tensor``'s shape (and dtype unless given)."""
        _require_host(device, "pin_empty_like")
        return self._empty_host(tuple(tensor.shape), tensor.dtype if dtype is None else dtype)

    def unpin_memory(self, tensor: torch.Tensor) -> None:
        """Nothing: torch frees page-locked memory with its tensor (DeepSpeed's
        answer too unless its native pinning backend is on)."""
        return None

    # -- graphs: CUDA graphs where the device has them
    def is_current_stream_capturing(self) -> bool:
        """Whether the current stream is capturing a graph (never, here)."""
        return False

    def prefer_triton_grouped_mm(self) -> bool:
        """Whether DeepSpeed's MoE layers should use their Triton grouped
        matrix product: False, dsrun has neither MoE layers nor that kernel."""
        return False

    # -- the launcher's environment (DeepSpeed's runner asks these)
    def visible_devices_envs(self) -> list[str]:
        """The variables that choose a rank's devices: ``CUDA_VISIBLE_DEVICES``
        (also for the CPU accelerator, as DeepSpeed's)."""
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict[str, str],
                                 local_accelerator_ids: Iterable[Any]) -> None:
        """Set those variables in ``current_env`` (a dict the caller passes,
        e.g. a child's environment) to the comma-joined ids."""
        ids = ",".join(map(str, local_accelerator_ids))
        for name in self.visible_devices_envs():
            current_env[name] = ids

    def export_envs(self) -> list[str]:
        """Prefixes of variables DeepSpeed's runner forwards to other hosts
        for this device."""
        raise NotImplementedError

    # -- torch.compile
    _compile_backend = "inductor"

    def get_compile_backend(self) -> str:
        """The ``torch.compile`` backend ``engine.compile()`` uses by default."""
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Choose it (one of ``torch._dynamo.list_backends()``, or ``"eager"``)."""
        import torch._dynamo

        known = {*torch._dynamo.list_backends(exclude_tags=()), "eager"}
        if backend not in known:
            raise ValueError(f"compile backend {backend!r} is not one of torch's: "
                             f"{', '.join(sorted(known))}")
        self._compile_backend = backend

    # -- DeepSpeed's compiled ops
    def create_op_builder(self, class_name: str) -> Any:
        raise self._no_ops(f"op builder {class_name!r}")

    def get_op_builder(self, class_name: str) -> Any:
        raise self._no_ops(f"op builder {class_name!r}")

    def op_builder_dir(self) -> str:
        raise self._no_ops("op_builder_dir()")

    def build_extension(self) -> Any:
        raise self._no_ops("build_extension()")

    @staticmethod
    def _no_ops(what: str) -> DsrunError:
        return DsrunError(
            f"{what}: dsrun does not build or load DeepSpeed's compiled "
            "ops (csrc kernels). Its optimizers run on torch: dsrun.ops.adam.FusedAdam and "
            "DeepSpeedCPUAdam, or an \"optimizer\" section in the config")


def check_align_bytes(align_bytes: Any) -> None:
    """``pin_memory``'s ``align_bytes`` is a positive int, else ValueError."""
    if isinstance(align_bytes, bool) or not isinstance(align_bytes, int) or align_bytes < 1:
        raise ValueError(f"pin_memory: align_bytes must be a positive int, got {align_bytes!r}")


def _require_host(device: Any, what: str) -> None:
    """``device`` is the CPU (these calls allocate host memory), else ValueError."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind != "cpu":
        raise ValueError(f"{what} allocates host memory: device must be 'cpu', got {device!r}")


#: DeepSpeed's name for the base class (``isinstance`` checks in scripts).
DeepSpeedAccelerator = Accelerator
