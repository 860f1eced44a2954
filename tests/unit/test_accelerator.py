"""dsrun.accelerator: which accelerator a rank gets, and that what it
answers is true of this process (CPU here; the CUDA class where a GPU is)."""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Iterator

import psutil
import pytest
import torch
import torch.distributed as dist

import dsrun
from dsrun import accelerator
from dsrun.accelerator import (
    CpuAccelerator,
    CudaAccelerator,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)
from dsrun.accelerator import real_accelerator as real
from dsrun.accelerator.abstract_accelerator import Accelerator
from dsrun.errors import DsrunError

MIB = 1 << 20
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (torch.cuda.is_available() is False here); CUDA paths run on "
           "GPU hosts")


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test chooses anew, from an environment without overrides."""
    for name in ("DS_ACCELERATOR", "DSRUN_ACCELERATOR", "DSRUN_DIST_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(real, "_current", None)
    yield


@pytest.fixture
def cpu() -> CpuAccelerator:
    return CpuAccelerator()


# ------------------------------------------------------------------ choosing


def test_the_device_this_rank_trains_on_is_chosen_once() -> None:
    acc = get_accelerator()
    expected = CudaAccelerator if torch.cuda.is_available() else CpuAccelerator
    assert type(acc) is expected
    assert get_accelerator() is acc  # one process-wide object
    assert is_current_accelerator_supported()


def test_a_gloo_group_means_the_cpu_even_with_cuda(solo: None) -> None:
    assert real.rank_device_type() == "cpu"
    assert type(get_accelerator()) is CpuAccelerator
    assert get_accelerator().communication_backend_name() == dist.get_backend() == "gloo"


@pytest.mark.parametrize("variable", ["DS_ACCELERATOR", "DSRUN_ACCELERATOR"])
def test_cpu_is_honoured_where_asked_for(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    """DeepSpeed's override, and ``dsrun --cpu`` (the launcher sets
    DSRUN_ACCELERATOR): the CPU even where a GPU would be chosen."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv(variable, "cpu")
    assert type(get_accelerator()) is CpuAccelerator


def test_a_gpu_rank_gets_cuda_before_its_group_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the bootstrap would pick (NCCL for a GPU rank) decides."""
    monkeypatch.setattr(real.rank_dist, "default_backend", lambda env: "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert real.rank_device_type() == "cuda"
    assert type(get_accelerator()) is CudaAccelerator


def test_choose_is_pure_and_refuses_what_cannot_be() -> None:
    assert real.choose(None, "cpu", True) == "cpu"
    assert real.choose("", "cuda", True) == "cuda"
    assert real.choose(" CPU ", "cuda", True) == "cpu"
    assert real.choose("cuda", "cuda", True) == "cuda"
    with pytest.raises(DsrunError, match="DS_ACCELERATOR='xpu': dsrun provides the cuda and cpu"):
        real.choose("xpu", "cpu", False)
    with pytest.raises(DsrunError, match="DS_ACCELERATOR=cuda, but torch sees no CUDA"):
        real.choose("cuda", "cpu", False)
    with pytest.raises(DsrunError, match="DS_ACCELERATOR=cuda, but this rank trains on the CPU"):
        real.choose("cuda", "cpu", True)


def test_set_accelerator(cpu: CpuAccelerator) -> None:
    set_accelerator(cpu)
    assert get_accelerator() is cpu
    with pytest.raises(TypeError, match="got str"):
        set_accelerator("cuda")  # type: ignore[arg-type]


def test_deepspeed_import_paths() -> None:
    """``import dsrun as deepspeed`` then DeepSpeed's import lines."""
    saved = {n: sys.modules.pop(n) for n in list(sys.modules)
             if n == "deepspeed" or n.startswith("deepspeed.")}
    try:
        importlib.import_module("deepspeed")
        from deepspeed.accelerator import get_accelerator as ds_get  # type: ignore
        from deepspeed.accelerator.real_accelerator import (  # type: ignore
            get_accelerator as ds_real_get,
        )

        assert ds_get is ds_real_get is get_accelerator
        assert sys.modules["deepspeed.accelerator"] is accelerator
    finally:
        for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def test_deepspeed_attribute_access() -> None:
    """``deepspeed.accelerator`` without an import statement: the name must
    be in dsrun's lazily loaded submodules (``dsrun._SUBMODULES``)."""
    assert dsrun.__getattr__("accelerator") is accelerator


