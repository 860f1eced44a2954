"""mpirun and srun commands built from plans (golden argv), and their checks (pure)."""

from __future__ import annotations

import os

import pytest

from dsrun.errors import DsrunUsageError, SelectionError
from dsrun.launcher.backends import names
from dsrun.launcher.backends.connect import placement_problem
from dsrun.launcher.backends.openmpi import (
    CONTROLLED,
    OpenMpiBackend,
    controlled_problem,
    mpirun_argv,
    version_problem,
)
from dsrun.launcher.backends.slurm import (
    SlurmBackend,
    allocation_pool,
    placeholder_pool,
    srun_argv,
)
from dsrun.launcher.cluster import Cluster
from dsrun.launcher.envpolicy import job_env
from dsrun.launcher.hostfile import parse_hostfile
from dsrun.launcher.plan import NodeFacts, build_plan
from dsrun.launcher.resources import select_resources
from dsrun.launcher.spec import LAUNCHERS, HostsSpec, LaunchSpec, SshOptions

AGENT = ("/venv/bin/python", "-m", "dsrun.launcher.agent")
HOSTFILE = parse_hostfile("node1 slots=4\nnode2 slots=2\nnode3 slots=4\n", "hf")


def _plan(include=None, exclude=None, num_gpus=None, local=(), env=None, **spec_kw):
    nodes = select_resources(HOSTFILE, include, exclude, None, num_gpus)
    hosts = tuple(n.host for n in nodes)
    cluster = Cluster("hf", hosts, tuple(n.slots for n in nodes),
                      tuple(h in local for h in hosts), "openmpi")
    spec = LaunchSpec(script="train.py", script_args=("--lr", "1"), **spec_kw)
    facts = [NodeFacts((), 8) for _ in hosts]
    return build_plan(spec, cluster, env or job_env({}, remote=True), "j", facts=facts,
                      python=AGENT[0], cwd="/work", master=("10.0.0.1", 29500))


def test_mpirun_golden_uneven_slots_and_forwarded_names():
    env = job_env({"NCCL_DEBUG": "INFO", "HOME": "/root"}, remote=True,
                  cli_env=(("SECRET", "s3cr3t"),))
    plan = _plan(exclude="node1:2,3@node3:0", local=("node1",), env=env)
    argv = mpirun_argv(plan, AGENT, launcher_args=("--mca", "btl", "self,tcp"),
                       as_root=True)
    assert argv == (
        "mpirun", "-np", "7", "-H", "localhost,localhost,node2,node2,node3,node3,node3",
        "--map-by", "seq",
        "--bind-to", "none", "--allow-run-as-root", "--wdir", "/work",
        "-x", "DSRUN_LAUNCHER", "-x", "DSRUN_LAUNCHER_SECRET", "-x", "DSRUN_LAUNCHER_TIMEOUT",
        "-x", "NCCL_DEBUG", "-x", "SECRET",
        "--mca", "odls_base_sigkill_timeout", "31",  # --kill_grace 30 + 1 (openmpi.py)
        "--mca", "btl", "self,tcp",
        *AGENT, "--connect")
    assert "s3cr3t" not in " ".join(argv) and "INFO" not in argv  # names only


def test_mpirun_include_not_root_and_ssh_options():
    plan = _plan(include="node2@node3:1,3")
    ssh = SshOptions(port=2222, user="alice", key="/k/id", config="/etc/cfg", insecure=True)
    argv = mpirun_argv(plan, AGENT, mpirun="/opt/ompi/bin/mpirun", ssh=ssh,
                       launcher_args=("--bind-to", "core"))
    assert argv[:7] == ("/opt/ompi/bin/mpirun", "-np", "4", "-H", "node2,node2,node3,node3",
                        "--map-by", "seq")
    assert "--allow-run-as-root" not in argv and argv.count("--bind-to") == 1  # the user's
    i = argv.index("plm_rsh_args")
    assert argv[i - 1] == "--mca" and argv[i + 1] == (
        "-F /etc/cfg -p 2222 -l alice -i /k/id -o StrictHostKeyChecking=no "
        "-o UserKnownHostsFile=/dev/null")
    assert argv[-4:] == (*AGENT, "--connect")[-4:]


