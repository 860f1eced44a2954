"""The flops profiler on CUDA (in this process, no process group): the
same model counts the same on the GPU as on the CPU, whatever attention
kernel CUDA picks (flash, memory-efficient or cuDNN, each priced by the
same rule), in fp32 and under bf16 autocast, and module latencies are
measured with synchronisation (positive, within the forward's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsrun.profiling.flops_profiler import FlopsProfiler

pytestmark = pytest.mark.gpu


class Attention(nn.Module):
    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, w))


def profile(device: str, dtype: torch.dtype | None) -> tuple[int, FlopsProfiler]:
    torch.manual_seed(0)
    model = nn.Sequential(Attention(), Attention()).to(device)
    x = torch.randn(2, 32, 64, device=device)
    prof = FlopsProfiler(model)
    prof.start_profile()
    with torch.no_grad(), torch.autocast(device, dtype=dtype or torch.float32,
                                         enabled=dtype is not None):
        model(x)
    prof.stop_profile()
    return prof.get_total_macs(), prof


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_cuda_counts_equal_cpu_counts(dtype: torch.dtype | None) -> None:
    cpu_macs, _ = profile("cpu", None)
    cuda_macs, prof = profile("cuda", dtype)
    assert cuda_macs == cpu_macs > 0
    root = prof.module_stats()
    assert root is not None and root.duration > 0
    assert all(0 < child.duration <= root.duration for child in root.children)
