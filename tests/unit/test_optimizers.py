"""Optimizers from config: DeepSpeed's Adam/AdamW semantics, names, Lamb."""

from __future__ import annotations

import inspect
import math
from typing import Any

import pytest
import torch

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config import AUTO_OPTIMIZER_DEFAULTS, OPTIMIZER_NAMES, OptimizerConfig, resolve
from dsrun.runtime.optimizers import (
    OPTIMIZER_CLASSES,
    Lamb,
    Lion,
    build_optimizer,
    optimizer_class_and_kwargs,
)


def param(values: list[float]) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor(values, dtype=torch.float64))


def one_step(optimizer_of: Any, grad: list[float], start: list[float]) -> torch.Tensor:
    p = param(start)
    opt = optimizer_of([p])
    p.grad = torch.tensor(grad, dtype=torch.float64)
    opt.step()
    return p.detach().clone()


# ----------------------------------------------------------- Adam vs AdamW


@pytest.mark.parametrize(("kind", "params", "cls", "weight_decay"), [
    ("Adam", {}, torch.optim.AdamW, 0.0),  # adam_w_mode defaults to true
    ("Adam", {"weight_decay": 0.1}, torch.optim.AdamW, 0.1),
    ("Adam", {"adam_w_mode": False, "weight_decay": 0.1}, torch.optim.Adam, 0.1),
    ("Adam", {"adam_w_mode": True}, torch.optim.AdamW, 0.0),
    ("AdamW", {"adam_w_mode": False}, torch.optim.AdamW, 0.0),  # AdamW is always AdamW
    ("AdamW", {}, torch.optim.AdamW, 0.0),  # FusedAdam's default, not torch's 0.01
    ("AdamW", {"torch_adam": True}, torch.optim.AdamW, 0.01),  # torch's default
    ("adam", {"torch_adam": True, "adam_w_mode": False}, torch.optim.Adam, 0.0),
])
def test_adam_semantics(kind: str, params: dict, cls: type, weight_decay: float) -> None:
    opt = build_optimizer(OptimizerConfig(kind, params), [param([1.0])])
    assert type(opt) is cls
    assert opt.defaults["weight_decay"] == weight_decay


def test_adam_with_weight_decay_is_decoupled_by_default() -> None:
    start, grad, hp = [1.0, -2.0], [0.3, 0.1], {"lr": 0.1, "weight_decay": 0.5}
    ds_adam = one_step(lambda p: build_optimizer(OptimizerConfig("Adam", hp), p), grad, start)
    adamw = one_step(lambda p: torch.optim.AdamW(p, **hp), grad, start)
    l2_adam = one_step(lambda p: torch.optim.Adam(p, **hp), grad, start)
    assert torch.equal(ds_adam, adamw)
    assert not torch.allclose(ds_adam, l2_adam)
    # first AdamW step by hand: w * (1 - lr * wd) - lr * g / (|g| + eps)
    by_hand = [w * (1 - 0.1 * 0.5) - 0.1 * g / (abs(g) + 1e-8) for w, g in zip(start, grad)]
    assert ds_adam.tolist() == pytest.approx(by_hand, rel=1e-12)
    l2 = one_step(lambda p: build_optimizer(
        OptimizerConfig("Adam", {**hp, "adam_w_mode": False}), p), grad, start)
    assert torch.equal(l2, l2_adam)


@pytest.mark.parametrize("name", ["adam", "ADAM", "AdamW", "adamw", "Lamb", "sgd", "SGD",
                                  "Adagrad", "rmsprop", "Adamax", "NAdam", "radam", "adadelta"])
def test_type_names_are_case_insensitive(name: str) -> None:
    opt = build_optimizer(OptimizerConfig(name), [param([1.0])])
    expected = OPTIMIZER_CLASSES[name.lower()]
    assert isinstance(opt, expected)


# ------------------------------------------------------------ param names


@pytest.mark.parametrize(("kind", "params", "fragment"), [
    ("adam", {"lrr": 0.1}, 'unknown parameter "lrr" in optimizer.params for Adam'),
    ("adam", {"lrr": 0.1}, 'did you mean "lr"?'),
    ("adam", {"weight_decy": 0.1}, "valid: lr, betas, eps, weight_decay"),
    ("adamw", {"decoupled_weight_decay": True}, 'unknown parameter "decoupled_weight_decay"'),
    ("sgd", {"betas": (0.9, 0.99)}, "valid: lr, momentum"),
    ("lamb", {"max_coef": 5.0}, 'did you mean "max_coeff"?'),
    ("adam", {"bias_correction": False}, "always correct bias"),
    ("adam", {"adam_w_mode": "yes"}, '"adam_w_mode" must be true or false'),
    ("adamw", {"fp32_optimizer_states": 1}, '"fp32_optimizer_states" must be true or false'),
    ("adam", {"lr": -1.0}, "rejected params"),
    ("lamb", {"amsgrad": True}, "amsgrad"),
])
def test_bad_params(kind: str, params: dict, fragment: str) -> None:
    with pytest.raises(DsrunConfigError) as err:
        build_optimizer(OptimizerConfig(kind, params), [param([1.0])])
    assert fragment in str(err.value)


