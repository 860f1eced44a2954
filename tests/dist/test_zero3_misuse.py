"""What uses of ZeRO-3 partitioned parameters that cannot work say, on 2
gloo ranks (one dsrun job, workers/zero3_misuse.py; every parameter
partitioned):

* a module compiled before ``initialize()`` is refused there, naming
  torch.compile, stage 3's hooks and engine.compile() (before: a bare
  ``IndexError: tuple index out of range`` at the first forward); with every
  parameter kept whole stage 3 installs no hooks and it trains;
* the old ``spectral_norm`` under ``zero.Init`` is refused naming the module
  and the way out (before: a silently different model); built outside and
  partitioned by ``zero.Init(module=...)`` it computes what torch does;
* ``load_state_dict`` into the engine's module says the parameter is
  partitioned (before: "[6, 4]" against "[6, 4]"), and loads inside
  ``GatheredParameters(modifier_rank=0)``;
* ``copy.deepcopy`` of the engine's module is refused (before: parameters
  with no data); inside ``GatheredParameters`` the copy computes what the
  engine does, and its forward - the copy keeps the engine's hooks -
  gathers none of the engine's parameters (before: it gathered them all,
  collectives a copy used on one rank waited in forever);
* ``reshape`` of a released parameter says it is partitioned.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import ROOT, rank_results

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "zero3_misuse.py"
OUTSIDE = r"partitioned by ZeRO stage 3 and released on this rank, which holds only a shard"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("zero3_misuse")
    return rank_results(WORKER, out, 2, timeout=240, env={"OMP_NUM_THREADS": "1"})


def refused(result: dict[str, Any], error: str, *parts: str) -> None:
    assert result.get("error") == error, result
    assert result["dsrun"], result
    for part in parts:
        assert part in result["message"], (part, result["message"])


@pytest.mark.parametrize("case,where,how", [
    ("compiled", "the model", "torch.compile(module)"),
    ("compiled_child", "the module '2'", "torch.compile(module)"),
    ("compiled_in_place", "the model", "module.compile()")])
def test_a_module_compiled_before_initialize_is_refused(job: list[dict[str, Any]], case: str,
                                                        where: str, how: str) -> None:
    for result in job:
        refused(result[case], "CompiledModuleError", f"{where} was compiled before initialize()",
                how, "torch.compile cannot capture", "engine.compile()")


def test_a_compiled_model_kept_whole_trains(job: list[dict[str, Any]]) -> None:
    losses = [result["compiled_whole"]["ok"] for result in job]
    assert losses[0] == losses[1] and len(losses[0]) == 2, losses


def test_old_spectral_norm_under_zero_init_is_refused(job: list[dict[str, Any]]) -> None:
    for result in job:
        refused(result["spectral_norm"], "ReleasedParameterError",
                "zero.Init: SpectralNet.__init__: cannot reshape Linear.weight of shape (8, 8)",
                "Build SpectralNet outside zero.Init", "parametrizations.spectral_norm")


def test_spectral_norm_built_outside_and_partitioned_computes_as_torch(
        job: list[dict[str, Any]]) -> None:
    for result in job:
        got, want = result["spectral_norm_outside"]["ok"]
        assert got == want


def test_load_state_dict_outside_a_gather_says_partitioned(job: list[dict[str, Any]]) -> None:
    for result in job:
        outside = result["load_state_dict"]["outside"]
        assert outside["error"] == "RuntimeError", outside
        assert "cannot copy values into 0.weight of shape (6, 4)" in outside["message"]
        assert OUTSIDE in outside["message"] and "engine.load_checkpoint()" in outside["message"]
        assert "GatheredParameters(list(model.parameters()), modifier_rank=0)" \
            in outside["message"]
        assert result["load_state_dict"]["loaded"] == [0.5]


def test_deepcopy_outside_a_gather_is_refused(job: list[dict[str, Any]]) -> None:
    for result in job:
        out = result["deepcopy"]
        refused(out["outside"], "ReleasedParameterError",
                "cannot copy.deepcopy 0.weight of shape (6, 4)", OUTSIDE, "GatheredParameters")
        assert out["twin"] == out["engine"]
        assert out["gathers_by_twin"] == 0  # (collectives: a copy used on one rank hung)


def test_reshape_outside_a_gather_says_partitioned(job: list[dict[str, Any]]) -> None:
    for result in job:
        refused(result["reshape"]["outside"], "ReleasedParameterError",
                "cannot reshape 0.weight of shape (6, 4)", OUTSIDE)
        assert result["reshape"]["gathered"] == [6, 4]