# ------------------------------------------------------------------ the CPU


def test_cpu_device_answers(cpu: CpuAccelerator) -> None:
    assert cpu.device_name() == cpu.device_name(3) == cpu.current_device_name() == "cpu"
    assert cpu.device(0) == torch.device("cpu")
    # usable wherever a device is: an int would mean a CUDA device to torch
    assert torch.zeros(1, device=cpu.current_device()).device.type == "cpu"
    assert cpu.device_count() == torch.cpu.device_count() == 1
    assert cpu.is_available()
    cpu.set_device(0)
    cpu.synchronize()
    assert cpu.is_synchronized_device() and cpu.use_host_timers()
    assert cpu.resolves_data_dependency() and cpu.handles_memory_backpressure()
    assert cpu.on_accelerator(torch.ones(1))
    assert not cpu.on_accelerator(torch.ones(1, device="meta"))
    assert cpu.communication_backend_name() == "gloo"  # no group here: what dsrun would use
    tensor = cpu.FloatTensor([1, 2])
    assert (tensor.dtype, tensor.device.type, tensor.tolist()) == (torch.float32, "cpu", [1, 2])
    assert cpu.BFloat16Tensor([1]).dtype == torch.bfloat16


def test_cpu_random_numbers(cpu: CpuAccelerator) -> None:
    cpu.manual_seed(1234)
    assert cpu.initial_seed() == 1234
    first = torch.rand(3)
    cpu.manual_seed_all(1234)
    assert torch.equal(torch.rand(3), first)
    state = cpu.get_rng_state()
    draw = torch.rand(3)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(3), draw)
    assert cpu.random() is torch.random and cpu.default_generator(0) is torch.default_generator


def test_cpu_dtypes_are_ones_it_computes_in(cpu: CpuAccelerator) -> None:
    dtypes = cpu.supported_dtypes()
    assert dtypes[0] == torch.float32
    assert (torch.float16 in dtypes) == cpu.is_fp16_supported()
    assert (torch.bfloat16 in dtypes) == cpu.is_bf16_supported()
    for dtype in dtypes:
        a = torch.full((3, 3), 0.5, dtype=dtype)
        assert (a @ a).sum().item() == 6.75


def test_cpu_memory_is_this_process_rss(cpu: CpuAccelerator) -> None:
    before = cpu.memory_allocated()
    assert abs(before - psutil.Process().memory_info().rss) < 16 * MIB
    block = torch.ones(64 * MIB // 4)  # 64 MiB, written: resident
    during = cpu.memory_allocated()
    assert during - before > 48 * MIB
    assert cpu.max_memory_allocated() >= during
    assert cpu.memory_reserved() >= during - 16 * MIB
    assert cpu.max_memory_reserved() >= during
    stats = cpu.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] > 0
    del block
    cpu.empty_cache()
    cpu.reset_peak_memory_stats()
    after = cpu.max_memory_allocated()
    assert after < during - 32 * MIB  # the peak started over
    assert cpu.total_memory() == psutil.virtual_memory().total
    assert 0 < cpu.available_memory() <= cpu.total_memory()


def test_cpu_pinning_streams_events_and_ranges(cpu: CpuAccelerator) -> None:
    tensor = torch.ones(4)
    assert cpu.pin_memory(tensor, align_bytes=64) is tensor
    assert not cpu.is_pinned(tensor)
    stream = cpu.Stream()
    with cpu.stream(stream):
        assert torch.ones(1).sum() == 1
    assert cpu.current_stream() is cpu.default_stream()
    start, end = cpu.Event(enable_timing=True), cpu.Event(enable_timing=True)
    start.record()
    time.sleep(0.02)
    end.record()
    end.synchronize()
    assert start.query() and 15 <= start.elapsed_time(end) < 5000
    with pytest.raises(RuntimeError, match="recorded"):
        cpu.Event().elapsed_time(end)
    cpu.range_push("fwd")
    cpu.range_pop()
    calls: list[int] = []
    assert cpu.lazy_call(lambda: calls.append(1) or 7) == 7 and calls == [1]
    assert cpu.amp() is torch.cpu.amp  # autocast, GradScaler (torch may call them deprecated)


