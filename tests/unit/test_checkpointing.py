"""``dsrun.checkpointing`` (DeepSpeed's ``deepspeed.checkpointing``) in this
process, on CPU tensors: recomputation, the RNG tracker, configuration."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dsrun import checkpointing
from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.runtime.config import resolve


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    """Module state as after import, before and after each test."""
    def clear() -> None:
        checkpointing._settings = checkpointing.CheckpointSettings()
        checkpointing._configured = False
        checkpointing._mpu = None
        checkpointing.get_cuda_rng_tracker().reset()
    clear()
    yield
    clear()


class Block(torch.nn.Module):
    """Linear + dropout inside the tracker's model-parallel state + dropout
    on the default generator; counts its runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.5)
        self.runs = 0

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.runs += 1
        with checkpointing.get_cuda_rng_tracker().fork():
            y = self.drop(self.lin(x))
        return self.drop(y) * scale


def run(block: Block, use_checkpoint: bool, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    checkpointing.model_parallel_cuda_manual_seed(3)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    block.zero_grad(set_to_none=True)
    y = checkpointing.checkpoint(block, x, **kwargs) if use_checkpoint else block(x, **kwargs)
    y.square().sum().backward()
    assert x.grad is not None and block.lin.weight.grad is not None
    return y.detach(), x.grad, block.lin.weight.grad


def test_recomputes_with_the_forwards_random_state() -> None:
    block = Block()
    plain = run(block, False, scale=2.0)
    block.runs = 0
    checked = run(block, True, scale=2.0)
    assert block.runs == 2  # forward, then again in backward
    for a, b in zip(plain, checked):
        assert torch.equal(a, b)


def test_without_restoring_the_tracker_gradients_would_differ(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tracker part of the recomputation context matters: torch's own
    RNG preservation alone replays the default generator only."""
    import contextlib

    block = Block()
    plain = run(block, False)
    monkeypatch.setattr(checkpointing, "_contexts",
                        lambda: (contextlib.nullcontext(), contextlib.nullcontext()))
    checked = run(block, True)
    assert torch.equal(plain[0], checked[0])  # the forward is the same
    assert not torch.equal(plain[1], checked[1])  # the recomputed mask is not


def test_inputs_without_grad() -> None:
    lin = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)  # no requires_grad: non-reentrant still reaches the weights
    checkpointing.checkpoint(lin, x).sum().backward()
    assert lin.weight.grad is not None
    assert checkpointing.checkpoint is checkpointing.non_reentrant_checkpoint


def test_cpu_checkpointing_and_synchronize_change_nothing_on_cpu() -> None:
    block = Block()
    plain = run(block, True)
    checkpointing.configure(None, checkpoint_in_cpu=True, synchronize=True)
    assert checkpointing.settings().cpu_checkpointing
    again = run(block, True)
    for a, b in zip(plain, again):
        assert torch.equal(a, b)


def test_profile_logs_forward_and_recomputation(caplog: pytest.LogCaptureFixture) -> None:
    checkpointing.configure(profile=True)
    with caplog.at_level(logging.INFO, logger="dsrun.runtime"):
        run(Block(), True)
    text = caplog.text
    assert "activation checkpoint forward:" in text
    assert "activation checkpoint recomputation:" in text


def test_configure_from_the_config(tmp_path: Path) -> None:
    assert not checkpointing.is_configured()
    section = {"partition_activations": True, "contiguous_memory_optimization": True,
               "number_checkpoints": 4, "cpu_checkpointing": True, "profile": True}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": section}))
    for source in (str(path), {"activation_checkpointing": section},
                   resolve(str(path), dp_size=1, dp_source="test")):
        checkpointing.configure(None, deepspeed_config=source)
        got = checkpointing.settings()
        assert (got.partition_activations, got.contiguous_memory_optimization,
                got.number_checkpoints, got.cpu_checkpointing, got.profile,
                got.synchronize_checkpoint_boundary) == (True, True, 4, True, True, False)
    assert checkpointing.is_configured()
    checkpointing.configure(None, deepspeed_config=str(path), profile=False, num_checkpoints=6)
    assert checkpointing.settings().profile is False  # keywords win over the file
    assert checkpointing.settings().number_checkpoints == 6
    checkpointing.set_num_layers(2)
    assert checkpointing.settings().number_checkpoints == 2
    checkpointing.configure(None)  # defaults again
    assert checkpointing.settings() == checkpointing.CheckpointSettings()


def test_configure_errors(tmp_path: Path) -> None:
    with pytest.raises(DsrunConfigError, match="needs partition_activations"):
        checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    with pytest.raises(DsrunConfigError, match="number of checkpoints"):
        checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"activation_checkpointing": {"cpu_checkpoint": True}}))
    wanted = r'"cpu_checkpoint" in "activation_checkpointing" of .*bad.json; did you mean'
    with pytest.raises(DsrunConfigError, match=wanted):
        checkpointing.configure(None, deepspeed_config=str(path))

    class MPU:
        def get_model_parallel_world_size(self) -> int:
            return 2

        def get_model_parallel_rank(self) -> int:
            return 1

    with pytest.raises(DsrunConfigError, match="no tensor parallelism"):
        checkpointing.configure(MPU(), partition_activations=True)
    assert not checkpointing.is_configured()
    checkpointing.configure(MPU())  # without partitioning, a model-parallel mpu is fine


def test_config_section_is_checked_at_resolve() -> None:
    config = resolve({"train_batch_size": 1, "activation_checkpointing": {
        "cpu_checkpointing": True}}, dp_size=1, dp_source="test")
    assert config.activation_checkpointing.cpu_checkpointing
    assert "activation_checkpointing" not in config.passthrough
    with pytest.raises(DsrunConfigError, match="needs partition_activations"):
        resolve({"train_batch_size": 1, "activation_checkpointing": {
            "contiguous_memory_optimization": True, "number_checkpoints": 2}},
            dp_size=1, dp_source="test")


def test_tracker_seeds_and_errors() -> None:
    tracker = checkpointing.get_cuda_rng_tracker()

    class MPU:
        def get_tensor_model_parallel_rank(self) -> int:
            return 1

        def get_tensor_model_parallel_world_size(self) -> int:
            return 1

    checkpointing.configure(MPU())
    checkpointing.model_parallel_cuda_manual_seed(10)
    expected = torch.Generator().manual_seed(10 + 2718 + 1).get_state()
    assert torch.equal(tracker.get_states()[checkpointing.MODEL_PARALLEL_RNG], expected)
    assert torch.equal(torch.get_rng_state(), torch.Generator().manual_seed(10).get_state())
    outside = torch.get_rng_state()
    with tracker.fork():
        inside = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)  # fork leaves the default alone
    with tracker.fork():
        assert not torch.equal(torch.rand(3), inside)  # and continues where it left off
    with pytest.raises(DsrunError, match="in use already"):
        tracker.add("other", 10 + 2718 + 1)
    with pytest.raises(DsrunError, match="exists already"):
        tracker.add(checkpointing.MODEL_PARALLEL_RNG, 5)
    with pytest.raises(DsrunError, match="no state 'missing'"):
        with tracker.fork("missing"):
            pass


def test_deepspeed_spelling() -> None:
    import dsrun as deepspeed

    assert deepspeed.checkpointing is checkpointing
    from deepspeed.checkpointing import CheckpointFunction, CudaRNGStatesTracker, checkpoint

    assert checkpoint is checkpointing.checkpoint
    assert CudaRNGStatesTracker is checkpointing.RNGStatesTracker
    assert issubclass(CheckpointFunction, torch.autograd.Function)


# ------------------------------------------------------------ DeepSpeed's reentrant one


def run_reentrant(block: Block) -> tuple[torch.Tensor, ...]:
    """:func:`run` through ``CheckpointFunction.apply`` (DeepSpeed's call)."""
    checkpointing.model_parallel_cuda_manual_seed(3)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    block.zero_grad(set_to_none=True)
    all_outputs: list[Any] = []
    y = checkpointing.CheckpointFunction.apply(block, all_outputs, x)
    assert all_outputs == [y] and all_outputs[0] is y
    y.square().sum().backward()
    assert x.grad is not None and block.lin.weight.grad is not None
    return y.detach(), x.grad, block.lin.weight.grad


def test_checkpoint_function_recomputes_with_the_forwards_random_state() -> None:
    block = Block()
    plain = run(block, False)
    block.runs = 0
    checked = run_reentrant(block)
    assert block.runs == 2
    for a, b in zip(plain, checked):
        assert torch.equal(a, b)
    checkpointing.configure(None, checkpoint_in_cpu=True, synchronize=True)
    for a, b in zip(plain, run_reentrant(block)):
        assert torch.equal(a, b)


def test_checkpoint_function_with_non_tensor_arguments_and_outputs() -> None:
    lin = torch.nn.Linear(3, 3)

    def block(x: torch.Tensor, scale: float, idx: torch.Tensor) -> tuple[Any, ...]:
        return lin(x) * scale, "tag", idx + 1

    x = torch.randn(2, 3, requires_grad=True)
    idx = torch.tensor([0, 1])
    all_outputs: list[Any] = []
    returned = checkpointing.CheckpointFunction.apply(block, all_outputs, x, 2.0, idx)
    assert len(returned) == 2 and all_outputs[1] == "tag"
    y, _, bumped = all_outputs
    assert torch.equal(bumped, idx + 1) and not bumped.requires_grad
    y.sum().backward()
    expected = torch.autograd.grad((lin(x) * 2.0).sum(), (x, lin.weight))
    assert x.grad is not None and torch.allclose(x.grad, expected[0])
    assert lin.weight.grad is not None and torch.allclose(lin.weight.grad, expected[1])


def test_checkpoint_function_refuses_autograd_grad() -> None:
    lin = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    y = checkpointing.CheckpointFunction.apply(lin, [], x)
    with pytest.raises(DsrunError, match="autograd.grad"):
        torch.autograd.grad(y.sum(), x)


def test_checkpoint_function_profiles(caplog: pytest.LogCaptureFixture) -> None:
    checkpointing.configure(profile=True)
    with caplog.at_level(logging.INFO, logger="dsrun.runtime"):
        run_reentrant(Block())
    assert "activation checkpoint forward:" in caplog.text
    assert "activation checkpoint recomputation:" in caplog.text


def test_extract_and_merge_tensors() -> None:
    a, b = torch.ones(1), torch.zeros(2)
    objects = (a, 1, "x", b, None)
    tensors, others, flags = checkpointing.extract_tensors(objects)
    assert tensors == (a, b) and others == (1, "x", None)
    assert flags == (True, False, False, True, False)
    merged = checkpointing.merge_tensors(tensors, others, flags)
    assert type(merged) is tuple and len(merged) == 5
    assert all(m is o for m, o in zip(merged, objects))
    as_list = checkpointing.extract_tensors([a, 2])
    assert as_list == ([a], [2], [True, False])
    assert checkpointing.merge_tensors(*as_list)[1] == 2  # a tuple, as DeepSpeed's


def test_detach_variable() -> None:
    x = torch.randn(2, requires_grad=True) * 2  # not a leaf
    n = torch.tensor([1])
    got = checkpointing.detach_variable((x, n, "s"), device="cpu")
    assert got[0].requires_grad and got[0].grad_fn is None and torch.equal(got[0], x)
    assert not got[1].requires_grad and got[2] == "s"
    with pytest.raises(DsrunError, match="takes a tuple"):
        checkpointing.detach_variable([x])  # type: ignore[arg-type]


class TwoRankMPU:
    def get_model_parallel_world_size(self) -> int:
        return 2

    def get_model_parallel_rank(self) -> int:
        return 1


def test_partition_start_and_size() -> None:
    item = torch.zeros(2, 5)
    assert checkpointing.get_partition_start(item) == 0
    assert checkpointing.get_partition_size(item) == 10  # no mpu: one part
    checkpointing.configure(TwoRankMPU())
    assert checkpointing.get_partition_start(item) == 5
    assert checkpointing.get_partition_size(item) == 5
    assert checkpointing.get_partition_start(torch.zeros(9)) == 4  # DeepSpeed's int(4.5)
    with pytest.raises(DsrunError, match="9 elements do not split evenly over the 2"):
        checkpointing.get_partition_size(torch.zeros(9))


def test_partition_activations_in_checkpoint() -> None:
    checkpointing.partition_activations_in_checkpoint(True)
    assert checkpointing.settings().partition_activations
    checkpointing.partition_activations_in_checkpoint(False)
    assert not checkpointing.settings().partition_activations
    checkpointing.configure(TwoRankMPU())
    with pytest.raises(DsrunConfigError, match="no tensor parallelism"):
        checkpointing.partition_activations_in_checkpoint(True)
    assert not checkpointing.settings().partition_activations
