"""``dsrun.checkpointing`` with CUDA tensors (in this process, no process
group): ``cpu_checkpointing`` moves a checkpointed input to host memory
until backward, and the gradients stay the same - also through dropout,
whose recomputation must draw the forward's mask from the CUDA generator."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

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


@pytest.mark.parametrize("cpu", [False, True])
def test_recomputation_draws_the_forwards_dropout_mask(cpu: bool) -> None:
    """Once the inputs are in host memory torch's checkpoint no longer saves
    the CUDA RNG state by itself; the gradient must still use the mask the
    forward drew, though the generator moved on before backward."""
    checkpointing.configure(None, checkpoint_in_cpu=cpu)
    x = torch.ones(512, 512, device="cuda", requires_grad=True)
    torch.cuda.manual_seed(1234)
    mask = F.dropout(torch.ones(512, 512, device="cuda"), p=0.5, training=True) != 0
    torch.cuda.manual_seed(1234)
    out = checkpointing.checkpoint(lambda t: F.dropout(t, p=0.5, training=True).sum(), x)
    torch.rand(1024, device="cuda")  # the generator moves on before backward
    out.backward()
    assert x.grad is not None
    assert torch.equal(x.grad != 0, mask)
    assert torch.equal(x.grad, mask.float() * 2.0)