def test_pin_memory_takes_deepspeeds_keywords(cpu: CpuAccelerator) -> None:
    """DeepSpeed 0.19.8's ``pin_memory(tensor, make_copy=True,
    match_shape=True)``, and its earlier releases' ``align_bytes``."""
    tensor = torch.ones(2, 3)
    for kwargs in ({}, {"make_copy": False}, {"make_copy": False, "match_shape": False},
                   {"make_copy": True, "align_bytes": 4096}):
        assert cpu.pin_memory(tensor, **kwargs) is tensor  # DeepSpeed's CPU answer
    with pytest.raises(ValueError, match="align_bytes must be a positive int, got 0"):
        cpu.pin_memory(tensor, align_bytes=0)
    assert cpu.pin_memory_alignment() == 1
    assert cpu.register_host_memory(tensor.data_ptr(), 24) is False
    assert cpu.unregister_host_memory(tensor.data_ptr()) is None
    assert cpu.supports_nvtx_domain is False and cpu.prefer_triton_grouped_mm() is False


class _CopyingHost(CpuAccelerator):
    """The base class's pin_memory with host copies standing for pinned ones
    (what CUDA does, without a GPU)."""

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True,
                   *, align_bytes: int = 1) -> torch.Tensor:
        return Accelerator.pin_memory(self, tensor, make_copy, match_shape,
                                      align_bytes=align_bytes)

    def _pinned_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()


def test_pin_memory_copies_or_makes_a_buffer() -> None:
    acc = _CopyingHost()
    tensor = torch.arange(6.0).reshape(2, 3)
    copy = acc.pin_memory(tensor)
    assert torch.equal(copy, tensor) and copy.data_ptr() != tensor.data_ptr()
    buffer = acc.pin_memory(tensor, make_copy=False)
    assert buffer.shape == (2, 3) and buffer.dtype == tensor.dtype
    assert acc.pin_memory(tensor.half(), False, False).shape == (6,)  # positional, as DeepSpeed
    assert acc.pin_memory(tensor.half(), make_copy=False, match_shape=False).dtype == torch.half
    with pytest.raises(ValueError, match="align_bytes must be a positive int, got True"):
        acc.pin_memory(tensor, align_bytes=True)


def test_cpu_graphs_are_deepspeeds_stand_ins(cpu: CpuAccelerator) -> None:
    graph = cpu.create_graph()
    assert graph is None and not cpu.is_current_stream_capturing()
    ran = []
    with cpu.capture_to_graph(graph):
        ran.append(torch.ones(2).sum().item())
    assert ran == [2.0] and cpu.replay_graph(graph) is None and ran == [2.0]


@pytest.mark.parametrize("name", ["create_op_builder", "get_op_builder"])
def test_compiled_ops_are_refused(cpu: CpuAccelerator, name: str) -> None:
    with pytest.raises(DsrunError, match="'CPUAdamBuilder': dsrun does not build or load "
                                         "DeepSpeed's compiled ops.*dsrun.ops.adam"):
        getattr(cpu, name)("CPUAdamBuilder")


@pytest.mark.parametrize("name", ["op_builder_dir", "build_extension"])
def test_building_ops_is_refused_too(cpu: CpuAccelerator, name: str) -> None:
    with pytest.raises(DsrunError, match=rf"{name}\(\): dsrun does not build or load"):
        getattr(cpu, name)()


TYPES = {"FloatTensor": torch.float32, "HalfTensor": torch.float16,
         "BFloat16Tensor": torch.bfloat16, "DoubleTensor": torch.float64,
         "IntTensor": torch.int32, "LongTensor": torch.int64, "ByteTensor": torch.uint8}