def test_deepspeed_only_adam_params_are_listed_as_valid() -> None:
    with pytest.raises(DsrunConfigError, match="adam_w_mode, torch_adam, bias_correction"):
        build_optimizer(OptimizerConfig("adam", {"nope": 1}), [param([1.0])])
    cls, kwargs = optimizer_class_and_kwargs(OptimizerConfig("adam", {
        "bias_correction": True, "lr": 0.2, "betas": [0.8, 0.9]}))
    assert cls is torch.optim.AdamW and kwargs == {"lr": 0.2, "betas": (0.8, 0.9),
                                                   "weight_decay": 0.0}


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("states", [True, False])
def test_cpu_adams_fp32_optimizer_states_is_accepted(kind: str, states: bool) -> None:
    """DeepSpeed pops it for DeepSpeedCPUAdam; its moments follow the fp32
    masters either way, as dsrun's do (fp32 state from fp32 parameters)."""
    config = OptimizerConfig(kind, {"lr": 0.01, "fp32_optimizer_states": states})
    cls, kwargs = optimizer_class_and_kwargs(config)
    assert cls is torch.optim.AdamW and kwargs == {"lr": 0.01, "weight_decay": 0.0}
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))  # fp32, as ZeRO's masters
    opt = build_optimizer(config, [p])
    p.grad = torch.ones(2)
    opt.step()
    assert {t.dtype for t in opt.state[p].values() if t.dim()} == {torch.float32}


def test_auto_defaults_match_torch_and_deepspeed() -> None:
    """"auto" fills what the optimizer would default to (weight_decay: FusedAdam's 0)."""
    assert set(OPTIMIZER_CLASSES) == set(OPTIMIZER_NAMES) == set(AUTO_OPTIMIZER_DEFAULTS)
    for kind, defaults in AUTO_OPTIMIZER_DEFAULTS.items():
        signature = inspect.signature(OPTIMIZER_CLASSES[kind].__init__).parameters
        for key, value in defaults.items():
            if kind in ("adam", "adamw") and key == "weight_decay":
                assert value == 0.0
                continue
            assert signature[key].default == value, (kind, key)


def test_every_type_builds_from_an_all_auto_config() -> None:
    for kind, defaults in AUTO_OPTIMIZER_DEFAULTS.items():
        config = resolve({"train_batch_size": 1, "optimizer": {
            "type": kind, "params": {key: "auto" for key in defaults}}},
            dp_size=1, dp_source="test", environ={})
        assert config.optimizer is not None
        opt = build_optimizer(config.optimizer, [param([1.0])])
        assert opt.defaults["lr"] == defaults["lr"]


def test_param_groups_are_passed_through() -> None:
    groups = [{"params": [param([1.0])], "lr": 0.5}, {"params": [param([2.0])]}]
    opt = build_optimizer(OptimizerConfig("sgd", {"lr": 0.1}), groups)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.1]


# -------------------------------------------------------------------- Lamb


def lamb_reference(w: list[float], grads: list[list[float]], lr: float = 1e-3,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   weight_decay: float = 0.0, bias_correction: bool = True,
                   eps_inside_sqrt: bool = False, max_coeff: float = 10.0,
                   min_coeff: float = 0.01) -> list[float]:
    """LAMB in plain Python floats, written from DeepSpeed's FusedLamb kernel
    (fused_lamb_cuda_kernel.cu): the update from the uncorrected moments, the
    bias correction in the step size."""
    m, v = [0.0] * len(w), [0.0] * len(w)
    for step, g in enumerate(grads, start=1):
        b1, b2 = betas
        m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
        v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
        step_size = lr * math.sqrt(1 - b2**step) / (1 - b1**step) if bias_correction else lr
        update = []
        for mi, vi, wi in zip(m, v, w):
            denom = math.sqrt(vi + eps) if eps_inside_sqrt else math.sqrt(vi) + eps
            update.append(mi / denom + weight_decay * wi)
        w_norm = math.sqrt(sum(x * x for x in w))
        u_norm = math.sqrt(sum(x * x for x in update))
        trust = 1.0
        if w_norm and u_norm:
            trust = min(max(w_norm / u_norm, min_coeff), max_coeff)
        w = [wi - step_size * trust * ui for wi, ui in zip(w, update)]
    return w


