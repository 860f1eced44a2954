"""Config optimizer types that name torch.optim classes (DeepSpeed builds
any of them by name): built as torch's own, params checked against the
signature, the ones that cannot work refused with the reason, and the
non-elementwise ones refused at the ZeRO stages."""

from __future__ import annotations

import pytest
import torch

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config import OptimizerConfig, resolve
from dsrun.runtime.optimizers import build_optimizer
from dsrun.runtime.zero.groups import _check_optimizer_cls

ADAFACTOR = getattr(torch.optim, "Adafactor", None)  # torch >= 2.5
NEEDS_ADAFACTOR = pytest.mark.skipif(ADAFACTOR is None, reason="torch without Adafactor")


def param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))


def config_optimizer(kind: str, params: dict) -> OptimizerConfig:
    config = resolve({"train_batch_size": 1, "optimizer": {"type": kind, "params": params}},
                     dp_size=1, dp_source="test", environ={})
    assert config.optimizer is not None
    return config.optimizer


@pytest.mark.parametrize(("kind", "params", "cls"), [
    ("ASGD", {"lr": 0.05, "lambd": 1e-3, "t0": 2}, torch.optim.ASGD),
    ("rprop", {"lr": 0.02, "etas": [0.4, 1.3], "step_sizes": [1e-5, 10]}, torch.optim.Rprop),
    pytest.param("Adafactor", {"lr": 0.01, "weight_decay": 0.1}, ADAFACTOR,
                 marks=NEEDS_ADAFACTOR),
])
def test_torch_types_build_torchs_own_class(kind: str, params: dict, cls: type) -> None:
    built_param, ref_param = param(), param()
    opt = build_optimizer(config_optimizer(kind, params), [built_param])
    assert type(opt) is cls
    ref = cls([ref_param], **params)
    for step in range(3):
        grad = torch.tensor([0.3, -0.1, 0.2 * step], dtype=torch.float64)
        built_param.grad, ref_param.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    assert torch.equal(built_param, ref_param)


@pytest.mark.parametrize(("kind", "params", "fragment"), [
    ("ASGD", {"lamda": 1e-3}, 'unknown parameter "lamda" in optimizer.params for ASGD '
                              '(torch.optim.asgd.ASGD); did you mean "lambd"?'),
    ("Rprop", {"weight_decay": 0.1}, "valid: lr, etas, step_sizes"),
    pytest.param("Adafactor", {"beta2": 0.9}, 'did you mean "beta2_decay"?',
                 marks=NEEDS_ADAFACTOR),
    ("Rprop", {"etas": [1.5, 1.2]}, "rejected params"),
])
def test_torch_type_param_errors(kind: str, params: dict, fragment: str) -> None:
    with pytest.raises(DsrunConfigError) as err:
        build_optimizer(config_optimizer(kind, params), [param()])
    assert fragment in str(err.value)


@pytest.mark.parametrize(("kind", "fragment"), [
    ("LBFGS", "closure"),
    ("SparseAdam", "sparse gradients"),
    ("Adafactr", 'did you mean "Adafactor"?'),
    ("asgdd", 'did you mean "ASGD"?'),
])
def test_refused_and_unknown_torch_types(kind: str, fragment: str) -> None:
    with pytest.raises(DsrunConfigError) as err:
        config_optimizer(kind, {})
    assert fragment in str(err.value) and "Rprop" in str(err.value)


def test_auto_lr_for_torch_types() -> None:
    for kind, lr in (("asgd", 1e-2), ("rprop", 1e-2), ("adafactor", 1e-2)):
        if kind == "adafactor" and ADAFACTOR is None:
            continue
        opt = build_optimizer(config_optimizer(kind, {"lr": "auto"}), [param()])
        assert opt.defaults["lr"] == lr


def test_zero_stages_take_elementwise_torch_types_only() -> None:
    for cls in (torch.optim.ASGD, torch.optim.Rprop):
        for stage in (1, 2, 3):
            _check_optimizer_cls(cls, stage)
    if ADAFACTOR is not None:
        with pytest.raises(DsrunConfigError, match="Adafactor needs whole-tensor quantities"):
            _check_optimizer_cls(ADAFACTOR, 2)


def test_torch_optimizer_list_covers_the_installed_torch() -> None:
    """Every torch.optim class is a config type or refused with a reason."""
    from dsrun.runtime.config import OPTIMIZER_NAMES, UNSUPPORTED_OPTIMIZERS

    installed = {name.lower() for name in dir(torch.optim)
                 if isinstance(getattr(torch.optim, name), type)
                 and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
                 and name != "Optimizer"}
    assert installed <= set(OPTIMIZER_NAMES) | set(UNSUPPORTED_OPTIMIZERS)