def test_srun_golden_named_hosts_run_each_rank_where_planned():
    env = job_env({}, remote=True, cli_env=(("A", "1"),))
    plan = _plan(exclude="node1:1,2,3@node3:3", env=env)
    argv = srun_argv(plan, AGENT, named=True, slurm_args=("--partition=gpu", "--time=10"))
    assert argv == (
        "srun", "--nodes=3", "--ntasks=6", "--distribution=arbitrary",
        "--nodelist=node1,node2,node2,node3,node3,node3", "--kill-on-bad-exit=1",
        "--export=ALL,DSRUN_LAUNCHER,DSRUN_LAUNCHER_SECRET,DSRUN_LAUNCHER_TIMEOUT,A",
        "--chdir=/work", "--partition=gpu", "--time=10", *AGENT, "--connect")


def test_srun_golden_hosts_chosen_by_slurm():
    pool = placeholder_pool(HostsSpec(num_nodes=2, num_gpus=3))
    nodes = select_resources(pool.hostfile)
    cluster = Cluster(pool.hostfile.path, tuple(n.host for n in nodes),
                      tuple(n.slots for n in nodes), (False, False), "slurm", named=False)
    plan = build_plan(LaunchSpec(script="t.py"), cluster, job_env({}, remote=False), "j",
                      facts=[None, None], python="/py", cwd="/w")
    argv = srun_argv(plan, ("/py", "-m", "dsrun.launcher.agent"), named=False)
    assert argv == ("srun", "--nodes=2", "--ntasks=6", "--ntasks-per-node=3",
                    "--kill-on-bad-exit=1",
                    "--export=ALL,DSRUN_LAUNCHER,DSRUN_LAUNCHER_SECRET,DSRUN_LAUNCHER_TIMEOUT",
                    "--chdir=/w", "/py", "-m", "dsrun.launcher.agent", "--connect")
    assert [n.host for n in plan.nodes] == ["slurm-node-1", "slurm-node-2"]


def test_dry_run_request_prints_the_command_and_names_only():
    env = job_env({}, remote=True, cli_env=(("SECRET", "s3cr3t"),))
    plan = _plan(include="node2", local=(), env=env)
    backend = OpenMpiBackend(HostsSpec(launcher="openmpi"), python=AGENT[0], environ={},
                             as_root=False)
    lines = backend.prepare(plan).describe()
    assert lines[0].startswith("launch: mpirun -np 2 -H node2,node2 --map-by seq "
                               "--bind-to none --wdir /work")
    assert "values in mpirun's environment, never on its command line" in lines[1]
    assert not any("s3cr3t" in ln for ln in lines)
    assert sum(ln.startswith("node node2: started by mpirun") for ln in lines) == 1
    assert "    SECRET=<value not shown> (--env)" in lines
    agents = backend.prepare(plan).agents
    assert [[r["rank"] for r in a.payload["ranks"]] for a in agents] == [[0], [1]]


def test_mpirun_places_ranks_in_plan_order_when_this_host_is_not_first():
    """Open MPI maps its own host first with -H host:n and --map-by slot: a
    hostfile listing node2 before this host put rank 0 here. One -H entry
    per rank and the sequential mapper keep the plan's order."""
    hostfile = parse_hostfile("node2 slots=1\nnode1 slots=2\n", "hf")
    nodes = select_resources(hostfile, None, None, None, None)
    cluster = Cluster("hf", ("node2", "node1"), tuple(n.slots for n in nodes),
                      (False, True), "openmpi")
    plan = build_plan(LaunchSpec(script="t.py"), cluster, job_env({}, remote=True), "j",
                      facts=[NodeFacts((), 8), NodeFacts((), 8)], python=AGENT[0],
                      cwd="/work", master=("10.0.0.2", 29500))
    argv = mpirun_argv(plan, AGENT)
    assert argv[1:7] == ("-np", "3", "-H", "node2,localhost,localhost", "--map-by", "seq")