def run_lamb(w: list[float], grads: list[list[float]], **hp: Any) -> tuple[list[float], Lamb]:
    p = param(w)
    opt = Lamb([p], **hp)
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    return p.detach().tolist(), opt


def test_lamb_first_step_by_hand() -> None:
    # m = 0.1 g, v = 0.001 g^2: update = [u, u] with u = 0.05 / (sqrt(0.00025) + eps);
    # trust = ||w|| / ||update|| = sqrt(5) / (sqrt(2) u), and the step size
    # lr sqrt(1 - 0.999) / (1 - 0.9): each weight moves lr sqrt(0.001) / 0.1 sqrt(2.5)
    got, opt = run_lamb([1.0, -2.0], [[0.5, 0.5]], lr=0.1)
    step = 0.1 * math.sqrt(0.001) / 0.1 * math.sqrt(2.5)
    assert got == pytest.approx([1.0 - step, -2.0 - step], rel=1e-10)
    u = 0.05 / (math.sqrt(0.00025) + 1e-8)
    assert opt.get_lamb_coeffs() == pytest.approx([math.sqrt(2.5) / u], rel=1e-7)


def test_lamb_weight_decay_by_hand() -> None:
    # w = [3, 4] (norm 5); m / sqrt(v) = 0.05 / sqrt(0.00025) = sqrt(10) per element
    got, _ = run_lamb([3.0, 4.0], [[0.5, 0.5]], lr=0.01, weight_decay=0.1, eps=0.0)
    update = [math.sqrt(10) + 0.3, math.sqrt(10) + 0.4]
    trust = 5.0 / math.hypot(*update)
    step_size = 0.01 * math.sqrt(0.001) / 0.1
    assert got == pytest.approx([3.0 - step_size * trust * update[0],
                                 4.0 - step_size * trust * update[1]], rel=1e-10)


@pytest.mark.parametrize(("w", "trust"), [
    ([300.0, 400.0], 10.0),  # 500 / sqrt(2) clipped to max_coeff
    ([1e-4, 0.0], 0.01),  # 1e-4 / sqrt(2) clipped to min_coeff
    ([0.0, 0.0], 1.0),  # zero weights: no trust ratio
])
def test_lamb_trust_ratio_is_clipped(w: list[float], trust: float) -> None:
    got, opt = run_lamb(w, [[0.5, -0.5]], lr=0.1, eps=0.0)
    assert opt.get_lamb_coeffs() == pytest.approx([trust])
    assert got == pytest.approx([w[0] - 0.1 * trust, w[1] + 0.1 * trust])


@pytest.mark.parametrize("hp", [
    {},
    {"lr": 0.05, "weight_decay": 0.01},
    {"bias_correction": False, "lr": 0.02},
    {"eps_inside_sqrt": True, "eps": 1e-3},
    {"betas": (0.8, 0.9), "max_coeff": 2.0, "min_coeff": 0.5},
])
def test_lamb_several_steps_match_the_reference(hp: dict) -> None:
    grads = [[0.5, -0.25, 0.125], [0.1, 0.2, -0.3], [-0.4, 0.05, 0.0], [1.0, 1.0, 1.0]]
    got, _ = run_lamb([0.5, -1.5, 2.0], grads, **hp)
    assert got == pytest.approx(lamb_reference([0.5, -1.5, 2.0], grads, **hp), rel=1e-10)


def test_lamb_state_round_trip_and_skips_params_without_grad() -> None:
    p, frozen = param([1.0, 2.0]), param([3.0])
    opt = Lamb([p, frozen], lr=0.1)
    p.grad = torch.tensor([0.1, 0.2], dtype=torch.float64)
    opt.step()
    assert frozen.tolist() == [3.0] and len(opt.get_lamb_coeffs()) == 1
    clone = Lamb([param(p.tolist()), param([3.0])], lr=0.1)
    clone.load_state_dict(opt.state_dict())
    assert clone.state_dict()["state"][0]["step"] == 1


@pytest.mark.parametrize("bad", [{"lr": -1.0}, {"betas": (1.0, 0.9)}, {"eps": -1.0},
                                 {"min_coeff": 2.0, "max_coeff": 1.0}])
def test_lamb_rejects_bad_hyperparameters(bad: dict) -> None:
    with pytest.raises(DsrunConfigError, match="Lamb: invalid"):
        Lamb([param([1.0])], **bad)


def test_lamb_from_config() -> None:
    opt = build_optimizer(OptimizerConfig("LAMB", {"lr": 0.1, "weight_decay": 0.01,
                                                   "bias_correction": True}), [param([1.0])])
    assert isinstance(opt, Lamb) and opt.defaults["weight_decay"] == 0.01


# -------------------------------------------------------------------- Lion


