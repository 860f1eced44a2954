"""SSH backend without connecting: target resolution and prepare() golden output."""

from __future__ import annotations

import os

import paramiko
import pytest

from dsrun.errors import DsrunUsageError
from dsrun.launcher.backends.ssh import (
    SshBackend,
    SshChannel,
    remote_command,
    resolve_target,
)
from dsrun.launcher.cluster import Cluster
from dsrun.launcher.envpolicy import job_env
from dsrun.launcher.plan import NodeFacts, build_plan
from dsrun.launcher.spec import HostsSpec, LaunchSpec, SshOptions

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
    backend = SshBackend(HostsSpec(ssh=SshOptions(config=str(tmp_path / "nope"))))
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
    facts = [NodeFacts((), 4, "eth0"), NodeFacts((0, 1, 2, 3), 16, "ib0")]
    return build_plan(spec, cluster, env, "j0b", facts=facts, python="/venv/bin/python",
                      cwd="/", master=("10.0.0.1", 29500), remote_path=("/venv/bin",))


def test_prepare_golden(monkeypatch):
    monkeypatch.setenv("HOME", "/home/me")
    secret = "hunter2-do-not-print"
    backend = SshBackend(HostsSpec(), python="/venv/bin/python", lookup=CONFIG.lookup,
                         user="me", environ={"PYTHONUNBUFFERED": "1"})
    request = backend.prepare(_plan(secret))
    lines = request.describe()
    assert all(secret not in line for line in lines)
    assert secret in str(request.agents[1].payload["env"])  # it travels on stdin only
    agent_vars = [
        "    DSRUN_AGENT_ID=<set by the agent: marks the job's processes on the host>",
        "    DSRUN_AGENT_PID=<set by the agent: its pid; the rank dies with it>",
        "    DSRUN_ERROR_FILE=<set by the agent: where the rank records an uncaught error>",
        "    DSRUN_STACK_FILE=<set by the agent: where the rank writes its stacks for dsrun "
        "stack>"]
    user = ["    NCCL_DEBUG=<value not shown> (forwarded)", "    SECRET=<value not shown> (--env)"]

    def rank(r, local, node, extra, defaults, tail):
        return [
            f"  rank {r} (local {local}): /venv/bin/python -m dsrun.runtime.bootstrap "
            "--script train.py --lr 1", f"    CROSS_RANK={node}", "    CROSS_SIZE=2",
            *extra, "    DSRUN_DIST_BACKEND=gloo", "    DSRUN_JOB_ID=j0b",
            "    DSRUN_RESTART_COUNT=0", f"    LOCAL_RANK={local}", "    LOCAL_SIZE=2",
            "    LOCAL_WORLD_SIZE=2",
            "    MASTER_ADDR=10.0.0.1", "    MASTER_PORT=29500", "    NNODES=2",
            f"    NODE_RANK={node}", f"    RANK={r}", "    WORLD_SIZE=4",
            *defaults, *user, *tail]

    here = ["    GLOO_SOCKET_IFNAME=eth0", "    NCCL_SOCKET_IFNAME=eth0", "    OMP_NUM_THREADS=2"]
    base = "the login environment of gpu-1"
    there = [f"    GLOO_SOCKET_IFNAME=ib0 (unless set in {base})",
             f"    NCCL_SOCKET_IFNAME=ib0 (unless set in {base})",
             f"    OMP_NUM_THREADS=8 (unless set in {base})",
             f"    PYTHONUNBUFFERED=1 (unless set in {base})"]
    local_tail = [*agent_vars, "    (plus the environment dsrun was started with)"]
    remote_tail = [f"    PATH=</venv/bin in front of the PATH of {base}>", *agent_vars,
                   f"    (plus {base})"]
    gpus = ["    CUDA_VISIBLE_DEVICES=0,1"]
    assert lines == [
        "node node1: agent /venv/bin/python -m dsrun.launcher.agent",
        *rank(0, 0, 0, [], here, local_tail), *rank(1, 1, 0, [], here, local_tail),
        "node gpu-1: ssh alice@gpu-1.cluster:2222: cd / || exit 96; "
        "exec /venv/bin/python -m dsrun.launcher.agent",
        *rank(2, 0, 1, gpus, there, remote_tail), *rank(3, 1, 1, gpus, there, remote_tail),
    ]
    payload = request.agents[1].payload
    assert payload["ranks"][0]["env"]["path_prepend"] == ["/venv/bin"]
    assert payload["ranks"][0]["env"]["defaults"]["GLOO_SOCKET_IFNAME"] == "ib0"
    assert request.agents[0].payload["ranks"][0]["env"]["path_prepend"] == []


