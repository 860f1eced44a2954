"""Where dsrun's launcher met DeepSpeed's runner half-way and now matches it:
env-file expansion, which jobs take DeepSpeed's env files, programs named
like commands, forwarded prefixes, the dry-run's port, empty option values
(pure, or through cli.main with --dry-run: nothing starts)."""

from __future__ import annotations

import socket

import pytest

from dsrun.errors import DsrunUsageError, HostfileError
from dsrun.launcher import cli, launch
from dsrun.launcher import hostfile as hf
from dsrun.launcher.backends.base import agent_payload
from dsrun.launcher.backends.connect import tool_environment
from dsrun.launcher.backends.openmpi import env_names
from dsrun.launcher.cluster import Cluster
from dsrun.launcher.envlayers import apply_layers, expand_references
from dsrun.launcher.envpolicy import JobEnv, job_env, parse_env_file
from dsrun.launcher.plan import NodeFacts, build_plan, describe
from dsrun.launcher.rankenv import materialize, rank_env
from dsrun.launcher.spec import HostsSpec, LaunchSpec

FILE = ("PATH=/opt/bin:$PATH\n"
        'LD_LIBRARY_PATH="/opt/lib:${LD_LIBRARY_PATH}"\n'
        "LITERAL='$PATH'\n"
        "CUDA_HOME=/cuda\n"
        "CUDA_BIN=$CUDA_HOME/bin:$NOT_SET_ANYWHERE\n"
        "PLAIN=no references\n")
HOST = {"PATH": "/host/bin", "LD_LIBRARY_PATH": "/host/lib", "CUDA_HOME": "/host-cuda"}


def _plan(env: JobEnv, hosts=("here",), local=(True,), launcher="local", port=None,
          facts=None, master=("127.0.0.1", 4242)):
    spec = LaunchSpec(script="t.py", master_port=port)
    cluster = Cluster("hf", hosts, tuple((0,) for _ in hosts), local, launcher)
    return build_plan(spec, cluster, env, "job", facts=facts or [NodeFacts((), 2)] * len(hosts),
                      python="/py", cwd="/w", master=master)


def test_expand_references_takes_name_and_braced_name_only():
    environ = {"PATH": "/usr/bin", "A": "a"}
    assert expand_references("/opt/bin:$PATH", environ) == "/opt/bin:/usr/bin"
    assert expand_references("${A}x $Ax $UNSET/y", environ) == "ax  /y"
    kept = "$$ $1 ${A:-d} `id` $(id) cost: $ ${}"
    assert expand_references(kept, environ) == kept


def test_env_file_values_expand_against_the_hosts_environment_in_file_order():
    """`PATH=/opt/bin:$PATH` in .deepspeed_env gave ranks a literal `$PATH`;
    DeepSpeed's remote shell expands it against that host's environment."""
    env = job_env({}, remote=True, file_entries=parse_env_file(FILE, "/w/.deepspeed_env"),
                  cli_env=(("FROM_CLI", "$PATH"),))
    plan = _plan(env)
    node, slot = plan.nodes[0], plan.nodes[0].ranks[0]
    out = materialize(rank_env(plan, node, slot), HOST, plan.user_env, {})
    assert out["PATH"] == "/opt/bin:/host/bin"
    assert out["LD_LIBRARY_PATH"] == "/opt/lib:/host/lib"
    assert out["LITERAL"] == "$PATH"  # single quotes: literal, as in a shell
    assert out["CUDA_BIN"] == "/cuda/bin:"  # an earlier line counts; unset: empty
    assert out["PLAIN"] == "no references"
    assert out["FROM_CLI"] == "$PATH"  # --env: the launcher's shell has expanded it
    # the agent's own path: the start payload, applied as agent.py does
    payload = agent_payload(plan, node)
    assert payload["env"]["PATH"] == "/opt/bin:$PATH"  # expanded on the host, not here
    rank = payload["ranks"][0]
    assert apply_layers(rank["env"], HOST, payload["env"], {}, payload["env_files"]) == out
    assert "expanded on the host" in " ".join(plan.user_env.describe())


def test_a_job_without_references_sends_the_same_payload_as_before():
    env = job_env({}, remote=True, file_entries=parse_env_file("A=1\nB='$x'\n", "/f"))
    assert "env_files" not in agent_payload(_plan(env), _plan(env).nodes[0])


def test_mpirun_and_srun_leave_expanded_values_to_the_agents():
    """mpirun -x / srun --export would hand the agents the literal value as
    part of their own environment, which the expansion then reads."""
    env = job_env({}, remote=False, file_entries=parse_env_file(FILE, "/w/.deepspeed_env"))
    plan = _plan(env, hosts=("n1", "n2"), local=(True, False), launcher="openmpi")
    names = env_names(plan)
    assert "PATH" not in names and "CUDA_BIN" not in names
    assert {"CUDA_HOME", "LITERAL", "PLAIN"} <= set(names)
    tool = tool_environment(plan, {"PATH": "/launcher/bin"})
    assert tool["PATH"] == "/launcher/bin" and tool["PLAIN"] == "no references"


