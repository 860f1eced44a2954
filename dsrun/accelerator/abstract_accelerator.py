"""The base of dsrun's accelerators: what every device answers the same way.

A subclass answers for one kind of device (``torch.cuda`` or the host CPU);
the answers come from torch or the operating system at the time of the
call, never from constants that could go stale. DeepSpeed's compiled ops
are not part of dsrun: ``create_op_builder``/``get_op_builder`` raise.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from dsrun.errors import DsrunError

DeviceIndex = Optional[Union[int, str, torch.device]]


def _tensor_factory(dtype: torch.dtype) -> property:
    """A property giving ``torch.tensor`` for ``dtype`` on this accelerator's
    device (DeepSpeed's ``FloatTensor``, ``HalfTensor``, ...)."""
    return property(lambda self: functools.partial(torch.tensor, dtype=dtype,
                                                   device=self.device_name()),
                    doc=f"``torch.tensor(data)`` as {dtype} on this accelerator's device.")


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

    FloatTensor = _tensor_factory(torch.float32)
    HalfTensor = _tensor_factory(torch.float16)
    BFloat16Tensor = _tensor_factory(torch.bfloat16)
    DoubleTensor = _tensor_factory(torch.float64)
    IntTensor = _tensor_factory(torch.int32)
    LongTensor = _tensor_factory(torch.int64)
    ByteTensor = _tensor_factory(torch.uint8)

    # -- pinned host memory
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in page-locked host memory."""
        return bool(tensor.is_pinned())

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
        raise self._no_ops(class_name)

    def get_op_builder(self, class_name: str) -> Any:
        raise self._no_ops(class_name)

    @staticmethod
    def _no_ops(class_name: str) -> DsrunError:
        return DsrunError(
            f"op builder {class_name!r}: dsrun does not build or load DeepSpeed's compiled "
            "ops (csrc kernels). Its optimizers run on torch: dsrun.ops.adam.FusedAdam and "
            "DeepSpeedCPUAdam, or an \"optimizer\" section in the config")


#: DeepSpeed's name for the base class (``isinstance`` checks in scripts).
DeepSpeedAccelerator = Accelerator
