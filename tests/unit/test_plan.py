"""Rank layout, per-rank environment and dry-run output (pure)."""

from __future__ import annotations

import pytest

from dsrun.errors import DsrunUsageError
from dsrun.launcher import launch
from dsrun.launcher.backends.local import LocalBackend
from dsrun.launcher.cluster import Cluster, this_host_pool
from dsrun.launcher.configcheck import check_config
from dsrun.launcher.envpolicy import EnvEntry, job_env
from dsrun.launcher.plan import NodeFacts, NodeSlots, build_plan, layout, rank_command
from dsrun.launcher.rankenv import RankEnv, check_user_env, materialize, rank_env
from dsrun.launcher.rankenv import describe as describe_env
from dsrun.launcher.resources import select_resources
from dsrun.launcher.spec import HostsSpec, LaunchSpec


def test_layout_assigns_contiguous_global_ranks_per_node():
    nodes = layout([NodeSlots("a", (0, 1), gpus=True), NodeSlots("b", (2, 3, 5), gpus=True)])
    assert [(r.rank, r.local_rank, r.device) for r in nodes[0].ranks] == [(0, 0, 0), (1, 1, 1)]
    assert [(r.rank, r.local_rank, r.device) for r in nodes[1].ranks] == \
        [(2, 0, 2), (3, 1, 3), (4, 2, 5)]
    assert nodes[1].devices == (2, 3, 5) and nodes[1].node_rank == 1


def test_cpu_nodes_have_no_devices():
    (node,) = layout([NodeSlots("a", (0, 1, 2), gpus=False)])
    assert node.devices == () and all(r.device is None for r in node.ranks)


def _local_slots(num, devices, cpus):
    hs = HostsSpec(num_gpus=num)
    pool = this_host_pool(hs, devices, cpus, "here")
    (node,) = select_resources(pool.hostfile, num_gpus=num)
    return node.slots


@pytest.mark.parametrize("num,devices,cpus,expect_slots", [
    (None, (), 8, (0, 1)),      # CPU default: 2 ranks, not one per core
    (None, (), 1, (0,)),        # ... but never more than the CPUs
    (3, (), 2, (0, 1, 2)),      # explicit CPU ranks may oversubscribe
    (None, (0, 1, 2, 3), 8, (0, 1, 2, 3)),  # all GPUs by default
    (2, (4, 5, 6), 8, (0, 1)),  # slots index the visible devices
])
def test_this_host_slots(num, devices, cpus, expect_slots):
    assert _local_slots(num, devices, cpus) == expect_slots


def test_more_gpu_ranks_than_gpus_is_an_error():
    with pytest.raises(DsrunUsageError, match="more GPUs than this host has \\(2\\)"):
        _local_slots(3, (0, 1), 8)


def _plan(num_gpus=2, devices=(), cpus=4, port=4242, **kw):
    spec = LaunchSpec(script="train.py", script_args=("--lr", "1"), num_gpus=num_gpus, **kw)
    slots = _local_slots(num_gpus, () if spec.cpu else devices, cpus)
    cluster = Cluster("<this host>", ("here",), (slots,), (True,), "local")
    env = job_env({}, remote=False, cli_env=spec.extra_env)
    return build_plan(spec, cluster, env, "job1", facts=[NodeFacts(tuple(devices), cpus)],
                      python="/py", cwd="/w", master=("127.0.0.1", port))


def _env(plan, node, slot):
    return dict(rank_env(plan, node, slot).dsrun)


def test_rank_env_for_each_rank():
    plan = _plan(num_gpus=3, dist_backend="gloo", extra_env=(("FOO", "bar"),))
    node = plan.nodes[0]
    envs = [_env(plan, node, s) for s in node.ranks]
    for i, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == str(i)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["LOCAL_SIZE"] == "3"
        assert env["NODE_RANK"] == env["CROSS_RANK"] == "0"
        assert env["NNODES"] == env["CROSS_SIZE"] == "1"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "4242"
        assert env["DSRUN_DIST_BACKEND"] == "gloo"
        assert "FOO" not in env  # user values travel apart, never printed
        assert env["DSRUN_JOB_ID"] == plan.job_id and env["DSRUN_RESTART_COUNT"] == "0"
        assert "CUDA_VISIBLE_DEVICES" not in env
    assert plan.user_env.as_dict() == {"FOO": "bar"}


def test_gpu_ranks_see_the_nodes_devices():
    plan = _plan(num_gpus=2, devices=(1, 3, 5), cpus=8)
    env = _env(plan, plan.nodes[0], plan.nodes[0].ranks[1])
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3" and env["LOCAL_RANK"] == "1"


