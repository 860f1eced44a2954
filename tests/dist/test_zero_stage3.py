"""ZeRO stage 3 against torch DDP on gloo ranks, and at world size 1.

One dsrun job with 3 ranks (workers/zero_stage3.py) runs every distributed
case: parity on all 3 ranks and on a 2-rank subgroup, 20 Adam steps each,
fp32, fixed seeds and data, gradient accumulation 1 and 3, clipping on (and
off, to show bitwise parity), a frozen layer and two param groups with
different LR; then zero.Init, GatheredParameters, model-state memory and the
divergence detector on the subgroup.

Expected precision, and why:

* **bitwise** on 2 ranks with accumulation 1 and no clipping, with torch's
  single-tensor Adam on both sides (the client asks for ``foreach=False``):
  rank 0's values are broadcast, every gather reproduces them exactly, each
  rank computes the same gradients with the same kernels, both sides reduce
  ``g * (1/2)`` (exact) and ``a + b == b + a``, and Adam's elementwise
  update on a flat shard equals the per-parameter one bitwise;
* **<= 1e-6 max abs diff** (seen: <= 1e-7) otherwise:
  - the default inner Adam is torch's fused one (the DDP reference uses it
    too), whose CPU kernel rounds an element differently depending on its
    position in the tensor: ~1 ulp per step between flat shards and
    per-parameter tensors;
  - clipping: the global norm comes from all-reduced squared shard norms,
    not torch's norm of per-parameter norms, so the clip coefficient
    differs in the last bits;
  - accumulation: stage 3 reduces every micro-step,
    ``sum_micro(mean_ranks(g))``, DDP reduces the accumulated sum once,
    ``mean_ranks(sum_micro(g))``: the same sum in another order;
  - 3 ranks: ``g * (1/3)`` is rounded, and gloo's all-reduce adds three
    contributions in an order that depends on the element's position in
    the buffer, which differs from DDP's bucket layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dsrun import zero
from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.runtime.optimizers import Lamb
from dsrun.runtime.zero import (
    GuardSettings,
    Stage3Settings,
    ZeroParamStatus,
    ZeroStage3,
    paper_model_state_bytes,
)
from dsrun.runtime.zero.partitioned import full_numel_held
from tests.conftest import ROOT, rank_results
from tests.dist.world1 import small_model, train, two_groups

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "zero_stage3.py"
TOLERANCE = 1e-6
BITWISE_ON_2_RANKS = ("gas1-noclip", "gas1-noclip-subgroups")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 3-rank dsrun job for the module; every case runs inside it."""
    out = tmp_path_factory.mktemp("zero3")
    return rank_results(WORKER, out, 3, timeout=280, env={"OMP_NUM_THREADS": "1"})


def _cases(job: list[dict[str, Any]]) -> Iterator[tuple[str, int, str, dict[str, Any]]]:
    for result in job:
        for world in ("world3", "world2"):
            for name, case in result.get(world, {}).items():
                yield world, result["rank"], name, case


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_parity_with_ddp_every_case(job: list[dict[str, Any]]) -> None:
    report = []
    for world, rank, name, case in _cases(job):
        loss = _max_diff(case["losses"]["ddp"], case["losses"]["zero"])
        norm = max(abs(a - b) / max(a, 1e-12)
                   for a, b in zip(case["norms"]["ddp"], case["norms"]["zero"]))
        report.append(f"{world} rank {rank} {name}: params {case['max_param_diff']:.1e} "
                      f"loss {loss:.1e} norm(rel) {norm:.1e}")
        assert case["max_param_diff"] <= TOLERANCE, report[-1]
        assert loss <= TOLERANCE and norm <= TOLERANCE, report[-1]
        assert case["frozen_unchanged"], f"{world} {name}: a frozen parameter changed"
    print("\n".join(report))