@pytest.mark.parametrize(("name", "dtype"), TYPES.items())
def test_cpu_tensor_types_are_torchs_as_in_deepspeed(cpu: CpuAccelerator, name: str,
                                                     dtype: torch.dtype) -> None:
    """DeepSpeed's CPU accelerator gives torch.FloatTensor and the others:
    sizes make a tensor of that shape (they made a scalar), data a tensor of
    the data, and isinstance works (it raised TypeError)."""
    kind = getattr(cpu, name)
    assert kind is getattr(torch, name)
    assert kind(3).shape == (3,) and kind(2, 3).shape == (2, 3) and kind().shape == (0,)
    made = kind([1, 2])
    assert (made.dtype, made.tolist()) == (dtype, [1, 2])
    assert isinstance(made, kind) and isinstance(torch.zeros(1, dtype=dtype), kind)
    other = torch.int8 if dtype != torch.int8 else torch.float32
    assert not isinstance(torch.zeros(1, dtype=other), kind)


def test_cuda_tensor_types_are_deepspeeds_torch_tensor_in_the_dtype() -> None:
    """DeepSpeed's CUDA accelerator gives ``torch.tensor`` in the dtype on
    "cuda" (data, not sizes); dsrun's also answers isinstance."""
    acc = CudaAccelerator()
    for name, dtype in TYPES.items():
        kind = getattr(acc, name)
        assert kind.func is torch.tensor and kind.keywords == {"dtype": dtype,
                                                               "device": "cuda"}
        assert not isinstance(torch.zeros(1, dtype=dtype), kind)  # a host tensor
        assert not isinstance("x", kind)
    if torch.cuda.is_available():
        made = acc.LongTensor([4])
        assert made.tolist() == [4] and made.is_cuda and isinstance(made, acc.LongTensor)
        assert acc.FloatTensor(3).shape == ()  # the scalar 3.0, as DeepSpeed's
        assert not isinstance(made, acc.FloatTensor)


