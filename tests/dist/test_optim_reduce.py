"""How the engine reduces gradients and which optimizers it lets ZeRO shard.

* ``communication_data_type`` reaches the ZeRO optimizers: on 2 ranks an
  fp32 model trained with ``"bf16"`` at stages 1-3 ends bitwise where
  stage 0 ends (DeepSpeed 0.19.8 gives stage 0's numbers at stage 2 too),
  and elsewhere than without the key.
* ``nn.Embedding(sparse=True)`` trains at stage 0 (world sizes 1 and 2),
  its gradient handed back sparse; ZeRO stages refuse it at initialize().
* ``zero_allow_untested_optimizer``: a class not known to be elementwise
  is refused at ZeRO stages unless the config sets it.

The 2-rank cases run in one job (workers/optim_reduce_cases.py); the
rest in a one-rank group (``solo``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import dsrun
from dsrun.errors import DsrunConfigError
from dsrun.runtime.optimizers import Lamb
from tests.conftest import ROOT, rank_results

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "optim_reduce_cases.py"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("optim_reduce")
    return rank_results(WORKER, out, 2, timeout=240)


def _case(ranks: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for rank in ranks:
        assert rank[name]["ok"], rank[name].get("error")
    return ranks[0][name]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_reduce_in_the_communication_dtype(two_ranks: list[dict[str, Any]],
                                                       stage: int) -> None:
    case = _case(two_ranks, "comm_dtype")
    assert case[f"bf16-s{stage}"] == case["bf16-s0"]  # bitwise, as DeepSpeed
    assert case[f"default-s{stage}"] == case["default-s0"]
    assert case[f"bf16-s{stage}-dtype"] == "torch.bfloat16"
    assert case[f"default-s{stage}-dtype"] == "torch.float32"
    assert case["bf16-s0"] != case["default-s0"]  # the dtype makes a difference here


def test_sparse_embedding_at_stage0_on_two_ranks(two_ranks: list[dict[str, Any]]) -> None:
    case = _case(two_ranks, "sparse")
    assert case["layouts-True"] == ["torch.sparse_coo"] * 4
    assert case["layouts-False"] == ["torch.strided"] * 4
    # the mean over ranks, as the dense model's (rows added in another order)
    assert case["sgd_max_diff"] < 1e-6
    assert case["sparse_adam_max_diff"] < 1e-6
    assert two_ranks[0]["sparse"]["sgd_weights"] == two_ranks[1]["sparse"]["sgd_weights"]
    # F.embedding(sparse=True) on a plain parameter: densified into its bucket
    functional = case["functional"]
    assert functional["layouts-True"] == functional["layouts-False"] == ["torch.strided"] * 4
    assert functional["sgd_max_diff"] < 1e-6


# ------------------------------------------------------------ world size 1


def _embedding_engine(sparse: bool = True, **config: Any) -> tuple[Any, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4, sparse=sparse), torch.nn.Flatten(),
                                torch.nn.Linear(8, 1))
    engine, *_ = dsrun.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **config})
    return engine, model


def test_sparse_embedding_trains_at_world_size_1(solo: None) -> None:
    """Was: the first step's memory report asked a sparse gradient for its
    storage (NotImplementedError)."""
    models = {}
    for sparse in (True, False):
        engine, model = _embedding_engine(sparse)
        gen = torch.Generator().manual_seed(3)
        for _ in range(4):
            ids = torch.randint(0, 5, (2, 2), generator=gen)  # repeated rows
            engine.backward(engine(ids).square().mean())
            grad = model[0].weight.grad
            assert grad.is_sparse == sparse
            engine.step()
        if sparse:  # coalesced, as DeepSpeed hands it to the optimizer
            assert grad.is_coalesced()
        models[sparse] = model
        engine.destroy()
    for a, b in zip(models[True].parameters(), models[False].parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_refuse_sparse_embeddings(solo: None, stage: int) -> None:
    with pytest.raises(DsrunConfigError, match=r"parameter '0.weight' gets sparse gradients.*"
                                               rf"ZeRO stage {stage}"):
        _embedding_engine(zero_optimization={"stage": stage})


@pytest.mark.parametrize(("config", "why"), [
    ({"bf16": {"enabled": True}}, "the bf16 step"),
    ({"fp16": {"enabled": True}}, "the fp16 step"),
])
def test_stage0_refuses_sparse_gradients_in_16_bits(solo: None, config: dict[str, Any],
                                                    why: str) -> None:
    with pytest.raises(DsrunConfigError, match=f"'0.weight' gets sparse gradients.*{why}"):
        _embedding_engine(**config)


def test_sparse_embedding_clipped_as_its_dense_twin(solo: None) -> None:
    """gradient_clipping (DeepSpeed's default 1.0) over a sparse embedding
    gradient: the norm of its coalesced values, and the sparse gradient is
    scaled as the dense one is (weights equal to a dense twin's)."""
    models, norms = {}, {}
    for sparse in (True, False):
        engine, model = _embedding_engine(sparse, gradient_clipping=0.01)
        gen = torch.Generator().manual_seed(3)
        norms[sparse] = []
        for _ in range(3):
            engine.backward(engine(torch.randint(0, 5, (2, 2), generator=gen)).square().mean())
            engine.step()
            norms[sparse].append(engine.get_global_grad_norm())
        models[sparse] = model
        engine.destroy()
    assert norms[True] == pytest.approx(norms[False], rel=1e-6) and norms[True][0] > 0.01
    for a, b in zip(models[True].parameters(), models[False].parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("stage", "extra", "dtype"), [
    (1, {"communication_data_type": "bf16"}, torch.bfloat16),
    (3, {"communication_data_type": "bf16"}, torch.bfloat16),
    (2, {"communication_data_type": "fp32", "fp16": {"enabled": True}}, torch.float32),
    (2, {"fp16": {"enabled": True}}, torch.float16),
])
def test_zero_optimizer_takes_the_communication_dtype(solo: None, stage: int,
                                                      extra: dict[str, Any],
                                                      dtype: torch.dtype) -> None:
    """Was: the ZeRO optimizers reduced in the model's dtype whatever the key said."""
    engine, _ = _embedding_engine(False, zero_optimization={"stage": stage}, **extra)
    assert engine.optimizer.comm_dtype == dtype
    engine.destroy()


class NormalisedSGD(torch.optim.Optimizer):
    """``p -= lr * g / |g|`` per tensor: not elementwise."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad / (p.grad.norm() + 1e-12), alpha=group["lr"])


class MyAdam(torch.optim.Adam):
    pass


def _client_engine(optimizer_cls: type, **config: Any) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    engine, *_ = dsrun.initialize(model=model, optimizer=optimizer_cls(model.parameters()),
                                  config={"train_micro_batch_size_per_gpu": 2,
                                          "zero_optimization": {"stage": 2}, **config})
    return engine


@pytest.mark.parametrize("cls", [NormalisedSGD, MyAdam])
def test_untested_optimizer_needs_the_flag(solo: None, cls: type) -> None:
    """Was: any client class was sharded as if elementwise, silently."""
    with pytest.raises(DsrunConfigError, match=rf"{cls.__qualname__} is an untested ZeRO "
                                               r"optimizer: add \"zero_allow_untested_optimizer"
                                               r"\": true.*elementwise"):
        _client_engine(cls)


def test_untested_optimizer_with_the_flag_warns_and_trains(
        solo: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        engine = _client_engine(NormalisedSGD, zero_allow_untested_optimizer=True)
    assert "untested optimizer" in caplog.text and "NormalisedSGD" in caplog.text
    engine.backward(engine(torch.ones(2, 4)).square().mean())
    engine.step()
    engine.destroy()


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad])
def test_known_elementwise_optimizers_need_no_flag(solo: None, cls: type) -> None:
    _client_engine(lambda params: cls(params, lr=0.1)).destroy()


def test_unshardable_optimizer_is_refused_even_with_the_flag(solo: None) -> None:
    with pytest.raises(DsrunConfigError, match="needs whole-tensor quantities"):
        _client_engine(Lamb, zero_allow_untested_optimizer=True)