def test_bitwise_on_two_ranks_where_the_reduction_order_allows(
        job: list[dict[str, Any]]) -> None:
    for result in job[:2]:
        for name in BITWISE_ON_2_RANKS:
            case = result["world2"][name]
            assert case["bitwise"], f"{name}: max diff {case['max_param_diff']}"
            assert case["losses"]["ddp"] == case["losses"]["zero"], name


def test_all_ranks_hold_identical_parameters(job: list[dict[str, Any]]) -> None:
    for world, members in (("world3", job), ("world2", job[:2])):
        first = members[0][world]
        for other in members[1:]:
            for name, case in other[world].items():
                assert case["checksum"] == first[name]["checksum"], (world, name)


def test_no_full_parameter_outside_forward_and_backward(job: list[dict[str, Any]]) -> None:
    """numel of param.data, summed over non-persistent parameters: zero after
    zero.Init, after wrapping, and after every step."""
    for world, rank, name, case in _cases(job):
        if name.endswith("-init"):
            assert case["held_after_init"] == 0, (world, rank, name)
        assert case["held_after_wrap"] == 0, (world, rank, name)
        assert set(case["held_after_step"]) == {0}, (world, rank, name)


def test_prefetch_runs_and_respects_max_live(job: list[dict[str, Any]]) -> None:
    for world, _rank, name, case in _cases(job):
        events = case["events"]
        assert events.get("forward prefetch", 0) > 0, (world, name, events)
        if name.startswith("gas3-clip-livecap"):
            # prefetching never passes max_live; a module's own gather always proceeds
            assert case["peak_live"] <= case["max_live"] + max(case["module_numels"]), case
            assert events.get("forward", 0) > events.get("forward prefetch", 0)
        else:  # after the first pass every forward gather is a prefetch
            assert events.get("forward", 0) == 4, (world, name, events)


def test_max_reuse_distance_saves_the_backward_gathers(job: list[dict[str, Any]]) -> None:
    """With every parameter kept from forward to backward, backward gathers
    only until the traces are known (the first two micro-steps)."""
    for world, _rank, name, case in _cases(job):
        if name == "gas3-clip-reuse":
            kept = case["events"].get("backward", 0) + case["events"].get("backward prefetch", 0)
            plain = job[0][world]["gas3-clip"]["events"]
            released = plain.get("backward", 0) + plain.get("backward prefetch", 0)
            assert 0 < kept < released / 5, (world, kept, released)


def test_init_partitions_each_module_and_matches_rank0(job: list[dict[str, Any]]) -> None:
    for result in job[:2]:
        init = result["init"]
        assert init["probe"] == [0, 0, 0, 0]  # blocks built so far hold no full parameter
        assert init["equal_to_rank0_model"]
        assert init["held_after_init"] == 0
        assert init["shard_numel"] * 2 >= init["model_numel"] > init["shard_numel"]
        assert init["ds_shape"] == init["shape"] == init["size"] == [32, 16]
        assert init["numel"] == 512 and init["data_numel"] == 0
        assert "shape=(32, 16)" in init["repr"] and "NOT_AVAILABLE" in init["repr"]
        assert init["inside_class_partitioned"] and init["after_exit_untouched"]


def test_gathered_parameters_round_trip(job: list[dict[str, Any]]) -> None:
    for result in job[:2]:
        seen = result["gathered"]
        assert seen["read_equal"]
        assert seen["held_inside"] == seen["model_numel"]
        assert seen["held_after_read"] == seen["held_after_modify"] == 0
        assert seen["sees_rank0"] and seen["master_updated"]
        assert seen["module_state_dict_equal"] and seen["held_after_state_dict"] == 0


def test_external_parameter_and_eval_forward(job: list[dict[str, Any]]) -> None:
    """A weight used outside its module's forward (tied output layer),
    registered with register_external_parameter: same training as DDP; eval
    forwards under no_grad give DDP's outputs and change nothing."""
    for result in job[:2]:
        seen = result["tied"]
        assert seen["max_param_diff"] <= TOLERANCE and seen["eval_equal"], seen
        assert seen["held_after"] == 0