@pytest.mark.parametrize("args,bad", [
    (("--mca", "btl", "tcp,self", "--bind-to", "none"), None),
    (("-np", "8"), "-np"), (("--host=a,b",), "--host=a,b"), (("-H", "a"), "-H"),
    (("--hostfile", "x"), "--hostfile"), (("--n", "1"), "--n"), (("-N", "1"), "-N"),
    (("--npernode", "1"), "--npernode"), (("-npersocket", "1"), "-npersocket"),
    (("--pernode",), "--pernode"), (("-nolocal",), "-nolocal"), (("--nolocal",), "--nolocal"),
    (("--rankfile", "rf"), "--rankfile"), (("--app", "a"), "--app"), (("-bynode",), "-bynode"),
    (("--ppr", "1:node"), "--ppr"), (("--map-by", "slot:PE=2"), None), (("--noprefix",), None),
])
def test_launcher_args_may_not_place_ranks(args, bad):
    problem = controlled_problem(args, CONTROLLED, "--launcher_args", "use dsrun's options")
    assert (problem is None) == (bad is None)
    if bad:
        assert repr(bad) in problem


def test_mpirun_runs_by_name_so_open_mpi_adds_no_prefix(tmp_path, monkeypatch):
    """Open MPI takes an absolute argv[0] as --prefix and puts
    /usr/bin before the venv on every rank's PATH (and fails for /bin/mpirun).
    The file found on PATH runs under the name mpirun, and --dry-run shows that."""
    from dsrun.launcher.backends import openmpi

    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "mpirun"
    fake.write_text("#!/bin/sh\necho 'mpirun (Open MPI) 4.1.4'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(openmpi, "mpi4py_library", lambda: ("Open MPI v4.1.4, package", None))
    plan = _plan(include="node2")
    backend = OpenMpiBackend(HostsSpec(launcher="openmpi"), python=AGENT[0],
                             environ={"PATH": str(bindir)}, as_root=False)
    backend.check(None)  # type: ignore[arg-type]
    assert backend.executable == str(fake)
    assert backend.argv(plan)[:3] == ("mpirun", "-np", "2")
    assert "--prefix" not in backend.argv(plan)
    assert backend.prepare(plan).describe()[0].startswith("launch: mpirun -np 2 ")


@pytest.mark.parametrize("args,bad", [
    (("--partition=debug", "--time=5", "--mpi=pmix"), None),
    (("-N2",), "-N2"), (("--nodes", "2"), "--nodes"), (("-n", "4"), "-n"),
    (("--export=NONE",), "--export=NONE"), (("-wnode1",), "-wnode1"), (("-p", "gpu"), None),
])
def test_slurm_args_may_not_place_ranks(args, bad):
    from dsrun.launcher.backends.slurm import CONTROLLED as SRUN_CONTROLLED

    problem = controlled_problem(args, SRUN_CONTROLLED, "--slurm_args", "x",
                                 attached_short=True)
    assert (problem is None) == (bad is None), problem


OMPI = "mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n"


@pytest.mark.parametrize("text,lib,err,message", [
    (OMPI, "Open MPI v4.1.4, package: Debian OpenMPI", None, None),
    (OMPI, "Open MPI v4.1.6, package: x", None, None),  # same minor: same ABI
    ("HYDRA build details:\n    Version: 4.1", None, None, "is not Open MPI's mpirun"),
    (OMPI, None, "ModuleNotFoundError: No module named 'mpi4py'",
     "mpi4py cannot be used by"),
    (OMPI, "MPICH Version: 4.1.2", None, "mpi4py uses 'MPICH Version: 4.1.2'"),
    (OMPI, "Open MPI v5.0.3, package: x", None, "rebuild mpi4py against it"),
])
def test_mpi_version_checks(text, lib, err, message):
    problem = version_problem("/usr/bin/mpirun", text, lib, err)
    if message is None:
        assert problem is None
    else:
        assert problem is not None and message in problem, problem


def test_allocation_pool_from_slurm_variables():
    env = {"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "gpu[01-02],cpu7",
           "SLURM_JOB_CPUS_PER_NODE": "8(x2),4"}
    pool = allocation_pool(env, None)
    assert [(e.host, e.slots) for e in pool.hostfile.entries] == \
        [("gpu01", 8), ("gpu02", 8), ("cpu7", 4)]
    assert pool.named and pool.default_ranks == 2  # CPU ranks: the CPU default
    gpus = allocation_pool({**env, "SLURM_GPUS_ON_NODE": "4"}, None)
    assert {e.slots for e in gpus.hostfile.entries} == {4} and gpus.default_ranks is None
    tasks = allocation_pool({**env, "SLURM_NTASKS_PER_NODE": "3"}, None)
    assert tasks.default_ranks == 3
    with pytest.raises(SelectionError, match="--num_gpus 9 asks for more slots than available"
                                             " in hostfile <Slurm allocation 12>"):
        select_resources(pool.hostfile, num_gpus=9)


def test_placeholder_pool_and_its_limits():
    pool = placeholder_pool(HostsSpec(launcher="slurm", num_nodes=3))
    assert [e.slots for e in pool.hostfile.entries] == [2, 2, 2] and not pool.named
    with pytest.raises(SelectionError, match="need a hostfile naming the Slurm nodes"):
        placeholder_pool(HostsSpec(launcher="slurm", include="a"))


def test_slurm_needs_an_allocation_or_slurm_args():
    backend = SlurmBackend(HostsSpec(launcher="slurm"), environ={})
    with pytest.raises(DsrunUsageError, match="outside an allocation .*--slurm_args"):
        backend.pool_without_hostfile()
    inside = SlurmBackend(HostsSpec(launcher="slurm"), environ={
        "SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_CPUS_PER_NODE": "2"})
    assert [e.host for e in inside.pool_without_hostfile().hostfile.entries] == ["n1", "n2"]


def test_launcher_names():
    assert list(LAUNCHERS) == names()
    assert HostsSpec(launcher="mpirun").launcher == "openmpi"
    assert HostsSpec(launcher="pdsh").launcher == "ssh"  # DeepSpeed's default launcher
    with pytest.raises(DsrunUsageError) as info:
        HostsSpec(launcher="pbs")
    assert str(info.value) == ("--launcher 'pbs' does not exist; choose one of local, "
                               "mpirun (= openmpi), openmpi, pdsh (= ssh), slurm, ssh")
    with pytest.raises(DsrunUsageError, match="--launcher_args is for --launcher openmpi"):
        HostsSpec(launcher="slurm", launcher_args=("-x", "A"))
    with pytest.raises(DsrunUsageError) as info:
        HostsSpec(launcher="local", launcher_args=("-x", "A"))
    assert "not local; the local launcher starts the ranks on this host itself" in str(info.value)
    assert "pdsh" not in str(info.value)
    with pytest.raises(DsrunUsageError, match="not the default launcher; the default "
                                              "launcher starts ranks on this host"):
        HostsSpec(launcher_args=("-f", "8"))  # DeepSpeed's pdsh fan-out
    with pytest.raises(DsrunUsageError, match="--slurm_args needs --launcher slurm"):
        HostsSpec(slurm_args=("-p", "x"))


RULE = "-" * 74


def _hello(host, local):
    return {"host": host, "local_rank": local}


def test_placement_must_match_the_plan():
    plan = _plan(include="node1:0,1@node2")
    good = {0: _hello("a", 0), 1: _hello("a", 1), 2: _hello("b", 0), 3: _hello("b", 1)}
    assert placement_problem(plan, good, "mpirun") is None
    by_node = {0: _hello("a", 0), 1: _hello("b", 0), 2: _hello("a", 1), 3: _hello("b", 1)}
    assert "started rank 1 as local rank 0 on b, but dsrun's plan has it as local rank 1" \
        in placement_problem(plan, by_node, "mpirun")
    same = {0: _hello("a", 0), 1: _hello("a", 1), 2: _hello("a", 0), 3: _hello("a", 1)}
    assert "on the same host a" in placement_problem(plan, same, "srun")
    assert "--slurm_args" in placement_problem(plan, same, "srun", options="--slurm_args")


def _two_hosts(first: str, second: str, local: tuple[bool, bool], slots=(1, 2)):
    hostfile = parse_hostfile(f"{first} slots={slots[0]}\n{second} slots={slots[1]}\n", "hf")
    nodes = select_resources(hostfile, None, None, None, None)
    cluster = Cluster("hf", (first, second), tuple(n.slots for n in nodes), local, "openmpi")
    return build_plan(LaunchSpec(script="t.py"), cluster, job_env({}, remote=True), "j",
                      facts=[NodeFacts((), 8), NodeFacts((), 8)], python=AGENT[0],
                      cwd="/work", master=("10.0.0.2", 29500))


def test_placement_must_be_on_the_planned_host():
    """mpirun put node2's ranks on this host (node1) and node1's on node2,
    local ranks matching: that was accepted, and the banner read
    'node2 (node1)'. The host must be the plan's, and the error blames
    --launcher_args only when the user gave some."""
    plan = _two_hosts("node2", "node1", (False, True), slots=(2, 2))
    swapped = {0: _hello("node1", 0), 1: _hello("node1", 1),
               2: _hello("node2", 0), 3: _hello("node2", 1)}
    problem = placement_problem(plan, swapped, "mpirun", "node1")
    assert problem == ("mpirun started rank 0 as local rank 0 on node1, but dsrun's plan has "
                       "it as local rank 0 on node2")
    problem = placement_problem(plan, swapped, "mpirun", "node1", "--launcher_args")
    assert problem.endswith("(options in --launcher_args must not change where ranks run)")
    # by name alone (the launcher on no host of the job), short or qualified
    remote = _two_hosts("node2.cluster", "node1", (False, False), slots=(2, 2))
    assert "on node1, but dsrun's plan has it as local rank 0 on node2.cluster" in \
        placement_problem(remote, swapped, "mpirun", "login")
    right = {0: _hello("node2", 0), 1: _hello("node2", 1),
             2: _hello("node1", 0), 3: _hello("node1", 1)}
    assert placement_problem(plan, right, "mpirun", "node1") is None
    assert placement_problem(remote, right, "mpirun", "login") is None
    # hostfile addresses (or ssh aliases) name no reported host: only this host is known
    by_addr = _two_hosts("10.0.0.2", "10.0.0.1", (False, True), slots=(2, 2))
    assert placement_problem(by_addr, right, "mpirun", "node1") is None
    assert "plan has it as local rank 0 on 10.0.0.1 (this host)" in \
        placement_problem(by_addr, {0: _hello("node2", 0), 1: _hello("node2", 1),
                                    2: _hello("node3", 0), 3: _hello("node3", 1)},
                          "mpirun", "node1")
    assert "on node1, but dsrun's plan has it as local rank 0 on 10.0.0.2" in \
        placement_problem(by_addr, swapped, "mpirun", "node1")


def test_uneven_slots_moved_by_mpirun_are_refused_without_blaming_unused_options():
    """node2 slots=1, node1 slots=2 with the launcher on node1: Open MPI's
    own-node-first mapping gave rank 1 local rank 1 on node1, and the error
    blamed --launcher_args the user never gave."""
    plan = _two_hosts("node2", "node1", (False, True))
    moved = {0: _hello("node1", 0), 1: _hello("node1", 1), 2: _hello("node2", 0)}
    problem = placement_problem(plan, moved, "mpirun", "node1")
    assert problem is not None and "--launcher_args" not in problem
    assert placement_problem(plan, {0: _hello("node2", 0), 1: _hello("node1", 0),
                                    2: _hello("node1", 1)}, "mpirun", "node1") is None


@pytest.mark.parametrize("tail, expected", [
    # Open MPI frames its message in rules: the ssh line, not the last rule
    # nor its generic summary
    (["ssh: Could not resolve hostname nosuch: Name or service not known",
      "--------------------------------------------------------------------------",
      "ORTE was unable to reliably start one or more daemons.",
      "--------------------------------------------------------------------------"],
     "ssh: Could not resolve hostname nosuch: Name or service not known"),
    # srun: its complaint, not the pointer to --help after it
    (["srun: unrecognized option '--bogus'", 'Try "srun --help" for more information'],
     "srun: unrecognized option '--bogus'"),
    (["starting", "=====", ""], "starting"),
    (["-----"], ""),
    ([], ""),
    # the cause, then more output than the kept tail holds
    (["srun: error: Unable to allocate resources", *[f"line {i}" for i in range(50)]],
     "srun: error: Unable to allocate resources"),
    # an Open MPI box that names no problem in a telling word: its opening
    # paragraph, not its last word ("launch."), however long the box
    ([RULE, "There are not enough slots available in the system to satisfy the 4",
      "slots that were requested by the application:", "", "  python", "",
      *[f"Either request fewer slots, line {i} of the help" for i in range(30)],
      "number of available slots when deciding the number of processes to", "launch.", RULE],
     "There are not enough slots available in the system to satisfy the 4 slots that were "
     "requested by the application:"),
    # two boxes: the last one (a warning before it is not the reason mpirun stopped)
    ([RULE, "The following command line options and corresponding MCA parameter have",
      "been deprecated and replaced as follows:", "", "  Deprecated:  --bynode", RULE,
      RULE, "All nodes which are allocated for this job are already filled.", RULE],
     "All nodes which are allocated for this job are already filled."),
    # a telling line still wins over a box
    ([RULE, "A box about something.", RULE, "mpirun: Error: unknown option \"--x\""],
     "mpirun: Error: unknown option \"--x\""),
])
def test_the_failure_summary_quotes_the_telling_line(tail: list[str], expected: str) -> None:
    from dsrun.launcher.backends.connect import ToolOutput

    output = ToolOutput(keep=20)
    for line in tail:
        output.add(line)
    assert output.summary() == expected


def test_stderrs_telling_line_wins_whatever_order_the_pipes_were_read() -> None:
    """Two threads read stdout and stderr: a help block on stdout may come in
    first, the cause on stderr is still the summary."""
    from dsrun.launcher.backends.connect import ToolOutput

    output = ToolOutput(keep=20)
    output.add("ORTE was unable to reliably start one or more daemons.", 1)
    output.add("ssh: Could not resolve hostname nosuch: Name or service not known", 2)
    output.add("error: a later line", 2)
    assert output.summary().startswith("ssh: Could not resolve hostname")
    only_stdout = ToolOutput(keep=20)
    only_stdout.add("mpirun was unable to launch", 1)
    only_stdout.add("help text", 1)
    assert only_stdout.summary() == "mpirun was unable to launch"


def test_orted_not_found_on_a_host_names_the_prefix_to_pass(tmp_path) -> None:
    """mpirun runs by its name, so Open MPI no longer implies
    --prefix from its path; a host whose login PATH lacks orted fails with
    "bash: orted: command not found", and the error says what to pass."""
    from dsrun.launcher.backends.connect import LaunchTool, ToolOutput
    from dsrun.launcher.backends.openmpi import prefix_advice

    output = ToolOutput(keep=20)
    for line in ["bash: orted: command not found", RULE,
                 "ORTE was unable to reliably start one or more daemons.",
                 "This usually is caused by:", *[f"help line {i}" for i in range(30)], RULE]:
        output.add(line)
    summary = output.summary()
    assert summary == "bash: orted: command not found"
    advice = prefix_advice(summary, "/opt/openmpi/bin/mpirun")
    assert advice == ("a host's non-interactive login PATH lacks Open MPI's daemon (orted): "
                      "pass --launcher_args \"--prefix /opt/openmpi\" (the Open MPI "
                      "installation of /opt/openmpi/bin/mpirun; the same path on every "
                      "host), or put its bin directory on that PATH")
    assert "--prefix /opt/ompi5" in prefix_advice("bash: line 1: prted: command not found",
                                                  "/opt/ompi5/bin/mpirun")
    assert "--prefix /home/u/ompi" in prefix_advice("sh: 1: orted: not found",
                                                    "/home/u/ompi/bin/mpirun")
    # a system install is on every login PATH: no --prefix /usr (it would put
    # /usr/bin ahead of a venv), but the install itself
    assert "install Open MPI (the version of /usr/bin/mpirun) on every host" in \
        prefix_advice(summary, "/usr/bin/mpirun")
    # other failures get no advice
    assert prefix_advice("ssh: Could not resolve hostname nosuch", "/opt/o/bin/mpirun") == ""
    assert prefix_advice("mpirun: Error: unknown option \"--x\"", "/opt/o/bin/mpirun") == ""
    # another command a remote login script did not find is no sign of orted
    assert prefix_advice("bash: module: command not found", "/opt/o/bin/mpirun") == ""
    # and the launcher's error carries it (a real process standing in for mpirun)
    tool = LaunchTool("mpirun", ["sh", "-c", "echo 'bash: orted: command not found' >&2; "
                                             "exit 1"], {"PATH": os.environ["PATH"]},
                      str(tmp_path), lambda *a: None,
                      advice=lambda s: prefix_advice(s, "/opt/openmpi/bin/mpirun"))
    tool.proc.wait()
    text = tool.exit_text(" before 2 agents connected back")
    assert text.startswith("mpirun exited with status 1 before 2 agents connected back: "
                           "bash: orted: command not found; a host's non-interactive")
    assert '--launcher_args "--prefix /opt/openmpi"' in text


def _agent_side(sock, secret: str, rank: int) -> None:
    """The agent's half of the handshake (callback.agent_connect, on a given socket)."""
    from dsrun.launcher import callback, protocol

    challenge = protocol.decode(callback.read_line(sock))["challenge"]
    sock.sendall(protocol.encode({"ev": "connect", "rank": rank, "local_rank": 0,
                                  "host": "h", "challenge": "c",
                                  "proof": callback.proof(secret, "agent", challenge, rank)}))


def test_an_agent_connecting_after_the_start_was_given_up_is_closed_quietly(caplog):
    """Ctrl-C while agents connect back closed the server; an
    agent finishing its handshake then was 'refused ... unexpected rank 0'
    as a bare warning. It is closed without a warning (the launcher says
    why the job stopped); a wrong rank while the server is open still warns."""
    import logging
    import socket
    import threading

    from dsrun.launcher.backends.connect import CallbackServer

    server = CallbackServer(2)
    try:
        caplog.set_level(logging.DEBUG, logger="dsrun.launcher")
        for rank, closed in ((5, False), (0, True)):
            if closed:
                server.close(keep=False)
            ours, theirs = socket.socketpair()
            agent = threading.Thread(target=_agent_side, args=(theirs, server.secret, rank))
            agent.start()
            server._handshake(ours, "peer")
            agent.join(5)
            theirs.settimeout(5)
            assert callback_reply_then_eof(theirs)
            theirs.close()
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert warnings == ["refused an agent connection from peer: unexpected rank 5"]
        assert server.problems == ["peer: unexpected rank 5"] and server.hellos == {}
    finally:
        server.close(keep=False)


def callback_reply_then_eof(sock) -> bool:
    """The server answered the handshake, then closed the connection."""
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data.count(b"\n") == 1 and b"proof" in data


def test_a_slurm_job_on_other_hosts_gets_the_working_directory_first(tmp_path, monkeypatch,
                                                                      capsys):
    """As under ssh and mpirun (and DeepSpeed's SlurmRunner): a script's
    `import mypkg` from the launcher's working directory works on every rank.
    srun passes the whole environment, so nothing else is forwarded by name."""
    from dsrun.launcher import cli
    from dsrun.launcher import hostfile as hf

    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bindir / "srun").chmod(0o755)
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "sub" / "t.py").write_text("import mypkg\n")
    (work / "hf").write_text("node-a slots=1\nnode-b slots=1\n")
    monkeypatch.setattr(hf, "DEFAULT_JOB_HOSTFILE", str(tmp_path / "no-job-hostfile"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", "/site/extra")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    for name in ("SLURM_JOB_ID", "DS_ENV_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(work)
    assert cli.main(["--dry-run", "--cpu", "--launcher", "slurm", "--slurm_args=--time=5",
                     "-H", "hf", "sub/t.py"]) == 0
    out = capsys.readouterr().out
    srun = next(line for line in out.splitlines() if line.startswith(f"launch: {bindir}/srun"))
    export = next(w for w in srun.split() if w.startswith("--export="))
    assert export.split(",")[-1] == "PYTHONPATH" and "NCCL_DEBUG" not in export
    assert "PYTHONPATH=<value not shown> (forwarded, the working directory first)" in out
    from dsrun.launcher import launch

    cluster = Cluster("hf", ("node-a", "node-b"), ((0,), (0,)), (False, False), "slurm")
    env = launch.user_env(LaunchSpec(script="sub/t.py"), str(work), remote=cluster.remote,
                          multi_host=True, forward=False)
    assert env.as_dict() == {"PYTHONPATH": f"{work}:/site/extra"}


@pytest.fixture
def in_allocation(tmp_path, monkeypatch):
    """Inside `salloc --nodes=2 --ntasks-per-node=2` (two CPUs per node
    unless a test says otherwise), with an srun on PATH and no hostfile."""
    from dsrun.launcher import hostfile as hf

    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bindir / "srun").chmod(0o755)
    monkeypatch.setattr(hf, "DEFAULT_JOB_HOSTFILE", str(tmp_path / "no-job-hostfile"))
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]",
                        "SLURM_JOB_CPUS_PER_NODE": "2(x2)", "SLURM_NTASKS_PER_NODE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_GPUS_ON_NODE", raising=False)
    monkeypatch.delenv("SLURM_GPUS_PER_NODE", raising=False)
    return str(tmp_path)