def test_defaults_split_cpus_and_respect_user_settings():
    plan = _plan(num_gpus=2, cpus=8)
    env = rank_env(plan, plan.nodes[0], plan.nodes[0].ranks[0])
    assert dict(env.defaults) == {"OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"}
    crowded = _plan(num_gpus=3, cpus=2)
    assert dict(rank_env(crowded, *_first(crowded)).defaults)["OMP_NUM_THREADS"] == "1"
    out = materialize(env, {"OMP_NUM_THREADS": "7", "PYTHONUNBUFFERED": "0", "A": "1"},
                      {}, {})
    assert (out["OMP_NUM_THREADS"], out["PYTHONUNBUFFERED"], out["A"]) == ("7", "0", "1")
    user = materialize(env, {}, {"OMP_NUM_THREADS": "3"}, {})
    assert user["OMP_NUM_THREADS"] == "3" and user["RANK"] == "0"


def _first(plan):
    return plan.nodes[0], plan.nodes[0].ranks[0]


def test_materialize_layers_in_order():
    env = RankEnv(dsrun=(("RANK", "1"),), defaults=(("X", "d"), ("Y", "d")),
                  path_prepend=("/venv/bin",))
    out = materialize(env, {"PATH": "/usr/bin", "X": "inherited", "RANK": "9",
                            "DSRUN_LAUNCHER_SECRET": "s"},
                      {"Y": "user", "RANK": "8"}, {"DSRUN_AGENT_ID": "m"})
    assert out == {"PATH": "/venv/bin:/usr/bin", "X": "inherited", "Y": "user", "RANK": "1",
                   "DSRUN_AGENT_ID": "m"}  # the agent's own secret never reaches a rank
    assert RankEnv.from_json(env.to_json()) == env


def test_rank_command_modes():
    assert rank_command(LaunchSpec(script="a.py", script_args=("x",)), "/py") == \
        ("/py", "-m", "dsrun.runtime.bootstrap", "--script", "a.py", "x")
    assert rank_command(LaunchSpec(script="pkg.m", module=True), "/py")[3:5] == \
        ("--module", "pkg.m")
    assert rank_command(LaunchSpec(script="./run.sh", script_args=("1",), no_python=True),
                        "/py") == ("./run.sh", "1")


def test_dry_run_shows_rank_map_command_and_environment(tmp_path, capsys, monkeypatch):
    script = tmp_path / "t.py"
    script.write_text("")
    monkeypatch.setenv("DSRUN_FAKE_GPUS", "0")
    spec = LaunchSpec(script=str(script), script_args=("--num_gpus", "9"), num_gpus=2,
                      master_port=None, dry_run=True, extra_env=(("SECRETISH", "v"),))
    assert launch.run(spec) == 0
    out = capsys.readouterr().out
    assert "world size 2 on 1 node(s), master 127.0.0.1:" in out
    assert "ranks [0,1]  local ranks [0,1]  devices [cpu]" in out
    assert f"--script {script} --num_gpus 9" in out
    assert "    RANK=1" in out and "    LOCAL_WORLD_SIZE=2" in out
    assert "    OMP_NUM_THREADS=" in out
    assert "    SECRETISH=<value not shown> (--env)" in out and "=v\n" not in out


def test_local_backend_prepare_is_printable():
    plan = _plan(num_gpus=2)
    request = LocalBackend(python="/py").prepare(plan)
    assert request.agents[0].start == "agent /py -m dsrun.launcher.agent"
    payload = request.agents[0].payload
    assert [r["rank"] for r in payload["ranks"]] == [0, 1]
    assert payload["job_id"] == plan.job_id
    assert payload["ranks"][1]["env"]["defaults"]["OMP_NUM_THREADS"] == "2"


def test_local_rank_arg_is_inserted_after_the_script_per_rank():
    from dsrun.launcher.plan import rank_argv
    plan = _plan(num_gpus=2, local_rank_arg="--local_rank")
    argv = [rank_argv(plan, s) for s in plan.nodes[0].ranks]
    assert argv[1][-4:] == ["train.py", "--local_rank=1", "--lr", "1"]
    assert argv[0][-3] == "--local_rank=0"
    dashed = _plan(num_gpus=1, local_rank_arg="--local-rank", no_python=True)
    assert rank_argv(dashed, dashed.nodes[0].ranks[0]) == \
        ["train.py", "--local-rank=0", "--lr", "1"]
    plain = _plan(num_gpus=1)
    assert not any("local" in a for a in rank_argv(plain, plain.nodes[0].ranks[0]))


