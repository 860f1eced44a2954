"""SSH backend without connecting: target resolution and prepare() golden output."""

from __future__ import annotations

import paramiko
import pytest

from dsrun.errors import DsrunUsageError
from dsrun.launcher.backends.ssh import (
    SshBackend,
    SshChannel,
    remote_command,
    resolve_target,
)
from dsrun.launcher.doctor import Cluster, Rendezvous
from dsrun.launcher.envpolicy import job_env
from dsrun.launcher.launch import cluster_plan
from dsrun.launcher.spec import LaunchSpec, SshOptions

CONFIG = paramiko.SSHConfig.from_text("""
Host gpu-*
    HostName %h.cluster
    User alice
    Port 2222
    IdentityFile ~/.ssh/id_cluster
    IdentitiesOnly yes
    UserKnownHostsFile /etc/dsrun/known_hosts ~/.ssh/kh2
    GlobalKnownHostsFile /dev/null

Host lab
    HostName 10.1.2.3
    StrictHostKeyChecking accept-new
""")


def test_target_from_ssh_config(monkeypatch):
    monkeypatch.setenv("HOME", "/home/me")
    t = resolve_target("gpu-1", SshOptions(), CONFIG.lookup("gpu-1"), "me")
    assert (t.hostname, t.port, t.user) == ("gpu-1.cluster", 2222, "alice")
    assert t.keys == ("/home/me/.ssh/id_cluster",) and t.identities_only
    assert t.known_hosts == ("/etc/dsrun/known_hosts", "/home/me/.ssh/kh2")
    assert t.host_keys == "strict" and t.describe() == "ssh alice@gpu-1.cluster:2222"


def test_flags_override_config_and_defaults_apply(monkeypatch):
    monkeypatch.setenv("HOME", "/home/me")
    options = SshOptions(port=22, user="bob", key="/k/id", insecure=True, timeout=3)
    t = resolve_target("gpu-1", options, CONFIG.lookup("gpu-1"), "me")
    assert (t.port, t.user, t.keys, t.host_keys, t.timeout) == (22, "bob", ("/k/id",), "off", 3)
    plain = resolve_target("node7", SshOptions(), CONFIG.lookup("node7"), "me")
    assert (plain.hostname, plain.port, plain.user, plain.keys) == ("node7", 22, "me", ())
    assert plain.known_hosts == ("/home/me/.ssh/known_hosts", "/home/me/.ssh/known_hosts2",
                                 "/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")
    assert not plain.identities_only
    lab = resolve_target("lab", SshOptions(), CONFIG.lookup("lab"), "me")
    assert (lab.hostname, lab.host_keys) == ("10.1.2.3", "accept-new")
    assert resolve_target("h", SshOptions(), {"hostname": "fe80::1"}, "me").address == \
        "[fe80::1]:22"


def test_bad_port_in_config_and_missing_config_file(tmp_path):
    with pytest.raises(DsrunUsageError, match="bad Port 'x' for host h"):
        resolve_target("h", SshOptions(), {"hostname": "h", "port": "x"}, "me")
    backend = SshBackend(SshOptions(config=str(tmp_path / "nope")))
    with pytest.raises(DsrunUsageError, match="--ssh_config .*nope does not exist"):
        backend.target("h")


def test_remote_command_quotes_and_checks_the_directory():
    assert remote_command("/opt/venv/bin/python", "/work/my dir") == (
        "cd '/work/my dir' || exit 96; exec /opt/venv/bin/python -m dsrun.launcher.agent")


def _plan(secret: str):
    spec = LaunchSpec(script="train.py", script_args=("--lr", "1"), dist_backend="gloo",
                      extra_env=(("SECRET", secret),), kill_grace=2.0)
    cluster = Cluster("hf", ("node1", "gpu-1"), ((0, 1), (0, 1)), (True, False), "ssh")
    env = job_env({"NCCL_DEBUG": "WARN"}, remote=True, cli_env=spec.extra_env)
    facts = [{"devices": [], "ifname": "eth0"}, {"devices": [0, 1, 2, 3], "ifname": "ib0"}]
    return cluster_plan(spec, cluster, env, "j0b", facts, Rendezvous("10.0.0.1", 29500),
                        python="/venv/bin/python")