def test_model_state_bytes_match_the_fp32_formula(job: list[dict[str, Any]]) -> None:
    """fp32 Adam at stage 3 on 2 ranks: (4 + 4 + 8) * psi / 2 per rank
    (shard, gradient shard, Adam moments): the fp32 master is the shard
    itself (the paper's K = 12 counts a separate master copy)."""
    for result in job[:2]:
        got = result["memory"]
        want = paper_model_state_bytes(got["psi"], 2, 3, precision="fp32", k=8)
        assert abs(got["model_state"] - want) <= 0.10 * want, (got, want)
        assert got["held_after_step"] == 0
        print(f"stage 3: {got['model_state'] / got['psi']:.2f} bytes/param "
              f"(formula {want / got['psi']:.2f})")


def test_memory_efficient_linear_frees_weights_between_forward_and_backward(
        job: list[dict[str, Any]]) -> None:
    """F.linear saves weight.t(), a view that keeps the gathered weight alive
    until backward (when its input needs a gradient: the 2nd and 3rd layers
    here); zero3_linear saves the parameter itself."""
    for result in job[:2]:
        pinned = result["pinned"]
        assert pinned["efficient"] == 0
        assert pinned["plain"] == 4 * (64 * 64 + 64), pinned


@pytest.mark.parametrize("mode", ["check-noprefetch", "debug-prefetch"])
def test_divergence_detector_names_module_and_rank(job: list[dict[str, Any]],
                                                   mode: str) -> None:
    for rank, result in enumerate(job[:2]):
        seen = result["divergence"][mode]
        error = seen["error"]
        assert error is not None, f"rank {rank} ({mode}) did not detect the divergence"
        assert seen["elapsed"] < 10, seen["elapsed"]
        assert "The ranks diverged at ZeRO-3 collective #" in error
        assert "rank 1 runs forward of 'branch_b (Linear)'" in error, error
        if mode == "check-noprefetch":
            assert "rank 0 runs forward of 'branch_a (Linear)'" in error, error
        assert "same modules in the same order" in error


def test_timeout_names_the_rank_that_stopped(job: list[dict[str, Any]]) -> None:
    seen = job[0]["timeout"]
    error = seen["error"]
    assert error is not None and seen["elapsed"] < 15, seen
    assert "failed on rank 0" in error and "ranks wait 2 s for each other" in error, error
    assert "rank 1 never reached it (its last was #" in error, error
    assert job[1]["timeout"]["error"] is None  # rank 1 was elsewhere (a barrier)
    # both ranks trained on afterwards with a fresh side group
    assert job[0]["timeout"]["recovered_checksum"] == job[1]["timeout"]["recovered_checksum"]


# ------------------------------------------------------- world size 1, in-process


@pytest.mark.parametrize("gas", [1, 3])
@pytest.mark.parametrize("max_norm", [0.0, 0.05])
@pytest.mark.parametrize("impl", ["chosen", "single-tensor"])
def test_world_size_one_is_the_plain_update(solo: None, gas: int, max_norm: float,
                                            impl: str) -> None:
    """Plain training with the same Adam implementation (dsrun's fused
    choice, or the client's own): bitwise without clipping - the gradients
    accumulate in the flat buffer exactly as in ``param.grad``."""
    kind = {"fused": True} if impl == "chosen" else {"foreach": False}
    ref, mine = small_model(), small_model()
    train(ref, torch.optim.Adam(two_groups(ref), lr=0.01, **kind), gas, max_norm, zero=False)
    defaults = {"lr": 0.01} if impl == "chosen" else {"lr": 0.01, "foreach": False}
    stage3 = ZeroStage3(mine, two_groups(mine), torch.optim.Adam, defaults,
                        settings=Stage3Settings(param_persistence_threshold=0,
                                                reduce_bucket_size=50))
    train(mine, stage3, gas, max_norm, zero=True)
    pairs = list(zip(ref.parameters(), mine.parameters()))
    if max_norm == 0.0:
        assert all(torch.equal(a, b) for a, b in pairs)
    else:  # clip coefficient from a differently rounded norm
        assert max((a - b).abs().max().item() for a, b in pairs) <= TOLERANCE
    assert [g["lr"] for g in stage3.param_groups] == [0.01, 0.03]
    assert all(p.ds_persist and p.ds_status is ZeroParamStatus.AVAILABLE
               for p in mine.parameters())
    assert not stage3.fetcher.active  # nothing to gather: no module hooks at all
    assert not stage3.backward_hook_installed  # nor gradient hooks: flat gradients
    stage3.close()