def test_config_is_handed_to_every_rank(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"train_batch_size": 8}')
    plan = _plan(num_gpus=2, config=str(cfg))
    for slot in plan.nodes[0].ranks:
        assert _env(plan, plan.nodes[0], slot)["DSRUN_CONFIG"] == str(cfg)


@pytest.mark.parametrize("text,message", [
    ('{"a": 1,\n  "b": }', ":2:8: not valid JSON"),
    ("[1, 2]", "must hold a JSON object, got"),
])
def test_bad_config_file_is_a_usage_error(tmp_path, text, message):
    cfg = tmp_path / "ds.json"
    cfg.write_text(text)
    with pytest.raises(DsrunUsageError, match=message):
        check_config(str(cfg), 2, {})


def test_cpu_flag_gives_cpu_ranks_that_see_no_gpu_on_a_gpu_host():
    plan = _plan(num_gpus=3, devices=(0,), cpus=8, cpu=True)
    node = plan.nodes[0]
    assert node.devices == () and [r.device for r in node.ranks] == [None] * 3
    env = _env(plan, node, node.ranks[2])
    assert env["DSRUN_ACCELERATOR"] == "cpu" and env["CUDA_VISIBLE_DEVICES"] == ""
    # without --cpu the same host gives GPU ranks, and 3 do not fit on 1 GPU
    with pytest.raises(DsrunUsageError, match="more GPUs than this host has"):
        _plan(num_gpus=3, devices=(0,), cpus=8)


def test_cpu_flag_ignores_the_gpus_hosts_report():
    spec = LaunchSpec(script="t.py", cpu=True)
    cluster = Cluster("hf", ("a", "b"), ((0, 1), (0, 1)), (True, False), "ssh")
    facts = [NodeFacts((0, 1), 8), NodeFacts((0, 1, 2, 3), 8)]
    plan = build_plan(spec, cluster, job_env({}, remote=True), "j", facts=facts,
                      python="/py", cwd="/", master=("10.0.0.1", 29500))
    assert all(n.devices == () for n in plan.nodes)
    env = _env(plan, plan.nodes[1], plan.nodes[1].ranks[0])
    assert env["DSRUN_ACCELERATOR"] == "cpu" and env["CUDA_VISIBLE_DEVICES"] == ""


def test_cpu_flag_refuses_nccl():
    with pytest.raises(DsrunUsageError, match="--cpu .* cannot use --dist_backend nccl"):
        LaunchSpec(script="t.py", cpu=True, dist_backend="nccl")


def test_dry_run_with_cpu_on_a_gpu_host(tmp_path, capsys, monkeypatch):
    script = tmp_path / "t.py"
    script.write_text("")
    monkeypatch.setenv("DSRUN_FAKE_GPUS", "1")
    spec = LaunchSpec(script=str(script), num_gpus=2, cpu=True, dry_run=True)
    assert launch.run(spec) == 0
    out = capsys.readouterr().out
    assert "ranks [0,1]  local ranks [0,1]  devices [cpu]" in out
    assert "    DSRUN_ACCELERATOR=cpu" in out and "    CUDA_VISIBLE_DEVICES=" in out


@pytest.mark.parametrize("key,instead", [
    ("RANK", "use --include/--exclude/--num_nodes/--num_gpus"),
    ("WORLD_SIZE", "use --include/--exclude/--num_nodes/--num_gpus"),
    ("MASTER_ADDR", "use --master_addr"), ("MASTER_PORT", "use --master_port"),
    ("DSRUN_AGENT_ID", "it cannot be set"),
    ("DSRUN_DIST_BACKEND", "use --dist_backend"),
])
def test_a_variable_dsrun_sets_for_each_rank_cannot_be_given(key, instead):
    """It would be replaced without a word (dsrun's layer wins)."""
    plan = _plan(dist_backend="gloo", extra_env=((key, "5"),))
    with pytest.raises(DsrunUsageError, match=f"^--env sets {key}, which dsrun sets for each "
                                              f"rank: {instead}"):
        check_user_env(plan)


