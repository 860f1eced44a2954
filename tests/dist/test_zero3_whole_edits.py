"""Writes to the full data of ZeRO-3 parameters kept whole follow one rule
at every world size (dsrun/runtime/zero/whole_edits.py): the same worker
(workers/zero3_whole_edits.py) runs as a 1-rank and as a 2-rank dsrun job,
and every case must give the same numbers in both, and the rule's:

* a write after zero.Init partitioned the parameter, before initialize(),
  is its value (a Linear whose bias is zeroed after it was built);
* a write outside every context after initialize() is kept where the
  shard is the optimizer's master (fp32, bf16; offload_param) and
  overwritten by the next step where the master is a separate fp32 copy
  (fp16, offload_optimizer), as at ZeRO stage 0;
* a write inside ``GatheredParameters`` without ``modifier_rank`` is
  dropped on exit; in nested contexts an edit is kept when either one has
  ``modifier_rank`` (the inner one without leaves it to the outer one, the
  inner one with publishes); a step taken inside such a context is kept;
* a value set through ``safe_set_local_fp32_param`` or (inside a context
  without ``modifier_rank``) ``safe_set_full_fp32_param`` survives the
  next step;
* a transformer with ``nn.MultiheadAttention`` (which zeroes
  ``out_proj.bias`` after building ``out_proj``) trains under zero.Init on
  2 ranks exactly as built without it, and as at stage 0.

Before this rule, a world-size-2 run reverted the first and second kinds of
write at its first step while a world-size-1 run kept them, and the
MultiheadAttention model under zero.Init diverged from step 1.

Also: ``zero.Init`` with a 16-bit dtype gives the tensors the constructors
made that a module holds as plain attributes that dtype (as DeepSpeed);
other tensors made in the block stay as made (the README says why).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dsrun
from dsrun.errors import DsrunError
from tests.conftest import ROOT, rank_results

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "zero3_whole_edits.py"
TOLERANCE = 1e-6  # one Adam step with lr 0.1 on a flat shard vs a flat buffer
SHARD_IS_MASTER = {"fp32-none", "fp32-param", "bf16-none", "bf16-param"}
SECTIONS = ("init", "outside", "dropped", "setters", "nested", "step_inside",
            "replaced_trains")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    """The worker at world size 1 and 2: {world: per-rank results}."""
    return {world: rank_results(WORKER, tmp_path_factory.mktemp(f"whole{world}"), world,
                                timeout=240, env={"OMP_NUM_THREADS": "1"})
            for world in (1, 2)}


def _close(a: Any, b: Any, where: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _close(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{where}[{i}]")
    else:
        assert abs(a - b) <= TOLERANCE, f"{where}: {a} against {b}"


def test_every_case_gives_the_same_numbers_at_world_size_1_and_2(
        jobs: dict[int, list[dict[str, Any]]]) -> None:
    alone = jobs[1][0]
    for rank, result in enumerate(jobs[2]):
        for section in SECTIONS:
            _close(alone[section], result[section], f"world 2 rank {rank}: {section}")


def test_a_write_before_initialize_is_the_parameters_value(
        jobs: dict[int, list[dict[str, Any]]]) -> None:
    for world, results in jobs.items():
        for result in results:
            for key, case in result["init"].items():
                assert case["master"] == [0.0] * 4, (world, key, case)
                assert case["after"] == [0.0] * 4, (world, key, case)


def test_a_write_outside_contexts_counts_where_the_shard_is_the_master(
        jobs: dict[int, list[dict[str, Any]]]) -> None:
    for world, results in jobs.items():
        for result in results:
            for key, case in result["outside"].items():
                expected = [1.0] * 4 if key in SHARD_IS_MASTER else case["original"]
                assert case["after"] == expected, (world, key, case)
                assert case["master"] == expected, (world, key, case)


def test_a_context_without_modifier_rank_drops_the_write(
        jobs: dict[int, list[dict[str, Any]]]) -> None:
    for world, results in jobs.items():
        for result in results:
            for key, case in result["dropped"].items():
                assert case["inside"] == [1.0] * 4, (world, key)
                assert case["on_exit"] == case["original"], (world, key, case)
                assert case["after"] == case["original"], (world, key, case)


def test_a_value_set_through_the_setters_survives_the_next_step(
        jobs: dict[int, list[dict[str, Any]]]) -> None:
    """The setters write the master and the shard; a parameter kept whole
    has its full data set too, so the step's taking of edits to whole
    parameters does not copy the old data back over them."""
    for world, results in jobs.items():
        for result in results:
            for key, case in result["setters"].items():
                assert case["local"] == {"after": [7.0] * 4, "master": [7.0] * 4}, \
                    (world, key, case)
                assert case["full_in_context"] == {"after": [5.0] * 4,
                                                   "master": [5.0] * 4}, (world, key, case)


def test_nested_contexts_keep_an_edit_either_one_publishes_and_a_step_inside_one(
        jobs: dict[int, list[dict[str, Any]]]) -> None:
    for world, results in jobs.items():
        for result in results:
            for key, case in result["nested"].items():
                assert case["on_exit"] == case["after"] == case["master"] == [1.0] * 4, \
                    (world, key, case)
            case = result["step_inside"]
            assert case["after"] == case["master"] != case["original"], (world, case)


def test_edits_are_taken_after_a_context_and_after_the_data_is_replaced(
        jobs: dict[int, list[dict[str, Any]]]) -> None:
    """The step plans its copies of edits once and plans them again when a
    context pins or unpins a parameter, or a parameter's data is replaced
    (``param.data = ...``): an edit is never copied from stale data. At
    world size 1, where the data is a view of the shard, a replaced tensor
    is copied into the shard and the data made a view of it again (so a
    non-contiguous replacement becomes contiguous there; the values are
    the same)."""
    for world, results in jobs.items():
        for result in results:
            case = result["replanned"]
            assert case["unpinned"] == {"after": [3.0] * 4, "master": [3.0] * 4}, (world, case)
            for key, value in (("replaced", 2.0), ("edited", 4.0)):
                assert case[key] == {"after": [value] * 4, "master": [value] * 4}, \
                    (world, key, case)
            strided = [float(v) for v in range(16)]
            strided = [strided[4 * c + r] for r in range(4) for c in range(4)]  # .t()
            for key, factor in (("strided", 1.0), ("strided_edited", 2.0)):
                want = [v * factor for v in strided]
                assert case[key] == {"contiguous": world == 1, "after": want, "master": want}, \
                    (world, key, case)


def test_replaced_data_follows_the_optimizer(
        jobs: dict[int, list[dict[str, Any]]]) -> None:
    """``param.data = new`` after initialize(): the steps update what forward
    reads, at every precision and world size (the same numbers at 1 and 2
    ranks: the first test). Before, at world size 1, the new tensor was cut
    off from the shard and kept its value while the optimizer moved on."""
    for world, results in jobs.items():
        for result in results:
            for key, case in result["replaced_trains"].items():
                assert all(v != 0.5 for v in case["after"]), (world, key, case)
                tolerance = 0.0 if key.startswith("fp32") else 1e-2  # a 16-bit copy
                for a, m in zip(case["after"], case["master"]):
                    assert abs(a - m) <= tolerance, (world, key, case)


def test_multihead_attention_under_zero_init_trains_as_without_it(
        jobs: dict[int, list[dict[str, Any]]]) -> None:
    for result in jobs[2]:
        for precision, losses in result["mha"].items():
            assert losses["init"] == losses["plain"], (precision, losses)
            _close(losses["init"], losses["stage0"], f"{precision} stage 0")


class Holder(torch.nn.Module):
    """Tensors a module keeps other than as parameters and buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.made = torch.ones(3)  # a constructor's tensor: the Init dtype
        self.doubled = torch.ones(3) * 2  # computed: as made
        self.listed = [torch.zeros(2)]  # not an attribute itself: as made
        self.counts = torch.zeros(2, dtype=torch.long)  # not floating