def lion_reference(w: list[float], grads: list[list[float]], lr: float = 1e-3,
                   betas: tuple[float, float] = (0.9, 0.999),
                   weight_decay: float = 0.0) -> list[float]:
    """Lion in plain Python floats, as DeepSpeed's kernels step it (sign(0) = 0)."""
    m = [0.0] * len(w)
    b1, b2 = betas
    for g in grads:
        c = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
        w = [wi * (1 - lr * weight_decay) - lr * ((ci > 0) - (ci < 0)) for wi, ci in zip(w, c)]
        m = [b2 * mi + (1 - b2) * gi for mi, gi in zip(m, g)]
    return w


@pytest.mark.parametrize("hp", [{}, {"lr": 0.05, "weight_decay": 0.1},
                                {"betas": (0.5, 0.6), "lr": 0.01}])
def test_lion_matches_the_reference(hp: dict) -> None:
    grads = [[0.5, -0.25, 0.0], [0.1, 0.2, 0.0], [-0.4, 0.05, 0.0], [-1.0, -1.0, 0.0]]
    p = param([0.5, -1.5, 2.0])
    opt = Lion([p], **hp)
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    assert p.tolist() == pytest.approx(lion_reference([0.5, -1.5, 2.0], grads, **hp), rel=1e-12)
    # the third weight saw only zero gradients: it decays, never moves by lr
    assert p.tolist()[2] == pytest.approx(2.0 * (1 - hp.get("lr", 1e-3)
                                                 * hp.get("weight_decay", 0.0)) ** 4)


def test_lion_from_config_and_deepspeeds_classes() -> None:
    from dsrun.ops.lion import DeepSpeedCPULion, FusedLion

    opt = build_optimizer(OptimizerConfig("lion", {"lr": 0.01, "betas": [0.9, 0.99]}),
                          [param([1.0])])
    assert type(opt) is Lion and opt.defaults["betas"] == (0.9, 0.99)
    with pytest.raises(DsrunConfigError, match='unknown parameter "eps"'):
        build_optimizer(OptimizerConfig("lion", {"eps": 1e-8}), [param([1.0])])
    half = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    half.grad = torch.full((3,), 0.5, dtype=torch.float16)
    cpu = DeepSpeedCPULion([half], lr=0.125)
    cpu.step()
    assert cpu.state[half]["exp_avg"].dtype == torch.float32  # fp32_optimizer_states
    assert half.tolist() == [0.875] * 3
    fused = FusedLion([half], lr=0.125)
    fused.step()
    assert fused.state[half]["exp_avg"].dtype == torch.float16
    with pytest.raises(DsrunConfigError, match="Lion: invalid"):
        Lion([param([1.0])], betas=(1.0, 0.9))


def test_deepspeed_lamb_and_adagrad_classes_match_the_config_optimizers() -> None:
    """``deepspeed.ops.lamb.FusedLamb`` and ``deepspeed.ops.adagrad.
    DeepSpeedCPUAdagrad`` take DeepSpeed's arguments and step exactly as
    the config's "Lamb" and "Adagrad" do."""
    import deepspeed.ops.adagrad
    import deepspeed.ops.lamb

    from dsrun.ops.adagrad import DeepSpeedCPUAdagrad
    from dsrun.ops.lamb import FusedLamb

    assert deepspeed.ops.lamb.FusedLamb is FusedLamb
    assert deepspeed.ops.adagrad.DeepSpeedCPUAdagrad is DeepSpeedCPUAdagrad
    grads = [[0.3, -0.2, 0.1], [-0.1, 0.4, 0.2], [0.05, 0.0, -0.3]]
    cases = [(FusedLamb, {"lr": 0.01, "weight_decay": 0.1, "max_grad_norm": 0.0},
              OptimizerConfig("lamb", {"lr": 0.01, "weight_decay": 0.1})),
             (DeepSpeedCPUAdagrad, {"lr": 0.05, "weight_decay": 0.01, "eps": 1e-10},
              OptimizerConfig("adagrad", {"lr": 0.05, "weight_decay": 0.01}))]
    for cls, kwargs, config in cases:
        ours, theirs = param([0.5, -1.5, 2.0]), param([0.5, -1.5, 2.0])
        mine, reference = cls([ours], **kwargs), build_optimizer(config, [theirs])
        for g in grads:
            ours.grad = torch.tensor(g, dtype=torch.float64)
            theirs.grad = torch.tensor(g, dtype=torch.float64)
            mine.step()
            reference.step()
        assert torch.equal(ours, theirs) and not torch.equal(ours, param([0.5, -1.5, 2.0]))
    with pytest.raises(DsrunConfigError, match='clip with the config\'s "gradient_clipping"'):
        FusedLamb([param([1.0])], max_grad_norm=1.0)
    with pytest.raises(DsrunConfigError, match="amsgrad"):
        DeepSpeedCPUAdagrad([param([1.0])], amsgrad=True)
