"""The CPU accelerator: the host CPU as one torch device.

``torch.cpu`` answers where it has the call. Memory figures are this
process's resident set (psutil), its peak the kernel's high-water mark
where Linux keeps one: the host allocator hands freed memory back to the
OS instead of caching it, so "allocated" and "reserved" are the same.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, Optional

import psutil
import torch

from dsrun.accelerator.abstract_accelerator import (
    HOST_TENSOR_TYPES,
    Accelerator,
    DeviceIndex,
    check_align_bytes,
    computes_in,
)


class HostEvent(getattr(torch.cpu, "Event", object)):  # type: ignore[misc]
    """``torch.cpu.Event`` that also keeps time: work on the CPU is done when
    the host gets to ``record()``, so the host clock at that moment is the
    event's time, and ``elapsed_time`` works as CUDA events' does (ms)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        super().__init__()
        self.enable_timing = enable_timing
        self._recorded: Optional[float] = None

    def record(self, stream: Any = None) -> None:
        self._recorded = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for: the CPU ran the work before ``record()``."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for (one in-order host stream)."""

    def elapsed_time(self, end_event: HostEvent) -> float:
        """Milliseconds from this event's ``record()`` to ``end_event``'s."""
        if self._recorded is None or end_event._recorded is None:
            raise RuntimeError("elapsed_time: both events must be recorded first")
        return (end_event._recorded - self._recorded) * 1000.0


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _rss_high_water_mark() -> Optional[int]:
    """The kernel's peak resident set of this process (Linux ``VmHWM``)."""
    try:
        with open("/proc/self/status") as status:
            found = re.search(r"^VmHWM:\s+(\d+) kB", status.read(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def _reset_rss_high_water_mark() -> bool:
    """Set the kernel's peak to the current resident set (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


class CpuAccelerator(Accelerator):
    """The host CPU (one device; ``torch.cpu`` where torch has the call)."""

    _name = "cpu"

    def __init__(self) -> None:
        # Peak RSS: the kernel's high-water mark where it keeps one (valid
        # from process start until a reset fails), and the largest RSS any
        # call here has seen (all there is elsewhere).
        self._kernel_peak = _rss_high_water_mark() is not None
        self._seen_peak = _rss()

    def is_synchronized_device(self) -> bool:
        return True  # an op has finished when the call returns

    def device_name(self, device_index: DeviceIndex = None) -> str:
        """``"cpu"`` (the CPU is one device; an index changes nothing)."""
        return "cpu"

    def device(self, device_index: DeviceIndex = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device_index: DeviceIndex) -> None:
        """Nothing to select: one CPU device (``torch.cpu.set_device``)."""
        torch.cpu.set_device(device_index)  # type: ignore[arg-type]

    def current_device(self) -> str:
        """``"cpu"``, as ``torch.cpu.current_device()``: there is no index,
        and an int would mean a CUDA device to ``tensor.to``."""
        return str(torch.cpu.current_device())

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """1: a rank's CPU is one torch device (``torch.cpu.device_count``)."""
        return int(torch.cpu.device_count())

    def is_available(self) -> bool:
        return bool(torch.cpu.is_available())

    def synchronize(self, device_index: DeviceIndex = None) -> None:
        torch.cpu.synchronize(device_index)

    # -- random numbers (torch's default CPU generator)
    def manual_seed(self, seed: int) -> torch.Generator:
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> torch.Generator:
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: DeviceIndex = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: DeviceIndex = None) -> None:
        torch.set_rng_state(new_state)

    def default_generator(self, device_index: DeviceIndex = None) -> torch.Generator:
        return torch.default_generator

    # -- streams and events: the CPU's single in-order stream
    @property
    def Stream(self) -> type:
        return torch.cpu.Stream

    @property
    def Event(self) -> type:
        return HostEvent

    def stream(self, stream: Any) -> Any:
        return torch.cpu.stream(stream)

    def current_stream(self, device_index: DeviceIndex = None) -> Any:
        return torch.cpu.current_stream(device_index)

    def default_stream(self, device_index: DeviceIndex = None) -> Any:
        """The current stream: the CPU has only its default one."""
        return torch.cpu.current_stream(device_index)

    # -- memory: the process's resident set (the host allocator returns
    # freed memory to the OS instead of caching it, so allocated = reserved)
    def empty_cache(self) -> None:
        """Return freed heap memory to the OS (glibc ``malloc_trim``)."""
        from dsrun.runtime.zero.flat import trim_host_heap
        trim_host_heap()

    def memory_allocated(self, device_index: DeviceIndex = None) -> int:
        """This process's resident set in bytes (psutil RSS)."""
        rss = _rss()
        self._seen_peak = max(self._seen_peak, rss)
        return rss

    def max_memory_allocated(self, device_index: DeviceIndex = None) -> int:
        """Peak resident set in bytes since the process started or the last
        :meth:`reset_peak_memory_stats`: the kernel's high-water mark on
        Linux, elsewhere the largest value these calls have seen."""
        rss = self.memory_allocated()
        kernel = _rss_high_water_mark() if self._kernel_peak else None
        return max(rss, self._seen_peak, kernel or 0)

    def memory_reserved(self, device_index: DeviceIndex = None) -> int:
        """As :meth:`memory_allocated` (nothing is cached on the host)."""
        return self.memory_allocated()

    def max_memory_reserved(self, device_index: DeviceIndex = None) -> int:
        return self.max_memory_allocated()

    def reset_peak_memory_stats(self, device_index: DeviceIndex = None) -> None:
        """Start the peak over from the current resident set."""
        self._kernel_peak = _reset_rss_high_water_mark()
        self._seen_peak = _rss()

    def reset_max_memory_allocated(self, device_index: DeviceIndex = None) -> None:
        self.reset_peak_memory_stats()

    def get_rss(self) -> int:
        """This process's resident set in bytes (DeepSpeed's CPU name for
        :meth:`memory_allocated`)."""
        return self.memory_allocated()

    def reset_rss(self) -> int:
        """Start the peak over (:meth:`reset_peak_memory_stats`); the resident set."""
        self.reset_peak_memory_stats()
        return self._seen_peak

    @property
    def max_mem(self) -> int:
        """The peak resident set in bytes (:meth:`max_memory_allocated`)."""
        return self.max_memory_allocated()

    def memory_stats(self, device_index: DeviceIndex = None) -> dict[str, int]:
        """torch.cuda's keys for the current and peak figures."""
        current = self.memory_allocated()
        return {"allocated_bytes.all.current": current,
                "allocated_bytes.all.peak": self.max_memory_allocated()}

    def total_memory(self, device_index: DeviceIndex = None) -> int:
        """The machine's physical memory in bytes (psutil; not a container limit)."""
        return int(psutil.virtual_memory().total)

    def available_memory(self, device_index: DeviceIndex = None) -> int:
        """Memory the machine can give without swapping, in bytes (psutil)."""
        return int(psutil.virtual_memory().available)

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True,
                   *, align_bytes: int = 1) -> torch.Tensor:
        """``tensor`` itself, whatever the keywords (DeepSpeed's CPU
        accelerator's answer): pinning speeds copies to a GPU, and a CPU
        rank copies to none (``is_pinned`` stays truthful: False)."""
        check_align_bytes(align_bytes)
        return tensor

    # -- graphs: none on the CPU, DeepSpeed's answers
    def create_graph(self) -> None:
        return None

    def capture_to_graph(self, graph: Any, pool: Any = None,
                         stream: Any = None) -> contextlib.AbstractContextManager[None]:
        """A context that captures nothing: the work inside runs as usual."""
        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        return None

    def _empty_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)  # not page-locked: see pin_memory

    # -- tensor types, the launcher's environment, kernels
    def tensor_type(self, dtype: torch.dtype) -> type:
        """torch's legacy host type (``torch.FloatTensor``, ...), as DeepSpeed's
        CPU accelerator returns."""
        return HOST_TENSOR_TYPES[dtype]

    def export_envs(self) -> list[str]:
        return []

    def is_triton_supported(self) -> bool:
        """False: Triton compiles GPU kernels."""
        return False

    # -- profiling, lazy initialisation, autocast
    def range_push(self, msg: str, domain: Optional[str] = None,
                   category: Optional[str] = None) -> None:
        """Nothing: NVTX ranges are for GPU timelines."""

    def range_pop(self, domain: Optional[str] = None) -> None:
        """Nothing (see :meth:`range_push`)."""

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        """Run ``callback`` now: the CPU needs no initialisation."""
        return callback()

    def amp(self) -> ModuleType:
        """``torch.cpu.amp`` (autocast, GradScaler)."""
        return torch.cpu.amp

    def _default_backend(self) -> str:
        return "gloo"

    def is_bf16_supported(self) -> bool:
        return computes_in(torch.bfloat16, "cpu")

    def is_fp16_supported(self) -> bool:
        return computes_in(torch.float16, "cpu")


#: DeepSpeed's class name.
CPU_Accelerator = CpuAccelerator