def _selected(cwd: str, **kw) -> list[tuple[str, tuple[int, ...]]]:
    from dsrun.launcher.cluster import resolve_cluster

    cluster, _ = resolve_cluster(HostsSpec(launcher="slurm", cpu=True, **kw), cwd)
    return list(zip(cluster.hosts, cluster.slots))


@pytest.mark.parametrize("kw,expected", [
    ({"include": "node1:0"}, [("node1", (0,))]),
    ({"exclude": "node1:1"}, [("node1", (0,)), ("node2", (0, 1))]),
    ({"include": "node2:1@node1:0"}, [("node1", (0,)), ("node2", (1,))]),
    ({"include": "node2"}, [("node2", (0, 1))]),
    ({}, [("node1", (0, 1)), ("node2", (0, 1))]),
])
def test_slot_selections_inside_an_allocation_apply_to_its_slots(in_allocation, kw,
                                                                  expected):
    """SLURM_NTASKS_PER_NODE was applied as if the user had given --num_gpus 2,
    so every slot-level --include/--exclude failed with '--num_gpus 2 asks
    for more slots than available'."""
    assert _selected(in_allocation, **kw) == expected


def test_the_allocations_ranks_per_host_bound_an_exclusion(in_allocation, monkeypatch):
    """More slots than tasks per node: at most SLURM_NTASKS_PER_NODE ranks on
    a host after --exclude; slots --include names all run."""
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "4(x2)")
    assert _selected(in_allocation, exclude="node1:1") == [("node1", (0, 2)),
                                                           ("node2", (0, 1))]
    assert _selected(in_allocation, include="node1:0,1,2@node2") == [("node1", (0, 1, 2)),
                                                                     ("node2", (0, 1))]
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")  # --ntasks-per-node=8 --gpus-per-node=8
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8")
    from dsrun.launcher.cluster import resolve_cluster

    cluster, _ = resolve_cluster(HostsSpec(launcher="slurm", exclude="node1:7"), in_allocation)
    assert cluster.slots == (tuple(range(7)), tuple(range(8)))


def test_a_num_gpus_the_user_gave_is_still_checked_inside_an_allocation(in_allocation):
    with pytest.raises(SelectionError, match=r"^--num_gpus 2 asks for more slots than "
                                             r"available after --include 'node1:0'"):
        _selected(in_allocation, include="node1:0", num_gpus=2)