def test_world_size_one_is_flat_and_aliased(solo: None) -> None:
    """World size 1: parameters, shards and the fp32 master are one flat
    buffer per group; gradients are views of one flat gradient buffer that
    is the master's gradient; optimizer state covers the masters only."""
    model = small_model()
    stage3 = ZeroStage3(model, two_groups(model), torch.optim.Adam, {"lr": 0.01})
    model(torch.randn(2, 7)).sum().backward()
    weight, master = model[2].weight, stage3.masters[1]
    stage3.step()
    assert weight.data_ptr() == weight.ds_tensor.data_ptr() == master.data_ptr()
    assert weight.grad.data_ptr() == master.grad.data_ptr()
    assert [s["exp_avg"].numel() for s in stage3.state.values()] == \
        [m.numel() for m in stage3.masters]
    assert stage3.state_dict()["zero_stage"] == 3
    stage3.zero_grad(set_to_none=False)
    assert weight.grad is not None and not weight.grad.any()  # zeroed in place, still bound
    stage3.close()


@pytest.mark.parametrize("gas", [1, 3])
def test_world_size_one_host_resident_parameters(solo: None, gas: int) -> None:
    """offload_param at world size 1: parameters are not kept whole but
    fetched for each module from their (host) shards, gradients released at
    once into the accumulators; training equals the plain update."""
    ref, mine = small_model(), small_model()
    train(ref, torch.optim.Adam(two_groups(ref), lr=0.01, fused=True), gas, 0.0, zero=False)
    stage3 = ZeroStage3(mine, two_groups(mine), torch.optim.Adam, {"lr": 0.01},
                        settings=Stage3Settings(offload_param=True, offload_optimizer=True,
                                                param_persistence_threshold=20))
    assert stage3.fetcher.active and stage3.backward_hook_installed
    assert not mine[2].weight.ds_persist and mine[2].bias.ds_persist  # 5 <= 20 elements
    train(mine, stage3, gas, 0.0, zero=True)
    assert full_numel_held(mine.parameters()) == 0  # released after use
    with zero.GatheredParameters(list(mine.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(),
                                                               mine.parameters()))
    assert diff <= TOLERANCE  # gas 3: reduced (added) per micro-step in another order
    if gas == 1:
        assert diff == 0.0
    stage3.close()


def test_all_frozen_group_and_external_registration(solo: None) -> None:
    model = small_model()
    extra = torch.nn.Linear(3, 3).requires_grad_(False)
    model.add_module("extra", extra)
    groups = [{"params": list(extra.parameters())}, *two_groups(model)]
    zero.register_external_parameter(model[2], extra.weight)
    zero.register_external_parameter(model[2], extra.weight)  # once only
    # DeepSpeed's: a method over {id: parameter}, and all_parameters()
    assert list(model[2].ds_external_parameters()) == [(id(extra.weight), extra.weight)]
    assert [p for _, p in model[2].all_parameters()] == [*model[2].parameters(recurse=False),
                                                         extra.weight]
    stage3 = ZeroStage3(model, groups, torch.optim.AdamW, {"lr": 0.01})
    assert stage3.masters[0].numel() == 0 and stage3.master_shard(extra.weight) is None
    frozen = extra.weight.detach().clone()
    model[:3](torch.randn(2, 7)).sum().backward()
    stage3.step()
    assert torch.equal(frozen, extra.weight)
    zero.unregister_external_parameter(model[2], extra.weight)
    assert list(model[2].ds_external_parameters()) == []
    stage3.close()