@pytest.fixture
def two_dirs(tmp_path, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setattr(hf, "DEFAULT_JOB_HOSTFILE", str(tmp_path / "no-job-hostfile"))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    monkeypatch.chdir(work)
    (work / "t.py").write_text("pass\n")
    return home, work


def test_deepspeed_env_files_apply_only_to_jobs_on_several_hosts(two_dirs, capsys):
    """DeepSpeed reads ~/.deepspeed_env only on its multi-node path: a local
    job there ignores cluster settings such as GLOO_SOCKET_IFNAME=ib0."""
    home, work = two_dirs
    (home / ".deepspeed_env").write_text("GLOO_SOCKET_IFNAME=ib0\n")
    (work / ".deepspeed_env").write_text("CWD_DS=1\n")
    (work / ".dsrun_env").write_text("OWN=1\n")
    assert cli.main(["--dry-run", "--cpu", "t.py"]) == 0
    out = capsys.readouterr().out
    assert "GLOO_SOCKET_IFNAME" not in out and "CWD_DS" not in out
    assert f"OWN=<value not shown> ({work}/.dsrun_env:1)" in out  # dsrun's own: every job
    notes = [line for line in out.splitlines() if "not applied" in line]
    assert notes == [f"env file {home}/.deepspeed_env, {work}/.deepspeed_env not applied: "
                     f"DeepSpeed's env files apply only to jobs on several hosts or on "
                     f"another host, as in DeepSpeed (./.dsrun_env or --env sets variables "
                     f"for a job on this host)"]
    (work / "hf").write_text("localhost slots=1\nnode-x slots=1\n")
    assert cli.main(["--dry-run", "--cpu", "-H", "hf", "t.py"]) == 0
    out = capsys.readouterr().out
    assert f"GLOO_SOCKET_IFNAME=<value not shown> ({home}/.deepspeed_env:1)" in out
    assert "CWD_DS=<value not shown>" in out and "not applied" not in out


@pytest.mark.parametrize("argv,script,module,no_python", [
    (["--num_gpus", "1", "-m", "run"], "run", True, False),
    (["--module", "plot"], "plot", True, False),
    (["run", "--num_gpus", "1", "--module", "plot"], "plot", True, False),
    (["--no_python", "stack", "build"], "stack", False, True),
    (["run", "hosts", "x"], "hosts", False, False),
    (["run", "--cpu", "-m", "doctor"], "doctor", True, False),
])
def test_a_program_named_like_a_command_is_the_program(two_dirs, monkeypatch, capsys, argv,
                                                       script, module, no_python):
    """-m NAME is a module and --no_python NAME a program on PATH, and after
    an explicit `run` SCRIPT is never a command; these were all refused."""
    seen = []
    monkeypatch.setattr(launch, "run", lambda spec: seen.append(spec) or 0)
    assert cli.main(argv) == 0, capsys.readouterr().err
    (spec,) = seen
    assert (spec.script, spec.module, spec.no_python) == (script, module, no_python)


def test_a_bare_command_name_after_options_is_still_taken_for_the_command(two_dirs, capsys):
    assert cli.main(["--num_gpus", "1", "plot", "m.csv"]) == 2
    err = capsys.readouterr().err
    assert "commands come first: `dsrun plot m.csv`" in err
    assert "(left out: --num_gpus" in err
    # `dsrun --cpu run -m doctor`: the suggested command runs the module
    assert cli.main(["--cpu", "run", "-m", "doctor"]) == 2
    assert "commands come first: `dsrun run --cpu -m doctor`" in capsys.readouterr().err


def test_dry_run_shows_an_explicit_master_port(two_dirs, capsys):
    """--dry-run printed '<free port chosen at launch>' for --master_port 29555."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert cli.main(["--dry-run", "--cpu", "--master_port", str(port), "t.py"]) == 0
    out = capsys.readouterr().out
    assert f"master 127.0.0.1:{port}" in out and f"    MASTER_PORT={port}\n" in out
    draft = _plan(JobEnv(), hosts=("a", "b"), local=(False, False), launcher="ssh",
                  port=29555, facts=[None, None], master=None)
    assert draft.master_port == 29555 and draft.master_addr is None
    assert describe(draft)[0].endswith(":29555")


def test_empty_strings_are_deepspeeds_defaults_not_values():
    """Wrappers pass --include "$INCLUDE"; DeepSpeed's defaults are ''."""
    spec = cli.parse_spec(["--include", "", "--exclude", "", "--master_addr", "", "t.py"])
    assert (spec.include, spec.exclude, spec.master_addr) == (None, None, None)
    ctx = cli.doctor_command.make_context("dsrun doctor", ["--include", "", "--master_addr", ""])
    hosts = cli.hosts_spec_from_params(ctx.params)
    assert (hosts.include, hosts.master_addr) == (None, None)


def test_launcher_args_with_pdsh_names_pdsh_not_srun():
    with pytest.raises(DsrunUsageError) as info:
        HostsSpec(launcher="pdsh", launcher_args=("-f", "64"))
    assert "pdsh options" in str(info.value) and "--slurm_args" not in str(info.value)
    with pytest.raises(DsrunUsageError, match="srun options go in --slurm_args"):
        HostsSpec(launcher="slurm", launcher_args=("-x",))


def test_user_at_host_in_a_hostfile_points_to_ssh_user():
    with pytest.raises(HostfileError, match=r"invalid host 'admin@node1': 'USER@HOST' is not "
                                            r"supported: write the host alone \(node1\) and "
                                            r"give the user with --ssh_user admin"):
        hf.parse_hostfile("admin@node1 slots=2\n", "hf")


def test_log_dir_naming_a_file_says_so(tmp_path):
    path = tmp_path / "afile"
    path.write_text("")
    with pytest.raises(DsrunUsageError, match=r"^--log_dir '.*afile' is a file, not a "
                                              r"directory$"):
        launch.check_log_dir(str(path))


def test_launcher_args_with_the_default_launcher_names_neither_pdsh_nor_ssh_alone():
    with pytest.raises(DsrunUsageError) as info:
        HostsSpec(launcher_args=("-f", "64"))
    text = str(info.value)
    assert "not the default launcher;" in text and "this host itself" in text
    assert "(DeepSpeed's pdsh)" not in text
