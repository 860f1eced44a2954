"""dsrun.ops.adam: DeepSpeed's FusedAdam / DeepSpeedCPUAdam are torch's
Adam/AdamW step for step, with torch's fastest kernel, and refuse what
torch cannot do by naming the option."""

from __future__ import annotations

import copy
import importlib
import sys
from typing import Any

import pytest
import torch

import dsrun
from dsrun import ops
from dsrun.errors import DsrunConfigError
from dsrun.ops import adam
from dsrun.ops.adam import DeepSpeedCPUAdam, FusedAdam, fastest_implementation

CPU_FUSED = "cpu" in adam.fused_devices()  # torch >= 2.4


def model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 2)).to(dtype)


def groups(net: torch.nn.Module) -> list[dict[str, Any]]:
    """Two groups with their own LR and weight decay."""
    first, second = list(net[0].parameters()), list(net[2].parameters())
    return [{"params": first}, {"params": second, "lr": 0.03, "weight_decay": 0.2}]


def run(net: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 6) -> None:
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(4, 6, generator=gen, dtype=next(net.parameters()).dtype)
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


CASES = [  # (class, its Adam/AdamW switch, value, the torch class it equals)
    (FusedAdam, "adam_w_mode", True, torch.optim.AdamW),
    (FusedAdam, "adam_w_mode", False, torch.optim.Adam),
    (DeepSpeedCPUAdam, "adamw_mode", True, torch.optim.AdamW),
    (DeepSpeedCPUAdam, "adamw_mode", False, torch.optim.Adam),
]


@pytest.mark.parametrize(("cls", "switch", "decoupled", "reference"), CASES)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_step_for_step_torch(cls: type, switch: str, decoupled: bool, reference: type,
                             amsgrad: bool) -> None:
    hyper = {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-7, "weight_decay": 0.1,
             "amsgrad": amsgrad}
    mine, same_kernel, default = model(), model(), model()
    opt = cls(groups(mine), **hyper, **{switch: decoupled})
    assert isinstance(opt, torch.optim.Optimizer) and opt.adam_w_mode is decoupled
    fused = opt.param_groups[0]["fused"]
    assert fused is (True if CPU_FUSED else None)  # torch's fastest on this device
    run(mine, opt)
    run(same_kernel, reference(groups(same_kernel), **hyper, fused=fused))
    assert same(mine, same_kernel)  # bitwise, with the same kernel
    run(default, reference(groups(default), **hyper))
    assert max_diff(mine, default) < 1e-6  # torch's default kernel rounds otherwise
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.03]
    assert [g["decoupled_weight_decay"] for g in opt.param_groups] == [decoupled] * 2


@pytest.mark.parametrize(("cls", "switch", "decoupled", "reference"), CASES)
def test_without_torch_decoupled_weight_decay(cls: type, switch: str, decoupled: bool,
                                              reference: type) -> None:
    """The path for torch without Adam's ``decoupled_weight_decay``."""

    class Older(cls):  # type: ignore[misc, valid-type]
        _torch_decouples = False

    hyper = {"lr": 0.01, "weight_decay": 0.1}
    mine, ref = model(), model()
    opt = Older(groups(mine), **hyper, **{switch: decoupled})
    assert "decoupled_weight_decay" not in opt.defaults or not opt.defaults[
        "decoupled_weight_decay"]  # torch was not asked
    run(mine, opt)
    run(ref, reference(groups(ref), **hyper, foreach=False))
    assert max_diff(mine, ref) < 1e-6
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.2]  # restored


def test_implementation_choice() -> None:
    net = model()
    given = [{"params": list(net[0].parameters()), "fused": False, "foreach": True},
             {"params": list(net[2].parameters())}]
    opt = FusedAdam(given)
    expected = True if CPU_FUSED else None
    assert [(g["fused"], g["foreach"]) for g in opt.param_groups] == [(expected, None)] * 2
    assert given[0]["fused"] is False  # the caller's dicts are not changed
    complex_param = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    assert fastest_implementation([complex_param]) == {"fused": None, "foreach": None}
    assert fastest_implementation([torch.zeros(2, device="meta")])["fused"] is None
    named = FusedAdam(list(net.named_parameters()))
    assert named.param_groups[0]["fused"] is expected


def test_step_hooks_run_once_per_step() -> None:
    torch.optim.Adam([torch.nn.Parameter(torch.ones(1))])  # torch wraps Adam.step
    net = model()
    opt = FusedAdam(net.parameters())
    calls: list[int] = []
    opt.register_step_pre_hook(lambda *_: calls.append(1))
    opt.register_step_post_hook(lambda *_: calls.append(2))
    run(net, opt, steps=2)
    assert calls == [1, 2, 1, 2]


