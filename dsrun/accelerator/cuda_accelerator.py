"""The CUDA accelerator: this rank's GPU, through ``torch.cuda``."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from dsrun.accelerator.abstract_accelerator import Accelerator, DeviceIndex, TensorOf


class CudaAccelerator(Accelerator):
    """This rank's GPU, through ``torch.cuda``."""

    _name = "cuda"

    def is_synchronized_device(self) -> bool:
        return False  # kernels run asynchronously: time with CUDA events

    def device_name(self, device_index: DeviceIndex = None) -> str:
        """``"cuda"``, or ``"cuda:N"`` for a device index."""
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: Optional[int] = None) -> torch.device:
        return torch.device("cuda", device_index)

    def set_device(self, device_index: Union[int, torch.device]) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def synchronize(self, device_index: DeviceIndex = None) -> None:
        torch.cuda.synchronize(device_index)

    # -- random numbers (this process's CUDA generators)
    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def get_rng_state(self, device_index: DeviceIndex = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: DeviceIndex = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    # -- streams and events
    @property
    def Stream(self) -> type:
        return torch.cuda.Stream

    @property
    def Event(self) -> type:
        return torch.cuda.Event

    def stream(self, stream: Any) -> Any:
        """Context manager making ``stream`` current."""
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: DeviceIndex = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: DeviceIndex = None) -> Any:
        return torch.cuda.default_stream(device_index)

    # -- memory: torch's caching allocator on the device
    def empty_cache(self) -> None:
        """Return the caching allocator's unused blocks to the driver."""
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: DeviceIndex = None) -> int:
        """Bytes held by tensors on the device."""
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: DeviceIndex = None) -> int:
        """Peak of :meth:`memory_allocated` since the last reset."""
        return torch.cuda.max_memory_allocated(device_index)

    def memory_reserved(self, device_index: DeviceIndex = None) -> int:
        """Bytes the caching allocator holds (tensors and cached free blocks)."""
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: DeviceIndex = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def reset_peak_memory_stats(self, device_index: DeviceIndex = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def reset_max_memory_allocated(self, device_index: DeviceIndex = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: DeviceIndex = None) -> dict[str, Any]:
        return dict(torch.cuda.memory_stats(device_index))

    def total_memory(self, device_index: DeviceIndex = None) -> int:
        """The device's memory in bytes."""
        index = torch.cuda.current_device() if device_index is None else device_index
        return int(torch.cuda.get_device_properties(index).total_memory)

    def available_memory(self, device_index: DeviceIndex = None) -> int:
        """Free device memory in bytes, as the driver reports it (other
        processes' use counted; this process's cached blocks are not free)."""
        return int(torch.cuda.mem_get_info(device_index)[0])

    def _pinned_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        """Page-lock ``num_bytes`` of existing host memory at ``address``
        (``cudaHostRegister``); a CUDA error is raised as torch raises it."""
        torch.cuda.check_error(int(torch.cuda.cudart().cudaHostRegister(address, num_bytes, 0)))
        return True

    def unregister_host_memory(self, address: int) -> None:
        """Undo :meth:`register_host_memory` (``cudaHostUnregister``)."""
        torch.cuda.check_error(int(torch.cuda.cudart().cudaHostUnregister(address)))

    # -- CUDA graphs
    def is_current_stream_capturing(self) -> bool:
        return bool(torch.cuda.is_current_stream_capturing())

    def create_graph(self) -> Any:
        """An empty ``torch.cuda.CUDAGraph``."""
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        """``torch.cuda.graph(graph, pool, stream)``: the work inside is captured."""
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph: Any) -> None:
        graph.replay()

    def _empty_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    # -- tensor types, the launcher's environment, kernels
    def tensor_type(self, dtype: torch.dtype) -> TensorOf:
        """``torch.tensor(data)`` in ``dtype`` on the GPU, as DeepSpeed's CUDA
        accelerator returns (with ``isinstance``: abstract_accelerator)."""
        return TensorOf(torch.tensor, dtype=dtype, device=self.device_name())

    def communication_backend_version(self) -> Any:
        """The NCCL version torch was built with (``torch.cuda.nccl.version()``)."""
        return torch.cuda.nccl.version()

    def export_envs(self) -> list[str]:
        """``NCCL``: DeepSpeed's runner forwards ``NCCL*`` to other hosts."""
        return ["NCCL"]

    def is_triton_supported(self) -> bool:
        """Whether the current GPU is one DeepSpeed runs Triton kernels on
        (compute capability 8.0 or newer)."""
        return bool(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8)

    # -- profiling, lazy initialisation, autocast
    def range_push(self, msg: str, domain: Optional[str] = None,
                   category: Optional[str] = None) -> None:
        """Open an NVTX range (Nsight Systems timelines); torch's NVTX has
        no domains or categories, so those are ignored."""
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Optional[str] = None) -> None:
        torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> None:
        """Run ``callback`` once CUDA is initialised (now, if it is)."""
        torch.cuda._lazy_call(callback)

    def amp(self) -> ModuleType:
        """``torch.cuda.amp`` (autocast, GradScaler, custom_fwd/custom_bwd)."""
        return torch.cuda.amp

    def _default_backend(self) -> str:
        return "nccl" if dist.is_available() and dist.is_nccl_available() else "gloo"

    def is_bf16_supported(self) -> bool:
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())

    def is_fp16_supported(self) -> bool:
        """Every GPU torch runs on computes in fp16 (DeepSpeed also says no
        below compute capability 7, where it is slow)."""
        return torch.cuda.is_available()


#: DeepSpeed's class name.
CUDA_Accelerator = CudaAccelerator
