"""Model-state memory: the ZeRO paper's formulas and the byte counter."""

from __future__ import annotations

import pytest
import torch

from dsrun.runtime.zero.memory import (
    count_bytes,
    model_state_bytes,
    paper_model_state_bytes,
    tensors_in,
    zero_model_state_bytes,
)

GB = 1e9


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_paper_figure_1_numbers(stage, expected_gb):
    """Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N = 64, K = 12, mixed precision."""
    got = paper_model_state_bytes(7_500_000_000, 64, stage) / GB
    assert got == pytest.approx(expected_gb, abs=0.05)


def test_formulas_term_by_term():
    psi, n, k = 1000, 4, 12
    assert paper_model_state_bytes(psi, n, 0) == (2 + 2 + k) * psi
    assert paper_model_state_bytes(psi, n, 1) == 4 * psi + k * psi / n
    assert paper_model_state_bytes(psi, n, 2) == 2 * psi + (2 + k) * psi / n
    assert paper_model_state_bytes(psi, n, 3) == (2 + 2 + k) * psi / n
    # fp32: the 2-byte parameters and gradients become 4 bytes.
    assert paper_model_state_bytes(psi, n, 0, precision="fp32") == (4 + 4 + k) * psi
    assert paper_model_state_bytes(psi, n, 2, precision="fp32") == 4 * psi + (4 + k) * psi / n
    assert paper_model_state_bytes(psi, n, 1, precision="fp32", k=8) == 8 * psi + 8 * psi / n


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_needs_no_less_than_plain_data_parallel(stage):
    assert zero_model_state_bytes(123, 1, stage) == zero_model_state_bytes(123, 1, 0)


def test_stages_never_grow_memory():
    values = [paper_model_state_bytes(10**6, 8, s) for s in range(4)]
    assert values == sorted(values, reverse=True)


@pytest.mark.parametrize("bad", [dict(psi=-1, world_size=1, stage=0),
                                 dict(psi=1, world_size=0, stage=0),
                                 dict(psi=1, world_size=1, stage=4)])
def test_formula_arguments_are_checked(bad):
    with pytest.raises(ValueError):
        zero_model_state_bytes(**bad)
    with pytest.raises(ValueError, match="precision"):
        paper_model_state_bytes(1, 1, 0, precision="fp8")


def test_count_bytes_dedupes_storages_first_category_wins():
    base = torch.zeros(100)  # 400 bytes
    view = base[10:20]
    other = torch.zeros(10, dtype=torch.float64)  # 80 bytes
    got = count_bytes(params=[base, view], grads=[view, other], optimizer=[other, base],
                      buffers=[torch.empty(0)])
    assert (got.params, got.grads, got.optimizer, got.buffers) == (400, 80, 0, 0)
    assert got.model_state == 480


def test_model_state_of_plain_adam_is_16_bytes_per_parameter():
    model = torch.nn.Linear(30, 20)
    psi = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 30)).sum().backward()
    opt.step()
    got = model_state_bytes(model.parameters(), opt)
    assert (got.params, got.grads) == (4 * psi, 4 * psi)
    steps = sum(s["step"].untyped_storage().nbytes() for s in opt.state.values())
    assert got.optimizer == 8 * psi + steps  # exp_avg, exp_avg_sq (+ the step counters)


def test_tensors_in_nested_state():
    a, b = torch.ones(1), torch.ones(2)
    assert list(tensors_in({"x": [a, (b, 3)], "y": "z"})) == [a, b]


def test_count_bytes_counts_a_sparse_gradient_by_its_indices_and_values():
    """Was: NotImplementedError (a sparse tensor has no storage), at the
    first step of a model with nn.Embedding(sparse=True)."""
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 1, 3])).sum().backward()
    grad = emb.weight.grad  # 3 rows uncoalesced: int64 indices (1, 3), fp32 values (3, 4)
    got = count_bytes(params=[emb.weight], grads=[grad])
    assert (got.params, got.grads) == (160, 3 * 8 + 3 * 4 * 4)