def test_low_precision_model_keeps_fp32_masters(solo: None) -> None:
    model = small_model().to(torch.bfloat16)
    stage3 = ZeroStage3(model, two_groups(model), torch.optim.AdamW, {"lr": 0.01})
    before = model[2].weight.detach().clone()
    for _ in range(3):
        model(torch.randn(2, 7, dtype=torch.bfloat16)).float().square().sum().backward()
        stage3.step()
        stage3.zero_grad()
    assert all(m.dtype == torch.float32 for m in stage3.masters)
    assert not torch.equal(before, model[2].weight)
    flat = torch.cat([model[2].weight.flatten(), model[2].bias])
    assert torch.equal(flat, stage3.masters[1].detach().to(torch.bfloat16))
    stage3.close()


def test_state_dict_round_trip(solo: None) -> None:
    model = small_model()
    stage3 = ZeroStage3(model, two_groups(model), torch.optim.Adam, {"lr": 0.01})
    model(torch.randn(2, 7)).sum().backward()
    stage3.step()
    saved = stage3.state_dict()
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(2, 7)).sum().backward()
    stage3.step()
    stage3.load_state_dict(saved)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    full = stage3.module_state_dict()
    assert all(torch.equal(full[k], v) for k, v in model.state_dict().items())
    stage3.close()


def test_zero_init_and_gathered_parameters_at_world_size_one(solo: None) -> None:
    with zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        model = small_model()
    weight = model[0].weight
    assert isinstance(weight, zero.ZeroParameter) and tuple(weight.ds_shape) == (13, 7)
    assert weight.data.numel() == 91  # world size 1: kept whole
    before = weight.detach().clone()
    with zero.GatheredParameters(weight, modifier_rank=0):
        with torch.no_grad():
            weight.add_(1.0)
    assert torch.equal(weight, before + 1.0)
    assert torch.equal(weight.ds_tensor, (before + 1.0).view(-1))
    assert full_numel_held(model.parameters()) == 0  # persistent ones do not count


def test_init_disabled_and_config_checks(solo: None) -> None:
    with zero.Init(enabled=False):
        plain = torch.nn.Linear(2, 2)
    assert not hasattr(plain.weight, "ds_id")
    with pytest.raises(DsrunConfigError, match="nvme"):
        zero.Init(remote_device="nvme")
    with pytest.raises(DsrunConfigError, match="remote_device='disk'; dsrun supports"):
        zero.Init(remote_device="disk")
    with zero.Init(remote_device="cpu", pin_memory=True):  # CPU ranks: shards stay put
        built = torch.nn.Linear(300, 400)
    assert built.weight.ds_tensor.device.type == "cpu" and not built.weight.ds_tensor.is_pinned()
    with pytest.raises(DsrunConfigError, match="stage3_param_persistence_threshold"):
        zero.Init(config_dict_or_path={"zero_optimization": {
            "stage3_param_persistence_threshold": -1}})


def test_optimizer_checks(solo: None) -> None:
    model = small_model()
    with pytest.raises(DsrunConfigError, match="Lamb.*whole-tensor"):
        ZeroStage3(model, None, Lamb)
    with pytest.raises(DsrunConfigError, match="not a parameter of the module"):
        ZeroStage3(model, [torch.nn.Parameter(torch.ones(2))], torch.optim.Adam)
    opt = torch.optim.SGD(two_groups(model), lr=0.1, momentum=0.9)
    model(torch.randn(2, 7)).sum().backward()
    opt.step()
    with pytest.raises(DsrunConfigError, match="not stepped"):
        ZeroStage3.from_optimizer(model, opt)


