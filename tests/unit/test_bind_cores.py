"""--bind_cores_to_rank / --bind_core_list: CPU lists, shares per rank, the plan,
the rank environment and the dry-run (pure)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsrun import deathsig
from dsrun.errors import DsrunUsageError
from dsrun.launcher.cluster import Cluster
from dsrun.launcher.cores import format_cpu_list, parse_cpu_list, rank_cpus
from dsrun.launcher.envpolicy import job_env
from dsrun.launcher.plan import NodeFacts, build_plan, describe
from dsrun.launcher.rankenv import materialize, rank_env
from dsrun.launcher.spec import LaunchSpec


@given(st.sets(st.integers(0, 300)))
def test_cpu_lists_round_trip(cpus: set[int]) -> None:
    text = format_cpu_list(sorted(cpus))
    assert text.count(",") < len(cpus) or not cpus
    if cpus:
        assert parse_cpu_list(text) == tuple(sorted(cpus))
        assert deathsig.cpu_set(text) == cpus


def test_cpu_list_cases() -> None:
    assert parse_cpu_list("0-3,8, 10-11,2") == (0, 1, 2, 3, 8, 10, 11)
    assert format_cpu_list((8, 0, 1, 2, 3, 10, 11)) == "0-3,8,10-11"
    for bad, why in [("", "'' is not a CPU number"), ("1,,2", "'' is not"),
                     ("a", "'a' is not"), ("3-1", "needs A <= B"), ("-1", "'-1' is not"),
                     ("1-", "'1-' is not"), ("²", "'²' is not"),
                     ("0-99999999999", "CPU numbers must be below 65536"),
                     ("65536", "must be below 65536"), ("9" * 5000, "must be below")]:
        with pytest.raises(DsrunUsageError, match=f"--bind_core_list '{bad}': .*{why}"):
            parse_cpu_list(bad)


def test_shares_are_equal_disjoint_and_in_local_rank_order() -> None:
    assert rank_cpus("h", range(8), None, 2) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert rank_cpus("h", range(8), None, 3) == ((0, 1), (2, 3), (4, 5))  # 6, 7 unused
    assert rank_cpus("h", [4, 5, 6, 7, 0, 1], [0, 1, 4, 5], 2) == ((0, 1), (4, 5))
    with pytest.raises(DsrunUsageError, match="names CPU.s. 8-9 that host h cannot use "
                                              r"\(it may use 0-7\)"):
        rank_cpus("h", range(8), [6, 7, 8, 9], 1)
    with pytest.raises(DsrunUsageError, match="host h runs 3 rank.s. but the 2 CPU.s. it may "
                                              r"use \(0-1\) give each less than one"):
        rank_cpus("h", [0, 1], None, 3)
    with pytest.raises(DsrunUsageError, match="the 1 CPU.s. of --bind_core_list"):
        rank_cpus("h", range(4), [2], 2)


def _plan(facts: list[NodeFacts | None], master: tuple[str, int] | None = ("10.0.0.1", 29500),
          **kw: object) -> object:
    spec = LaunchSpec(script="t.py", cpu=True, **kw)  # type: ignore[arg-type]
    cluster = Cluster("hf", ("a", "b"), ((0, 1), (0, 1, 2)), (True, False), "ssh")
    return build_plan(spec, cluster, job_env({}, remote=True), "j", facts=facts,
                      python="/py", cwd="/", master=master)


def test_the_plan_gives_each_rank_its_cpus_and_threads() -> None:
    facts = [NodeFacts((), 8, cpu_list=tuple(range(8))),
             NodeFacts((), 6, cpu_list=(0, 1, 2, 3, 4, 5))]
    plan = _plan(facts, bind_cores_to_rank=True)
    assert [[s.cpus for s in n.ranks] for n in plan.nodes] == [
        [(0, 1, 2, 3), (4, 5, 6, 7)], [(0, 1), (2, 3), (4, 5)]]
    env = rank_env(plan, plan.nodes[1], plan.nodes[1].ranks[2])
    assert dict(env.dsrun)["DSRUN_CPU_AFFINITY"] == "4-5"
    assert dict(env.defaults)["OMP_NUM_THREADS"] == "2"
    # the user's OMP_NUM_THREADS still wins; the binding is dsrun's (always set)
    out = materialize(env, {"DSRUN_CPU_AFFINITY": "0"}, {"OMP_NUM_THREADS": "6"}, {})
    assert out["OMP_NUM_THREADS"] == "6" and out["DSRUN_CPU_AFFINITY"] == "4-5"
    assert describe(plan)[1:] == ["  a: ranks [0,1]  local ranks [0,1]  devices [cpu]",
                                  "    CPUs per rank: [0-3]  [4-7]",
                                  "  b: ranks [2,3,4]  local ranks [0,1,2]  devices [cpu]",
                                  "    CPUs per rank: [0-1]  [2-3]  [4-5]"]
    listed = _plan(facts, bind_core_list="2-5")
    assert listed.bind_cores and [s.cpus for s in listed.nodes[0].ranks] == [(2, 3), (4, 5)]
    unbound = _plan(facts)
    assert all(s.cpus is None for n in unbound.nodes for s in n.ranks)
    assert "DSRUN_CPU_AFFINITY" not in dict(rank_env(unbound, unbound.nodes[0],
                                                     unbound.nodes[0].ranks[0]).dsrun)
    assert dict(rank_env(unbound, unbound.nodes[0], unbound.nodes[0].ranks[0])
                .defaults)["OMP_NUM_THREADS"] == "4"  # 8 CPUs / 2 ranks, as before


def test_a_draft_plan_says_the_shares_are_found_at_launch() -> None:
    plan = _plan([NodeFacts((), 8, cpu_list=tuple(range(8))), None], master=None,
                 bind_core_list="0-3")
    assert describe(plan)[2:] == [
        "    CPUs per rank: [0-1]  [2-3]",
        "  b: ranks [2,3,4]  local ranks [0,1,2]  devices [cpu]",
        "    CPUs per rank: equal shares of --bind_core_list, found at launch"]
    env = rank_env(plan, plan.nodes[1], plan.nodes[1].ranks[0])
    assert dict(env.dsrun)["DSRUN_CPU_AFFINITY"].startswith("<chosen at launch>")


def test_the_highest_cpu_number_is_bounded_not_the_memory() -> None:
    assert parse_cpu_list("65534-0065535") == (65534, 65535)
    assert deathsig.MAX_CPU == 65536


def test_bad_bindings_are_usage_errors_before_anything_starts() -> None:
    with pytest.raises(DsrunUsageError, match="--bind_core_list '0-': "):
        LaunchSpec(script="t.py", bind_core_list="0-")
    assert LaunchSpec(script="t.py", bind_core_list="0-1").bind_cores_to_rank
    with pytest.raises(DsrunUsageError, match="host b runs 3 rank"):
        _plan([NodeFacts((), 8, cpu_list=tuple(range(8))), NodeFacts((), 2, cpu_list=(0, 1))],
              bind_cores_to_rank=True)
    with pytest.raises(DsrunUsageError, match="the dsrun agent on b did not say which CPUs"):
        _plan([NodeFacts((), 8, cpu_list=tuple(range(8))), NodeFacts.from_probe({"cpus": 2})],
              bind_cores_to_rank=True)
    with pytest.raises(DsrunUsageError, match="names CPU.s. 8 that host a cannot use"):
        _plan([NodeFacts((), 8, cpu_list=tuple(range(8))), None], master=None,
              bind_core_list="6-8")


def test_the_probe_reports_which_cpus() -> None:
    from dsrun.launcher.netinfo import probe_reply

    facts, held = probe_reply({"versions": False})
    assert held is None
    assert facts["cpu_list"] == sorted(os.sched_getaffinity(0))
    assert facts["cpus"] == len(facts["cpu_list"])
    assert NodeFacts.from_probe(facts).cpu_list == tuple(facts["cpu_list"])
    assert NodeFacts.from_probe({"cpus": 4}).cpu_list is None  # an agent without the field


def test_bind_cpus_pins_this_process_and_explains_a_failure() -> None:
    before = os.sched_getaffinity(0)
    try:
        one = min(before)
        assert deathsig.bind_cpus({"DSRUN_CPU_AFFINITY": str(one)}) is None
        assert os.sched_getaffinity(0) == {one}
        assert deathsig.bind_cpus({}) is None and os.sched_getaffinity(0) == {one}
        failed = deathsig.bind_cpus({"DSRUN_CPU_AFFINITY": "65000"})
        assert failed is not None and failed.startswith(
            "cannot bind this rank to CPUs 65000 (DSRUN_CPU_AFFINITY, from "
            "--bind_cores_to_rank): Invalid argument; this process may run on CPUs ")
    finally:
        os.sched_setaffinity(0, before)
