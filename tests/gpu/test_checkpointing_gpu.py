"""``dsrun.checkpointing`` with CUDA tensors (in this process, no process
group): ``cpu_checkpointing`` moves a checkpointed input to host memory
until backward, and the gradients stay the same."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dsrun import checkpointing

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    checkpointing.configure(None)
    yield
    checkpointing.configure(None)
    checkpointing._configured = False


def held_and_grad(cpu: bool) -> tuple[int, torch.Tensor]:
    """Device bytes the checkpoint keeps for a 64 MiB input after the
    caller dropped it, and the gradient that reaches its source."""
    checkpointing.configure(None, checkpoint_in_cpu=cpu, synchronize=True)
    source = torch.randn(4096, 4096, device="cuda", requires_grad=True)
    hidden = source * 2
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = checkpointing.checkpoint(lambda t: (t * 3).square().sum(), hidden)
    del hidden
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    out.backward()
    assert source.grad is not None
    return held, source.grad


def test_cpu_checkpointing_frees_the_device_copy() -> None:
    on_device, grad_device = held_and_grad(cpu=False)
    on_host, grad_host = held_and_grad(cpu=True)
    size = 4096 * 4096 * 4
    assert on_device > -size // 2  # the input stays on the GPU for backward
    assert on_host <= -size + (1 << 20)  # freed: only its host copy is kept
    assert torch.equal(grad_device, grad_host)