def test_user_set_ifname_is_not_overridden(monkeypatch):
    spec = LaunchSpec(script="t.py")
    cluster = Cluster("hf", ("a", "b"), ((0,), (0,)), (False, False), "ssh")
    env = job_env({"GLOO_SOCKET_IFNAME": "ib0"}, remote=True)
    plan = build_plan(spec, cluster, env, "j", facts=[NodeFacts((), 1, "eth0"),
                                                      NodeFacts((), 1, "eth1")],
                      python="/py", cwd="/", master=("10.0.0.1", 1))
    assert [dict(n.env) for n in plan.nodes] == [{"NCCL_SOCKET_IFNAME": "eth0"},
                                                 {"NCCL_SOCKET_IFNAME": "eth1"}]


def test_draft_plan_leaves_remote_facts_open():
    spec = LaunchSpec(script="t.py")
    cluster = Cluster("hf", ("a", "b"), ((0, 1), (0,)), (True, False), "ssh")
    plan = build_plan(spec, cluster, job_env({}, remote=True), "j",
                      facts=[NodeFacts((), 2), None], python="/py", cwd="/")
    assert not plan.final and plan.master_port is None and plan.master_addr is None
    assert [n.gpus_known for n in plan.nodes] == [True, False]
    assert [n.cpus for n in plan.nodes] == [2, None]


class _Chan:
    def __init__(self, code):
        self.code = code


@pytest.mark.parametrize("code,tail,message", [
    (96, ["sh: 1: cd: can't cd to /w"], "working directory /w does not exist on h"),
    (127, [], "python interpreter /py not found on h"),
    (-1, [], "lost the SSH connection to h"),
    (1, ["/py: No module named dsrun.launcher.agent", ""],
     "node agent on h exited unexpectedly (status 1): /py: No module named "
     "dsrun.launcher.agent (is dsrun installed for /py on h, or on the launcher's "
     "PYTHONPATH, which the agent gets?)"),
])
def test_channel_exit_messages(code, tail, message):
    channel = SshChannel.__new__(SshChannel)  # no connection needed for the wording
    channel.host, channel.cwd, channel.python = "h", "/w", "/py"
    channel.chan = paramiko.Channel(1)
    assert channel.exit_message(code, tail) == message


class _Transport:
    server_object = None


def test_an_agent_killed_by_a_signal_is_reported_as_such():
    """sshd sends exit-signal (no exit-status): paramiko leaves exit_status
    at -1, which was reported as a lost connection with exit code -1."""
    from dsrun.launcher.backends.ssh import _channel_request
    from dsrun.launcher.report import RankFailure

    chan = paramiko.Channel(1)
    chan.transport = _Transport()  # type: ignore[assignment]
    m = paramiko.Message()
    m.add_string("exit-signal")
    m.add_boolean(False)
    m.add_string("KILL")
    m.add_boolean(False)
    m.add_string("")
    m.add_string("")
    m.rewind()
    _channel_request(chan, m)
    chan.status_event.set()  # the channel closed; exit_status is still -1
    channel = SshChannel.__new__(SshChannel)
    channel.host, channel.cwd, channel.python, channel.chan = "node2", "/w", "/py", chan
    code = channel.wait(0)
    assert code is None and channel.exit_signal() == 9
    message = channel.exit_reason(code, [])
    assert message == "node agent on node2 killed by SIGKILL"
    failure = RankFailure(host="node2", rank=None, code=code, signal=9, time=0.0,
                          message=message)
    assert failure.exit_code == 137 and failure.cause() == message