def test_closure_and_zero_grad() -> None:
    net = model()
    opt = FusedAdam(net.parameters(), set_grad_none=False)
    x = torch.randn(3, 6)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = net(x).sum()
        loss.backward()
        return loss

    assert opt.step(closure) is not None
    opt.zero_grad()  # set_grad_none=False: zeroed, kept
    assert all(p.grad is not None and not p.grad.any() for p in net.parameters())
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in net.parameters())
    closure()
    FusedAdam(net.parameters()).zero_grad()  # DeepSpeed's default: set to None
    assert all(p.grad is None for p in net.parameters())


def test_state_dict_round_trip_and_defaults() -> None:
    a, b = model(), model()
    opt_a = DeepSpeedCPUAdam(a.parameters(), lr=0.02, adamw_mode=False, weight_decay=0.1)
    run(a, opt_a, steps=2)
    b.load_state_dict(a.state_dict())
    opt_b = DeepSpeedCPUAdam(b.parameters(), lr=0.02, adamw_mode=False, weight_decay=0.1)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # torch would share tensors
    run(a, opt_a, steps=2)
    run(b, opt_b, steps=2)
    assert same(a, b)
    # DeepSpeed's options stay with the optimizer (a ZeRO rebuild reads them)
    assert {k: opt_a.defaults[k] for k in ("bias_correction", "adamw_mode",
                                          "fp32_optimizer_states")} == \
        {"bias_correction": True, "adamw_mode": False, "fp32_optimizer_states": True}


@pytest.mark.parametrize("cls", [FusedAdam, DeepSpeedCPUAdam])
def test_bias_correction_false_is_refused(cls: type) -> None:
    net = model()
    with pytest.raises(DsrunConfigError, match=rf"{cls.__name__}\(bias_correction=False\) is "
                                               "not supported.*always corrects"):
        cls(net.parameters(), bias_correction=False)
    with pytest.raises(DsrunConfigError, match="bias_correction=False"):
        cls([{"params": list(net.parameters()), "bias_correction": False}])
    with pytest.raises(TypeError, match="iterable of tensors or dicts"):
        cls(torch.ones(2, requires_grad=True))


def test_fp32_optimizer_states_with_16_bit_parameters() -> None:
    net = model(dtype=torch.bfloat16)
    opt = DeepSpeedCPUAdam(net.parameters())
    with pytest.raises(DsrunConfigError, match=r"fp32_optimizer_states=True\): parameter 0 of "
                                               "group 0 is torch.bfloat16.*"
                                               "fp32_optimizer_states=False"):
        run(net, opt, steps=1)
    assert not opt.state
    mine, ref = model(dtype=torch.bfloat16), model(dtype=torch.bfloat16)
    opt = DeepSpeedCPUAdam(mine.parameters(), fp32_optimizer_states=False, weight_decay=0.1)
    run(mine, opt, steps=3)
    fused = opt.param_groups[0]["fused"]
    run(ref, torch.optim.AdamW(ref.parameters(), weight_decay=0.1, fused=fused), steps=3)
    assert same(mine, ref)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt.state.values())


def test_deepspeed_import_paths() -> None:
    """``import dsrun as deepspeed`` then DeepSpeed's import lines."""
    saved = {n: sys.modules.pop(n) for n in list(sys.modules)
             if n == "deepspeed" or n.startswith("deepspeed.")}
    try:
        deepspeed = importlib.import_module("deepspeed")
        from deepspeed.ops.adam import DeepSpeedCPUAdam as DsCpuAdam  # type: ignore
        from deepspeed.ops.adam import FusedAdam as DsFusedAdam  # type: ignore

        assert (DsCpuAdam, DsFusedAdam) == (DeepSpeedCPUAdam, FusedAdam)
        assert deepspeed.ops.adam is adam and sorted(adam.__all__) == ["DeepSpeedCPUAdam",
                                                                       "FusedAdam"]
        # DeepSpeed's submodules, imported and as attributes: the same classes
        from deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam as SubCpuAdam  # type: ignore
        from deepspeed.ops.adam.fused_adam import FusedAdam as SubFusedAdam  # type: ignore

        assert (SubCpuAdam, SubFusedAdam) == (DeepSpeedCPUAdam, FusedAdam)
        assert deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam is DeepSpeedCPUAdam
        assert deepspeed.ops.adam.fused_adam.FusedAdam is FusedAdam
    finally:
        for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
            del sys.modules[name]
        sys.modules.update(saved)
    assert dsrun.__getattr__("ops") is ops  # attribute access: dsrun._SUBMODULES