def test_settings_from_zero_config() -> None:
    from dsrun.runtime.config_sections import ZeroConfig

    settings = Stage3Settings.from_config(ZeroConfig(
        stage=3, prefetch_bucket_size=123, param_persistence_threshold=7,
        max_live_parameters=999, reduce_bucket_size=55))
    assert (settings.prefetch_bucket_size, settings.param_persistence_threshold,
            settings.max_live_parameters, settings.reduce_bucket_size) == (123, 7, 999, 55)
    assert settings.overlap_comm is True  # DeepSpeed's stage-3 default
    with pytest.raises(DsrunConfigError, match="prefetch_bucket_size"):
        Stage3Settings(prefetch_bucket_size=-1)
    assert Stage3Settings(guard=GuardSettings(mode="off")).guard.mode == "off"


def test_public_module() -> None:
    import dsrun

    assert dsrun.zero.Init is zero.Init  # an attribute once the submodule is imported
    assert zero.GatheredParameters and zero.register_external_parameter


def _turn_run(**settings: int) -> tuple[list[float], list[int], list[int], int]:
    """Three training steps of six Linear(16, 16) under stage 3 (shards in
    host memory at world size 1, so parameters are gathered and released;
    ``settings``: prefetch and reuse sizes, 0 unless given): the losses, what
    forward left gathered, the gathers in backward, and what an eval
    forward leaves."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
    stage3 = ZeroStage3(model, None, torch.optim.AdamW, {"lr": 1e-2},
                        settings=Stage3Settings(offload_param=True, param_persistence_threshold=0,
                                                **{"prefetch_bucket_size": 0, **settings}))
    data = torch.Generator().manual_seed(1)
    losses, held, gathers = [], [], []
    for _ in range(3):
        before = stage3.guard.counts["backward"] + stage3.guard.counts["backward prefetch"]
        loss = model(torch.randn(4, 16, generator=data)).square().mean()
        held.append(full_numel_held(model.parameters()))
        loss.backward()
        stage3.micro_step_done()
        gathers.append(stage3.guard.counts["backward"] +
                       stage3.guard.counts["backward prefetch"] - before)
        stage3.step()
        stage3.zero_grad(set_to_none=False)
        assert full_numel_held(model.parameters()) == 0  # nothing survives the step
        losses.append(loss.item())
    with torch.no_grad():
        model(torch.randn(4, 16))
    after_eval = full_numel_held(model.parameters())
    stage3.close()
    return losses, held, gathers, after_eval


def test_forward_end_keeps_what_backward_fetches_first(solo: None) -> None:
    """The modules at the end of a training forward keep the parameters the
    previous backward fetched first (within the prefetch budget) instead of
    releasing them and gathering them again; an eval forward keeps nothing."""
    two_modules = 2 * (16 * 16 + 16)
    _, held, gathers, after_eval = _turn_run(prefetch_bucket_size=two_modules)
    assert held[0] == 0 and held[2] == two_modules  # no trace yet; then the budget
    assert gathers[2] < gathers[0]
    assert after_eval == 0


def test_max_reuse_distance_keeps_parameters_for_backward(solo: None) -> None:
    """``stage3_max_reuse_distance``: once both traces are known (from the
    third step: a backward's order is followed from the next one), a training
    forward keeps the parameters whose backward use comes within the
    distance (module 5's at distance 0, module 4's after 2 x 272 elements;
    a distance above the model keeps all, and backward gathers nothing);
    the losses are those of the run that releases everything; an eval
    forward keeps nothing."""
    module = 16 * 16 + 16
    plain, held, gathers, _ = _turn_run(max_reuse_distance=0)
    assert held == [0, 0, 0] and gathers[2] == gathers[0] > 0
    near, held, gathers, after_eval = _turn_run(max_reuse_distance=2 * module + 1)
    assert held[0] == 0 and held[2] == 2 * module and gathers[2] < gathers[0]
    assert near == plain and after_eval == 0
    every, held, gathers, after_eval = _turn_run(max_reuse_distance=10**8)
    assert held[0] == 0 and held[2] == 6 * module and gathers[2] == 0
    assert every == plain and after_eval == 0


def test_max_reuse_distance_from_the_config() -> None:
    """DeepSpeed's default (1e9, what HF's example configs write) counts as
    unset; any other value is used."""
    from dsrun.runtime.config_sections import ZeroConfig

    assert Stage3Settings.from_config(ZeroConfig(stage=3)).max_reuse_distance == 0
    assert Stage3Settings.from_config(
        ZeroConfig(stage=3, max_reuse_distance=10**9)).max_reuse_distance == 0
    assert Stage3Settings.from_config(
        ZeroConfig(stage=3, max_reuse_distance=5 * 10**7)).max_reuse_distance == 5 * 10**7
    with pytest.raises(DsrunConfigError, match="max_reuse_distance"):
        Stage3Settings(max_reuse_distance=-1)


def test_a_weight_used_twice_in_forward_is_gathered_once(solo: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A tied weight (used at the start and at the end of forward) stays
    gathered in between once the forward trace is known, instead of being
    released and gathered again."""
    import dsrun.runtime.zero.fetch as fetch

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.middle = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            self.last = torch.nn.Linear(8, 8)
            self.last.weight = self.first.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.last(self.middle(self.first(x)))

    torch.manual_seed(0)
    model = Tied()
    stage3 = ZeroStage3(model, None, torch.optim.AdamW, {"lr": 1e-3},
                        settings=Stage3Settings(offload_param=True, param_persistence_threshold=0,
                                                prefetch_bucket_size=0))
    gathered: list[int] = []
    original = fetch.start_gathers
    monkeypatch.setattr(fetch, "start_gathers", lambda params, strategy=None: (
        gathered.extend(p.ds_id for p in params), original(params, strategy))[1])
    tied = model.first.weight.ds_id
    counts = []
    for _ in range(3):
        gathered.clear()
        with torch.no_grad():
            model(torch.randn(2, 8))
        counts.append(gathered.count(tied))
        assert full_numel_held(model.parameters()) == 0
    assert counts[0] == 2 and counts[2] == 1  # no trace yet; then kept in between
    stage3.close()