def test_prepare_golden(monkeypatch):
    monkeypatch.chdir("/")
    monkeypatch.setenv("HOME", "/home/me")
    secret = "hunter2-do-not-print"
    backend = SshBackend(SshOptions(), python="/venv/bin/python", lookup=CONFIG.lookup,
                         user="me")
    request = backend.prepare(_plan(secret))
    lines = request.describe()
    assert all(secret not in line for line in lines)
    assert secret in str(request.agents[1].payload["env"])  # it travels on stdin only
    rank_vars = ["    DSRUN_DIST_BACKEND=gloo", "    DSRUN_JOB_ID=j0b",
                 "    DSRUN_RESTART_COUNT=0"]
    common = ["    LOCAL_WORLD_SIZE=2", "    MASTER_ADDR=10.0.0.1", "    MASTER_PORT=29500"]
    assert lines == [
        "node node1: agent /venv/bin/python -m dsrun.launcher.agent",
        "  rank 0 (local 0): /venv/bin/python -m dsrun.runtime.bootstrap --script train.py"
        " --lr 1",
        *rank_vars, "    GLOO_SOCKET_IFNAME=eth0", "    LOCAL_RANK=0", *common,
        "    NCCL_SOCKET_IFNAME=eth0", "    NNODES=2", "    NODE_RANK=0", "    RANK=0",
        "    WORLD_SIZE=4",
        "    NCCL_DEBUG=<value not shown> (forwarded)",
        "    SECRET=<value not shown> (--env)",
        "    (plus the environment dsrun was started with)",
        "  rank 1 (local 1): /venv/bin/python -m dsrun.runtime.bootstrap --script train.py"
        " --lr 1",
        *rank_vars, "    GLOO_SOCKET_IFNAME=eth0", "    LOCAL_RANK=1", *common,
        "    NCCL_SOCKET_IFNAME=eth0", "    NNODES=2", "    NODE_RANK=0", "    RANK=1",
        "    WORLD_SIZE=4",
        "    NCCL_DEBUG=<value not shown> (forwarded)",
        "    SECRET=<value not shown> (--env)",
        "    (plus the environment dsrun was started with)",
        "node gpu-1: ssh alice@gpu-1.cluster:2222: cd / || exit 96; "
        "exec /venv/bin/python -m dsrun.launcher.agent",
        "  rank 2 (local 0): /venv/bin/python -m dsrun.runtime.bootstrap --script train.py"
        " --lr 1",
        "    CUDA_VISIBLE_DEVICES=0,1", *rank_vars, "    GLOO_SOCKET_IFNAME=ib0",
        "    LOCAL_RANK=0", *common, "    NCCL_SOCKET_IFNAME=ib0", "    NNODES=2",
        "    NODE_RANK=1", "    RANK=2", "    WORLD_SIZE=4",
        "    NCCL_DEBUG=<value not shown> (forwarded)",
        "    SECRET=<value not shown> (--env)",
        "    PATH=</venv/bin in front of the host's PATH>",
        "    (plus the login environment of gpu-1)",
        "  rank 3 (local 1): /venv/bin/python -m dsrun.runtime.bootstrap --script train.py"
        " --lr 1",
        "    CUDA_VISIBLE_DEVICES=0,1", *rank_vars, "    GLOO_SOCKET_IFNAME=ib0",
        "    LOCAL_RANK=1", *common, "    NCCL_SOCKET_IFNAME=ib0", "    NNODES=2",
        "    NODE_RANK=1", "    RANK=3", "    WORLD_SIZE=4",
        "    NCCL_DEBUG=<value not shown> (forwarded)",
        "    SECRET=<value not shown> (--env)",
        "    PATH=</venv/bin in front of the host's PATH>",
        "    (plus the login environment of gpu-1)",
    ]
    payload = request.agents[1].payload
    assert payload["path_prepend"] == ["/venv/bin"] and payload["host_env"] == {
        "GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert request.agents[0].payload["path_prepend"] == []


def test_user_set_ifname_is_not_overridden(monkeypatch):
    spec = LaunchSpec(script="t.py")
    cluster = Cluster("hf", ("a", "b"), ((0,), (0,)), (False, False), "ssh")
    env = job_env({"GLOO_SOCKET_IFNAME": "ib0"}, remote=True)
    plan = cluster_plan(spec, cluster, env, "j", [{"ifname": "eth0"}, {"ifname": "eth1"}],
                        Rendezvous("10.0.0.1", 1))
    assert [dict(n.env) for n in plan.nodes] == [{"NCCL_SOCKET_IFNAME": "eth0"},
                                                 {"NCCL_SOCKET_IFNAME": "eth1"}]


def test_draft_plan_leaves_remote_facts_open():
    spec = LaunchSpec(script="t.py")
    cluster = Cluster("hf", ("a", "b"), ((0, 1), (0,)), (True, False), "ssh")
    plan = cluster_plan(spec, cluster, job_env({}, remote=True), "j", local_devices=())
    assert not plan.final and plan.master_port is None
    assert [n.gpus_known for n in plan.nodes] == [True, False]


class _Chan:
    def __init__(self, code):
        self.code = code


@pytest.mark.parametrize("code,tail,message", [
    (96, ["sh: 1: cd: can't cd to /w"], "working directory /w does not exist on h"),
    (127, [], "python interpreter /py not found on h"),
    (-1, [], "lost the SSH connection to h"),
    (1, ["/py: No module named dsrun.launcher.agent", ""],
     "node agent on h exited unexpectedly (status 1): /py: No module named "
     "dsrun.launcher.agent (is dsrun installed for /py on h?)"),
])
def test_channel_exit_messages(code, tail, message):
    channel = SshChannel.__new__(SshChannel)  # no connection needed for the wording
    channel.host, channel.cwd, channel.python = "h", "/w", "/py"
    assert channel.exit_message(code, tail) == message