def test_zero_init_gives_constructor_made_attributes_its_dtype(solo: None) -> None:
    zeros = torch.zeros
    with dsrun.zero.Init(dtype=torch.bfloat16):
        holder = Holder()
        loose = torch.zeros(2)
    assert torch.zeros is zeros  # the constructors are torch's again
    assert holder.fc.weight.dtype == torch.bfloat16
    assert holder.made.dtype == torch.bfloat16 and torch.equal(holder.made.float(),
                                                               torch.ones(3))
    assert holder.doubled.dtype == torch.float32 and holder.listed[0].dtype == torch.float32
    assert holder.counts.dtype == torch.long and loose.dtype == torch.float32
    built_outside = Holder()
    dsrun.zero.Init(module=built_outside, dtype=torch.bfloat16)
    assert built_outside.made.dtype == torch.float32  # no constructor ran in a context
    with dsrun.zero.Init():  # no dtype: everything as made
        assert Holder().made.dtype == torch.float32


def _two_linears(**zero: Any) -> tuple[Any, torch.nn.Sequential]:
    """A 1-rank stage-3 engine over two ``Linear(4, 4)``; with
    ``offload_param`` and a persistence threshold of 10 the weights (16
    elements) are released between uses and the biases kept whole."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    config = {"train_micro_batch_size_per_gpu": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                    "stage3_param_persistence_threshold": 10, **zero}}
    engine, *_ = dsrun.initialize(model=model, config=config)
    return engine, model


def _untouched(params: list[torch.Tensor], ptrs: list[int]) -> None:
    """No pin, no scratch copy left, each parameter's own data (``ptrs``)."""
    for p, ptr in zip(params, ptrs):
        assert p.ds_pins == 0 and "_ds_kept" not in p.__dict__, p.ds_name
        assert p.data.data_ptr() == ptr, p.ds_name


