"""dsrun.runtime.sparse_grads (pure parts) and the ZeRO settings' view of
the config (``communication_data_type`` as their ``comm_dtype``)."""

from __future__ import annotations

import pytest
import torch

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config_sections import ZeroConfig
from dsrun.runtime.sparse_grads import (
    clip_grad_norm_,
    grad_norm,
    refuse_at_zero,
    sparse_grad_params,
)
from dsrun.runtime.zero.groups import (
    Stage3Settings,
    ZeroSettings,
    check_tested_optimizer,
    elementwise_optimizers,
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(6, 3, sparse=True),
                               torch.nn.EmbeddingBag(6, 3, sparse=True),
                               torch.nn.Embedding(6, 3), torch.nn.Linear(3, 1))


def test_sparse_grad_params_are_the_sparse_embeddings_weights() -> None:
    assert [name for name, _ in sparse_grad_params(_model())] == ["0.weight", "1.weight"]


def test_refuse_at_zero_names_the_first_trainable_one() -> None:
    model = _model()
    model[0].requires_grad_(False)
    with pytest.raises(DsrunConfigError, match=r"parameter '1.weight' gets sparse gradients.*"
                                               r"ZeRO stage 2 \(cfg\)"):
        refuse_at_zero(model, 2, "cfg")
    model[1].requires_grad_(False)
    refuse_at_zero(model, 2, "cfg")  # frozen ones get no gradient


def _grads(sparse: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    emb, lin = torch.nn.Embedding(8, 3, sparse=sparse), torch.nn.Linear(3, 2)
    lin(emb(torch.tensor([1, 1, 4, 6]))).square().sum().backward()
    return [emb.weight, lin.weight, lin.bias]


def test_norm_and_clipping_of_sparse_gradients_equal_the_dense_ones() -> None:
    sparse, dense = _grads(True), _grads(False)
    assert sparse[0].grad.is_sparse and not sparse[0].grad.is_coalesced()  # row 1 twice
    torch.testing.assert_close(grad_norm([p.grad for p in sparse]),
                               grad_norm([p.grad for p in dense]))
    total = clip_grad_norm_(sparse, 0.5)
    expected = torch.nn.utils.clip_grad_norm_(dense, 0.5)
    torch.testing.assert_close(total, expected)
    assert sparse[0].grad.is_sparse
    for a, b in zip(sparse, dense):
        torch.testing.assert_close(a.grad.to_dense(), b.grad, rtol=1e-6, atol=1e-7)


def test_clipping_dense_gradients_is_torchs_call() -> None:
    ours, theirs = _grads(False), _grads(False)
    assert torch.equal(clip_grad_norm_(ours, 0.1), torch.nn.utils.clip_grad_norm_(theirs, 0.1))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs))


def test_settings_take_the_communication_dtype_beside_the_section() -> None:
    zero = ZeroConfig(stage=2, reduce_bucket_size=1000)
    for cls in (ZeroSettings, Stage3Settings):
        settings = cls.from_config(zero, comm_dtype=torch.bfloat16)
        assert settings.comm_dtype == torch.bfloat16 and settings.reduce_bucket_size == 1000
        assert cls.from_config(zero).comm_dtype is None  # the parameters' dtype


def test_elementwise_list_holds_deepspeeds_and_refuses_others() -> None:
    from dsrun.ops.adam import DeepSpeedCPUAdam, FusedAdam

    known = elementwise_optimizers()
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, FusedAdam,
                DeepSpeedCPUAdam, torch.optim.SGD):
        assert cls in known
        check_tested_optimizer(cls, 2, False, "cfg")
    with pytest.raises(DsrunConfigError, match="untested ZeRO optimizer"):
        check_tested_optimizer(type("Custom", (torch.optim.Optimizer,), {}), 1, False, "cfg")
    with pytest.raises(DsrunConfigError, match="needs whole-tensor quantities"):
        check_tested_optimizer(torch.optim.Adafactor, 3, True, "cfg")