def test_cpu_older_memory_names(cpu: CpuAccelerator) -> None:
    """memory_cached & co. (torch.cuda's older names) and DeepSpeed's CPU
    get_rss / reset_rss / max_mem answer with the resident set. A 256 MiB
    block against 64 MiB margins: other threads of the test process (gloo,
    checkpoint writers of earlier tests) may move the resident set a little."""
    rss = psutil.Process().memory_info().rss
    assert abs(cpu.memory_cached() - rss) < 64 * MIB
    assert abs(cpu.get_rss() - rss) < 64 * MIB
    block = torch.ones(256 * MIB // 4)
    during = cpu.get_rss()
    assert cpu.max_memory_cached() >= during and cpu.max_mem >= during
    del block
    cpu.empty_cache()
    cpu.reset_max_memory_cached()
    assert cpu.max_memory_cached() < during - 128 * MIB
    block = torch.ones(256 * MIB // 4)
    assert cpu.max_mem >= cpu.get_rss() > during - 64 * MIB
    del block
    cpu.empty_cache()
    assert cpu.reset_rss() < during - 128 * MIB
    assert cpu.max_mem < during - 128 * MIB


def test_cpu_pin_empty_and_the_launchers_environment(cpu: CpuAccelerator) -> None:
    for made in (cpu.pin_empty(2, 3, dtype=torch.float16),
                 cpu.pin_empty((2, 3), dtype=torch.float16),
                 cpu.pin_empty_like(torch.ones(2, 3, dtype=torch.float16)),
                 cpu.pin_empty_like(torch.ones(2, 3), dtype=torch.float16)):
        assert (made.shape, made.dtype, made.device.type) == ((2, 3), torch.float16, "cpu")
        assert not cpu.is_pinned(made)  # as DeepSpeed's CPU accelerator: nothing to pin for
    assert cpu.unpin_memory(torch.ones(1)) is None
    with pytest.raises(ValueError, match="pin_empty allocates host memory: device must be "
                                         "'cpu', got 'cuda:0'"):
        cpu.pin_empty(2, dtype=torch.float32, device="cuda:0")
    env = {"PATH": "/bin"}
    assert cpu.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"]
    cpu.set_visible_devices_envs(env, [0, 2])
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,2"}
    assert cpu.export_envs() == [] and CudaAccelerator().export_envs() == ["NCCL"]
    assert cpu.is_fp64_supported() and not cpu.is_triton_supported()
    assert CudaAccelerator().is_triton_supported() == (
        torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8)


# ------------------------------------------------------------------ CUDA


@needs_cuda
def test_cuda_answers() -> None:
    acc = CudaAccelerator()
    index = torch.cuda.current_device()
    assert acc.device_name() == "cuda" and acc.device_name(index) == f"cuda:{index}"
    assert acc.current_device() == index and acc.current_device_name() == f"cuda:{index}"
    assert acc.device(index) == torch.device("cuda", index)
    assert acc.device_count() == torch.cuda.device_count() and acc.is_available()
    assert not acc.is_synchronized_device() and not acc.use_host_timers()
    assert acc.communication_backend_name() in ("nccl", "gloo")
    for dtype in acc.supported_dtypes():
        a = torch.full((3, 3), 0.5, dtype=dtype, device="cuda")
        assert (a @ a).sum().item() == 6.75
    acc.manual_seed(99)
    first = torch.rand(3, device="cuda")
    acc.manual_seed_all(99)
    assert torch.equal(torch.rand(3, device="cuda"), first) and acc.initial_seed() == 99
    state = acc.get_rng_state()
    draw = torch.rand(3, device="cuda")
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(3, device="cuda"), draw)


@needs_cuda
def test_cuda_memory_streams_and_pinning() -> None:
    acc = CudaAccelerator()
    acc.synchronize()
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    block = torch.ones(64 * MIB // 4, device="cuda")
    assert acc.memory_allocated() - before >= 64 * MIB
    assert acc.max_memory_allocated() >= acc.memory_allocated()
    assert acc.memory_reserved() >= acc.memory_allocated()
    assert acc.on_accelerator(block) and not acc.on_accelerator(torch.ones(1))
    del block
    acc.empty_cache()
    assert 0 < acc.available_memory() <= acc.total_memory()
    pinned = acc.pin_memory(torch.ones(4))
    assert acc.is_pinned(pinned)
    scratch = acc.pin_empty(4, dtype=torch.float16)
    assert acc.is_pinned(scratch) and scratch.shape == (4,) and scratch.device.type == "cpu"
    assert acc.is_pinned(acc.pin_empty_like(torch.ones(2, 2)))
    assert acc.memory_cached() == acc.memory_reserved()
    assert acc.max_memory_cached() == acc.max_memory_reserved()
    stream = acc.Stream()
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    with acc.stream(stream):
        start.record()
        torch.ones(1024, 1024, device="cuda").sum()
        end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0
    assert acc.current_stream() == acc.default_stream()
    acc.range_push("step")
    acc.range_pop()
    assert acc.amp() is torch.cuda.amp


@needs_cuda
def test_cuda_pin_memory_keywords_host_registration_and_graphs() -> None:
    acc = CudaAccelerator()
    tensor = torch.arange(6.0).reshape(2, 3)
    copy = acc.pin_memory(tensor, align_bytes=64)
    assert acc.is_pinned(copy) and torch.equal(copy, tensor) and not acc.is_pinned(tensor)
    flat = acc.pin_memory(tensor, make_copy=False, match_shape=False)
    assert acc.is_pinned(flat) and flat.shape == (6,)
    assert acc.supports_nvtx_domain is False and acc.pin_memory_alignment() == 1
    assert acc.communication_backend_version() == torch.cuda.nccl.version()
    host = torch.zeros(1 << 16)  # pageable, then registered in place
    assert acc.register_host_memory(host.data_ptr(), host.numel() * host.element_size())
    try:
        assert acc.is_pinned(host)
    finally:
        acc.unregister_host_memory(host.data_ptr())
    assert not acc.is_pinned(host)
    static = torch.ones(4, device="cuda")
    out = torch.empty(4, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture, as torch asks
        out.copy_(static * 2)
    torch.cuda.current_stream().wait_stream(side)
    graph = acc.create_graph()
    with acc.capture_to_graph(graph):
        assert acc.is_current_stream_capturing()
        out.copy_(static * 2)
    static.fill_(5.0)
    acc.replay_graph(graph)
    torch.cuda.synchronize()
    assert out.tolist() == [10.0] * 4 and not acc.is_current_stream_capturing()