def test_a_failed_enter_leaves_nothing_gathered_pinned_or_lent(
        solo: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from dsrun.runtime.zero import gathered
    from dsrun.runtime.zero.partitioned import ZeroParamStatus

    engine, model = _two_linears()
    weight, first, second = model[0].weight, model[0].bias, model[1].bias
    assert weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    ptrs = [first.data.data_ptr(), second.data.data_ptr()]
    lend, calls = gathered.lend_scratch, []

    def out_of_memory_at_the_second(param: torch.Tensor) -> None:
        calls.append(param)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        lend(param)

    monkeypatch.setattr(gathered, "lend_scratch", out_of_memory_at_the_second)
    with pytest.raises(RuntimeError, match="simulated"):
        with dsrun.zero.GatheredParameters([weight, first, second]):
            pass
    assert calls == [first, second]
    assert weight.ds_status is ZeroParamStatus.NOT_AVAILABLE and weight.ds_pins == 0
    _untouched([first, second], ptrs)
    monkeypatch.setattr(gathered, "lend_scratch", lend)
    with dsrun.zero.GatheredParameters([weight, first]):  # usable again
        assert weight.ds_status is ZeroParamStatus.AVAILABLE
    _untouched([first], ptrs[:1])


def test_entering_an_open_context_again_is_refused_and_the_first_entry_undone(
        solo: None) -> None:
    engine, model = _two_linears()
    bias = model[0].bias
    original, ptr = bias.detach().clone(), bias.data.data_ptr()
    context = dsrun.zero.GatheredParameters([bias])
    with context:
        with torch.no_grad():
            bias.fill_(1.0)
        with pytest.raises(DsrunError, match="is open already"):
            with context:
                pass
    _untouched([bias], [ptr])
    assert torch.equal(bias.detach(), original)  # the edit inside was dropped
    with context:  # closed: it opens again
        assert "_ds_kept" in bias.__dict__
    _untouched([bias], [ptr])


def test_a_16bit_save_reads_parameters_kept_whole_without_a_scratch_copy(
        solo: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """At world size 1 every parameter is whole: the consolidated state dict
    (Hugging Face's save) copies each to the host only, no device copy first."""
    from dsrun.runtime.zero import gathered

    engine, model = _two_linears(offload_param={"device": "none"},
                                 stage3_gather_16bit_weights_on_model_save=True)

    def refused(param: torch.Tensor) -> None:
        raise AssertionError(f"a scratch copy of {param.ds_name} for a read")

    monkeypatch.setattr(gathered, "lend_scratch", refused)
    state = engine._zero3_consolidated_16bit_state_dict()
    assert torch.equal(state["0.weight"], model[0].weight.detach())


def test_replacing_data_with_another_size_is_refused_at_the_step(solo: None) -> None:
    """World size 1 (data is a view of the shard): a tensor of another size
    cannot go into the shard; the step names the parameter and both sizes."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    engine, *_ = dsrun.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    model.bias.data = torch.zeros(5)
    engine.backward(model.weight.sum())
    with pytest.raises(DsrunError, match=r"bias.*5 elements.*has 4"):
        engine.step()