def test_given_gpus_or_binding_make_their_variables_dsruns():
    check_user_env(_plan(extra_env=(("CUDA_VISIBLE_DEVICES", "1"),)))  # CPU ranks: theirs
    with pytest.raises(DsrunUsageError, match="sets CUDA_VISIBLE_DEVICES.*--include HOST:"):
        check_user_env(_plan(devices=(0, 1), extra_env=(("CUDA_VISIBLE_DEVICES", "1"),)))
    spec = LaunchSpec(script="t.py", num_gpus=2, bind_cores_to_rank=True,
                      extra_env=(("DSRUN_CPU_AFFINITY", "0"),))
    cluster = Cluster("<this host>", ("here",), ((0, 1),), (True,), "local")
    plan = build_plan(spec, cluster, job_env({}, remote=False, cli_env=spec.extra_env), "j",
                      facts=[NodeFacts((), 4, cpu_list=(0, 1, 2, 3))], python="/py", cwd="/w",
                      master=("127.0.0.1", 4242))
    with pytest.raises(DsrunUsageError, match="sets DSRUN_CPU_AFFINITY.*--bind_core_list"):
        check_user_env(plan)


def test_forwarded_and_file_variables_that_dsrun_sets():
    spec = LaunchSpec(script="train.py", num_gpus=2)
    slots = _local_slots(2, (), 4)
    cluster = Cluster("<this host>", ("here",), (slots,), (True,), "local")
    files = [EnvEntry("MASTER_PORT", "1", "/w/.dsrun_env:3")]
    for entries, fails in ((files, True), ([EnvEntry("RANK", "3", "forwarded"),
                                            EnvEntry("MASTER_ADDR", "x", "--env_prefix MA")],
                                           False)):
        env = job_env({}, remote=False, file_entries=entries)
        plan = build_plan(spec, cluster, env, "job1", facts=[NodeFacts((), 4)], python="/py",
                          cwd="/w", master=("127.0.0.1", 4242))
        if fails:
            with pytest.raises(DsrunUsageError, match="^/w/.dsrun_env:3 sets MASTER_PORT"):
                check_user_env(plan)
            continue
        check_user_env(plan)  # a parent job's variables lose quietly
        lines = describe_env(rank_env(plan, *_first(plan)), plan.user_env, "dsrun's env")
        assert "RANK=0" in lines and "MASTER_ADDR=127.0.0.1" in lines
        assert not [ln for ln in lines if "not shown" in ln]  # no hint that theirs wins


def test_rank_map_names_a_host_listed_by_address_by_its_name_too():
    """Output lines say [node3:2] (the agent's host name); the rank map said
    only 10.0.0.13, the hostfile entry."""
    from dsrun.launcher.plan import describe

    spec = LaunchSpec(script="t.py", cpu=True)
    cluster = Cluster("hf", ("node1", "10.0.0.13", "node2.example"), ((0,), (0,), (0,)),
                      (False, False, False), "ssh")
    facts = [NodeFacts.from_probe({"host": name, "cpus": 1})
             for name in ("node1", "node3", "node2")]
    plan = build_plan(spec, cluster, job_env({}, remote=True), "j", facts=facts,
                      python="/py", cwd="/", master=("10.0.0.11", 29500))
    assert [line.split(":")[0].strip() for line in describe(plan)[1:]] == \
        ["node1", "10.0.0.13 (node3)", "node2.example"]


@pytest.mark.parametrize("hs, devices, cpus, host, slots", [
    (HostsSpec(include="localhost:1"), (), 4, "here", (1,)),      # the plan's name
    (HostsSpec(include="localhost:0,1,2"), (), 2, "here", (0, 1, 2)),  # as --num_gpus 3
    (HostsSpec(include="localhost", num_gpus=3), (), 2, "here", (0, 1, 2)),
    (HostsSpec(include="localhost"), (), 3, "here", (0, 1, 2)),   # one per usable CPU
    (HostsSpec(exclude="localhost:0"), (), 3, "here", (1, 2)),
    (HostsSpec(include="localhost:1"), (0, 1), 8, "here", (1,)),
])
def test_filters_without_a_hostfile(hs, devices, cpus, host, slots):
    pool = this_host_pool(hs, devices, cpus, "here")
    (node,) = select_resources(pool.hostfile, hs.include, hs.exclude, num_gpus=hs.num_gpus,
                               this_host=lambda h: h in ("here", "localhost"))
    assert (node.host, node.slots) == (host, slots)


def test_gpu_slots_named_beyond_the_gpus_are_an_error():
    hs = HostsSpec(include="localhost:2")
    pool = this_host_pool(hs, (0, 1), 8, "here")
    with pytest.raises(DsrunUsageError, match="slot 2 is out of range for host 'here'"):
        select_resources(pool.hostfile, hs.include, this_host=lambda h: True)