def test_empty_partition_cache_releases_between_passes(solo: None) -> None:
    """DeepSpeed's ``empty_partition_cache``: a training forward that never
    got its backward (a loss computed for logging, ``generate()`` with
    grad on) leaves what it kept for backward gathered; the call releases
    it, and training goes on. Inside a pass it is an error."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    stage3 = ZeroStage3(model, None, torch.optim.AdamW, {"lr": 1e-2},
                        settings=Stage3Settings(offload_param=True, param_persistence_threshold=0,
                                                prefetch_bucket_size=0,
                                                max_reuse_distance=10**6))
    for _ in range(2):  # the first backward records the trace the keep follows
        model(torch.randn(4, 16)).square().mean().backward()
        stage3.micro_step_done()
        stage3.step()
        stage3.zero_grad(set_to_none=False)
    model(torch.randn(4, 16)).square().mean()  # no backward follows
    assert full_numel_held(model.parameters()) > 0
    stage3.empty_partition_cache()
    assert full_numel_held(model.parameters()) == 0
    model(torch.randn(4, 16)).square().mean().backward()  # gathers again as needed
    stage3.micro_step_done()
    stage3.step()
    assert full_numel_held(model.parameters()) == 0
    handle = model[1].register_forward_hook(lambda *_: stage3.empty_partition_cache())
    with pytest.raises(DsrunError, match="inside a forward or backward pass"):
        model(torch.randn(4, 16))
    handle.remove()
    stage3.fetcher.abandon_backward()
    stage3.close()
