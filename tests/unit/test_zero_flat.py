"""Flat buffers and the inner optimizer's implementation, without processes:
gradients bound to a flat buffer (autograd accumulating into it in place,
strays noticed and copied in), fp32 masters aliasing their flat buffer,
the implementation dsrun picks (and the client's own choice kept), pieces,
the landing of gradients into accumulators, zero.Init's config reading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsrun.runtime.zero.flat import FlatGrads, alias_or_copy, clear_flat_grads, flatten_into
from dsrun.runtime.zero.init import settings_from_config
from dsrun.runtime.zero.masters import HOST_PIECE, OFFLOAD_PIECE, inner_kwargs, piece_size
from dsrun.runtime.zero.offload import HostFence, Landing

CPU = torch.device("cpu")


def _linear_pair() -> tuple[torch.nn.Module, list[torch.nn.Parameter], list[int], int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    params = list(model.parameters())
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel() + 1  # one element of padding after each
    return model, params, offsets, total


def test_parameters_become_views_of_one_zero_padded_buffer() -> None:
    model, params, offsets, total = _linear_pair()
    before = [p.detach().clone() for p in params]
    flat = flatten_into(params, offsets, total)
    for p, b, offset in zip(params, before, offsets):
        assert torch.equal(p, b) and p.data_ptr() == flat[offset:].data_ptr()
        assert flat[offset + p.numel()] == 0  # padding
    with torch.no_grad():
        flat.add_(1.0)
    assert torch.equal(params[0], before[0] + 1)  # the same memory


def test_backward_accumulates_into_the_bound_flat_gradient() -> None:
    model, params, offsets, total = _linear_pair()
    grads = FlatGrads(params, offsets, total)
    x = torch.randn(5, 3)
    model(x).sum().backward()  # unbound: autograd made its own gradients
    expected = [p.grad.clone() for p in params]
    flat = grads.collect()  # copied in, then bound
    assert all(p.grad.data_ptr() == flat[o:].data_ptr() for p, o in zip(params, offsets))
    model(x).sum().backward()  # bound: added in place
    assert all(torch.equal(p.grad, 2 * e) for p, e in zip(params, expected))
    assert grads.collect() is flat and flat[offsets[1] - 1] == 0  # padding untouched
    grads.zero()
    assert not flat.any() and params[0].grad.data_ptr() == flat.data_ptr()


def test_replaced_or_dropped_gradients_are_noticed() -> None:
    model, params, offsets, total = _linear_pair()
    grads = FlatGrads(params, offsets, total)
    flat = grads.collect()
    params[0].grad = None  # as model.zero_grad() does
    params[1].grad = torch.full_like(params[1], 3.0)  # as user code may
    flat.fill_(7.0)
    grads.collect()
    assert not flat[:params[0].numel()].any()  # None reads as zeros
    assert torch.equal(params[1].grad, torch.full_like(params[1], 3.0))
    assert params[1].grad.data_ptr() == flat[offsets[1]:].data_ptr()  # re-bound
    grads.release()
    assert grads.buffer is None and all(p.grad is None for p in params)


def test_arrival_of_gradients_is_noticed() -> None:
    """What ZeRO's step without backward relies on: ``arrived`` after
    collect() says whether any gradient came since the last zero/collect."""
    model, params, offsets, total = _linear_pair()
    grads = FlatGrads(params, offsets, total)
    grads.collect()
    assert not grads.arrived  # nothing yet: every .grad was None
    x = torch.randn(5, 3)
    model(x).sum().backward()  # accumulated in place into the bound views
    grads.collect()
    assert grads.arrived
    grads.collect()
    assert not grads.arrived  # nothing since the last collect
    grads.zero()
    grads.collect()
    assert not grads.arrived  # zeroed between steps: no backward since
    params[1].grad = torch.ones_like(params[1])  # replaced by user code
    grads.collect()
    assert grads.arrived
    grads.release()
    grads.collect()
    assert not grads.arrived  # freed, no backward since


def test_clearing_flat_grads_zeroes_in_place_or_frees() -> None:
    model, params, offsets, total = _linear_pair()
    grads = FlatGrads(params, offsets, total)
    flat = grads.collect()
    flat.fill_(5.0)
    clear_flat_grads([None, grads], set_to_none=False)  # the engine's choice between steps
    assert grads.buffer is flat and not flat.any()
    assert all(p.grad is not None and p.grad.data_ptr() == flat[o:].data_ptr()
               for p, o in zip(params, offsets))
    clear_flat_grads([grads, None], set_to_none=True)
    assert grads.buffer is None and all(p.grad is None for p in params)


def test_fp32_master_aliases_its_range_and_others_are_copies() -> None:
    flat = torch.arange(10, dtype=torch.float32)
    master, aliased = alias_or_copy(flat, 4, 6, CPU, pin_memory=False)
    assert aliased and master.data_ptr() == flat[4:].data_ptr()
    half = flat.to(torch.float16)
    master, aliased = alias_or_copy(half, 4, 6, CPU, pin_memory=True)
    assert not aliased and master.dtype == torch.float32 and torch.equal(master, flat[4:])


@pytest.mark.parametrize(("cls", "given", "chosen"), [
    (torch.optim.AdamW, {}, {"fused": True}),
    (torch.optim.Adam, {"foreach": None, "fused": None}, {"fused": True}),
    (torch.optim.Adam, {"foreach": False}, {"foreach": False}),  # the client's choice
    (torch.optim.Adam, {"fused": False, "foreach": True}, {"fused": False, "foreach": True}),
    (torch.optim.SGD, {"lr": 0.1}, {"lr": 0.1, "foreach": True}),  # fused SGD not elementwise
    (torch.optim.Adam, {"differentiable": True}, {"differentiable": True, "foreach": True}),
])
def test_inner_optimizer_implementation(cls: type, given: dict, chosen: dict) -> None:
    got = inner_kwargs(cls, given, CPU)
    assert {k: v for k, v in got.items() if v is not None} == \
        {k: v for k, v in chosen.items() if v is not None}


def test_pieces_by_implementation_device_and_offload() -> None:
    assert piece_size(5, {"fused": True}, CPU) == 5  # the config's sub_group_size wins
    assert piece_size(None, {"fused": True}, CPU) is None  # fused: no temporaries
    assert piece_size(None, {"foreach": True}, CPU) == HOST_PIECE
    assert piece_size(None, {"foreach": True}, torch.device("cuda", 0)) is None
    assert piece_size(None, {"fused": True}, CPU, offload=True) == OFFLOAD_PIECE


def test_landing_copies_then_adds_on_one_device() -> None:
    landing, target = Landing(), torch.full((4,), 9.0)
    landing.put(target, torch.ones(4, dtype=torch.bfloat16), add=False)
    landing.put(target, torch.full((4,), 2.0), add=True)
    landing.wait()
    assert torch.equal(target, torch.full((4,), 3.0)) and not landing.pending
    landing.before_reuse()  # nothing in flight: no-op
    fence = HostFence()
    fence.after_copies(CPU)
    fence.wait()


def test_zero_init_reads_offload_param_from_its_config(tmp_path: Path) -> None:
    config = {"train_batch_size": 2, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 7,
                                    "offload_param": {"device": "cpu", "pin_memory": True}}}
    found = settings_from_config(config)
    assert (found.persistence_threshold, found.dtype) == (7, torch.bfloat16)
    assert (found.remote_device, found.pin_memory) == ("cpu", True)
    path = tmp_path / "ds.json"
    config["zero_optimization"]["offload_param"] = {"device": "none"}
    path.write_text(json.dumps(config))
    assert settings_from_config(str(path)).remote_device is None
    assert settings_from_config(None).remote_device is None


def test_zero_init_dtype_from_its_config() -> None:
    """As DeepSpeed's Init given a config: fp16 / bf16 sections, else fp32
    (a bf16-made model under an fp32 config trains in fp32); no config: the
    parameters keep the dtype they were made in."""
    base = {"train_batch_size": 2, "zero_optimization": {"stage": 3}}
    assert settings_from_config(base).dtype == torch.float32
    assert settings_from_config({**base, "fp16": {"enabled": True}}).dtype == torch.float16
    assert settings_from_config({**base, "bf16": {"enabled": False}}).dtype == torch.float32
    assert settings_from_config(None).dtype is None


def test_offload_sections_pin_memory_by_default_as_deepspeed() -> None:
    """DeepSpeed 0.19.8's offload_optimizer / offload_param default pin_memory
    to true; an explicit false is kept."""
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    found = settings_from_config({"train_batch_size": 2, "zero_optimization": zero})
    assert found.pin_memory is True
    from dsrun.runtime.config import resolve

    resolved = resolve({"train_batch_size": 2, "zero_optimization": zero}, dp_size=1,
                       dp_source="test", environ={})
    assert resolved.zero_optimization.offload_optimizer.pin_memory is True
    zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    assert settings_from_config({"train_batch_size": 2,
                                 "zero_optimization": zero}).pin_memory is False