def test_an_unknown_agent_status_never_makes_a_negative_exit_code():
    from dsrun.launcher.report import RankFailure

    for code in (None, -1):
        failure = RankFailure(host="h", rank=None, code=code, signal=None, time=0.0)
        assert failure.exit_code == 1


def test_a_changed_host_key_names_the_known_hosts_file_to_fix(tmp_path):
    """The hint said `ssh-keygen -R HOST`, which edits ~/.ssh/known_hosts,
    although the key came from ssh_config's UserKnownHostsFile."""
    from dsrun.launcher.backends.ssh_connect import _connect_error

    old = paramiko.RSAKey.generate(1024)
    new = paramiko.RSAKey.generate(1024)
    known = tmp_path / "kh"
    known.write_text(f"[node9]:2222 {old.get_name()} {old.get_base64()}\n")
    target = resolve_target("node9", SshOptions(port=2222), {
        "userknownhostsfile": str(known)}, "me")
    message = _connect_error(target, paramiko.BadHostKeyException("[node9]:2222", new, old))
    assert f"`ssh-keygen -R '[node9]:2222' -f {known}`" in message
    assert f"does NOT match known_hosts ({known})" in message


class _DeadChannelFile(paramiko.file.BufferedFile):
    """A channel file whose flush fails, as at exit with 3+ hosts."""

    def __init__(self) -> None:
        super().__init__()
        self._set_mode("wb", bufsize=4096)

    def _write(self, data):
        raise OSError("Socket is closed")


class _Client:
    def close(self) -> None: ...


def test_closing_a_dead_channel_leaves_nothing_for_the_finalizers(monkeypatch):
    """paramiko's BufferedFile.close flushes before it marks itself closed;
    a failing flush left the file open and its __del__ printed
    'Exception ignored ... ValueError: I/O operation on closed file'."""
    import gc
    import sys

    raised = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: raised.append(info.exc_value))
    channel = SshChannel.__new__(SshChannel)
    channel.client = _Client()
    files = [_DeadChannelFile() for _ in range(3)]
    files[0].write(b"pending")          # the flush raises OSError
    files[1]._wbuffer.close()           # the buffer was finalized first: ValueError
    channel._in, channel._out, channel._err = files
    channel.close()
    del channel, files
    gc.collect()
    assert raised == []


class _ExecChan:
    """A session channel that builds the exec request as paramiko does."""

    sent: bytes = b""

    def exec_command(self, command) -> None:
        m = paramiko.Message()
        m.add_string(command)  # paramiko's Channel.exec_command: strict UTF-8 for a str
        m.rewind()
        type(self).sent = m.get_binary()

    def makefile_stdin(self, mode):
        return None

    makefile = makefile_stderr = makefile_stdin


class _ExecTransport:
    _channel_handler_table: dict = {}

    def open_session(self, timeout=None):
        return _ExecChan()


class _ExecClient:
    def get_transport(self):
        return _ExecTransport()


@pytest.mark.parametrize("cwd,pythonpath", [
    (os.fsdecode(b"/work/nonutf\xff"), "/lib"),
    ("/work", os.fsdecode(b"/x\xff:/y")),
])
def test_a_path_that_is_not_utf8_reaches_sshd_as_its_bytes(cwd, pythonpath):
    """A non-UTF-8 working directory or PYTHONPATH crashed the launcher and
    `dsrun doctor` with paramiko's UnicodeEncodeError traceback."""
    from dsrun.launcher.backends.agent_env import remote_assignments
    from dsrun.launcher.backends.ssh import remote_command
    from dsrun.launcher.envpolicy import EnvEntry, JobEnv

    env = JobEnv((EnvEntry("PYTHONPATH", pythonpath, "forwarded"),))
    command = remote_command("/py", cwd, remote_assignments(env))
    target = resolve_target("h", SshOptions(), {}, "me")
    SshChannel(target, _ExecClient(), command, cwd, "/py")  # type: ignore[arg-type]
    assert os.fsencode(cwd) in _ExecChan.sent
    assert os.fsencode(pythonpath) in _ExecChan.sent
