"""CLI parsing: options before the script, everything after it untouched."""

from __future__ import annotations

import shlex
import sys

import click
import pytest

from dsrun.errors import DsrunUsageError
from dsrun.launcher import cli, cli_hints
from dsrun.launcher.spec import LaunchSpec


def test_script_args_with_colliding_flags_pass_through_untouched():
    spec = cli.parse_spec(["--num_gpus", "2", "train.py", "--num_gpus", "7", "--lr", "1e-3",
                           "-m", "--master_port=1", "--", "x"])
    assert spec.num_gpus == 2
    assert spec.module is False and spec.master_port is None
    assert spec.script == "train.py"
    assert spec.script_args == ("--num_gpus", "7", "--lr", "1e-3", "-m", "--master_port=1",
                                "--", "x")


def test_all_options_parse_into_the_spec():
    spec = cli.parse_spec([
        "--num_gpus", "3", "--master_addr", "10.0.0.1", "--master_port", "1234", "-m",
        "--log_dir", "/tmp/l", "--dry-run", "--max_restarts", "2", "--kill_grace", "0.5",
        "--dist_backend", "gloo", "--env", "A=1", "--env", "B=x=y", "pkg.mod", "arg"])
    assert spec == LaunchSpec(
        script="pkg.mod", script_args=("arg",), module=True, num_gpus=3,
        master_addr="10.0.0.1", master_port=1234, log_dir="/tmp/l", dry_run=True,
        max_restarts=2, kill_grace=0.5, dist_backend="gloo",
        extra_env=(("A", "1"), ("B", "x=y")))


def test_minus_one_is_deepspeeds_all():
    spec = cli.parse_spec(["--num_gpus", "-1", "--num_nodes", "-1", "s.py"])
    assert (spec.hosts.num_gpus, spec.hosts.num_nodes) == (None, None)


def test_dashed_spellings_are_accepted():
    spec = cli.parse_spec(["--num-gpus", "2", "--master-port", "99", "s.py"])
    assert (spec.num_gpus, spec.master_port) == (2, 99)


@pytest.mark.parametrize("argv,message", [
    (["--num_gpus", "0", "s.py"], r"--num_gpus must be at least 1 \(or -1: all, as in "
                                  r"DeepSpeed\), got 0"),
    (["--num_gpus", "-2", "s.py"], "--num_gpus must be at least 1 .*got -2"),
    (["--num_nodes", "-3", "s.py"], "--num_nodes must be at least 1 .*got -3"),
    (["--num_gpus", "99999999999", "s.py"], "--num_gpus must be at most 1024 .*got 99999999999"),
    (["--master_port", "70000", "s.py"], "--master_port must be in 1..65535"),
    (["-m", "--no_python", "s.py"], "--module and --no_python cannot be used together"),
    (["--max_restarts", "-1", "s.py"], "--max_restarts must be >= 0"),
])
def test_bad_values_are_usage_errors(argv, message):
    with pytest.raises(DsrunUsageError, match=message):
        cli.parse_spec(argv)


@pytest.mark.parametrize("argv", [["--bogus", "s.py"], ["--num_gpus", "two", "s.py"], [],
                                  ["--env", "NOEQUALS", "s.py"],
                                  ["--dist_backend", "mpich", "s.py"]])
def test_click_level_errors(argv):
    with pytest.raises(click.UsageError):
        cli.parse_spec(argv)


def test_main_prints_one_error_line_and_exits_2(capsys):
    assert cli.main(["--bogus", "s.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dsrun: error: No such option '--bogus'. (see dsrun --help)"]


@pytest.mark.parametrize(("argv", "advice"), [
    (["--enable_each_rank_log", "logs", "train.py"], "is dsrun's --log_dir DIR"),
    (["--autotuning", "tune", "train.py"], "Not implemented (DeepSpeed's autotuner)"),
    (["--force_multi", "train.py"], "Not needed"),
    (["--elastic_training", "train.py"], "--max_restarts N"),
])
def test_deepspeed_only_launcher_flags_say_what_to_do(argv, advice, capsys):
    assert cli.main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"dsrun: error: No such option '{argv[0]}' (a DeepSpeed launcher "
                           "flag). ")
    assert "Did you mean" not in line
    assert advice in line and line.endswith(". (see dsrun --help)")


def test_main_missing_script_exits_2(tmp_path, capsys):
    assert cli.main([str(tmp_path / "nope.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main([str(tmp_path)]) == 2
    assert "is a directory without a __main__.py" in capsys.readouterr().err
    assert cli.main(["--no_python", str(tmp_path)]) == 2
    assert "is not a file" in capsys.readouterr().err


def test_warns_about_dsrun_flags_after_the_script(capsys):
    seen = cli.warn_flags_after_script(["--lr", "1", "--num_gpus", "2", "--num_gpus=3",
                                        "--hostfile=h", "--ssh-port", "2"])
    assert seen == ["--num_gpus", "--hostfile", "--ssh-port"]
    err = capsys.readouterr().err
    assert err.count("warning") == 3 and "passed to the script" in err


def test_no_warning_for_flags_scripts_commonly_take(capsys):
    common = ["--config", "x.yaml", "--timeout", "5", "--log_dir", "l", "--env", "prod",
              "--dry-run", "--cpu", "--dist_backend", "gloo", "--master_addr", "a",
              "--master_port=5", "--include", "x", "--exclude", "y", "-m", "--module"]
    assert cli.warn_flags_after_script(common) == []
    assert capsys.readouterr().err == ""
    every = {p.name for p in cli.run_command.params if isinstance(p, click.Option)}
    assert cli_hints.WARN_AFTER_SCRIPT <= every  # no stale names


def test_subcommand_names_win_over_files_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("run", "hosts", "doctor", "stack"):
        (tmp_path / name).write_text("print(1)\n")
        command, rest = cli._dispatch([name, "x"])
        assert command is cli.load_command(name) and rest == ["x"], name
        # the documented ways to run such a file as the script
        assert cli._dispatch([f"./{name}", "x"]) == (cli.run_command, [f"./{name}", "x"])
        assert cli._dispatch(["run", name]) == (cli.run_command, [name])
    (tmp_path / "hostfile").write_text("worker-1 slots=2\n")
    assert cli.main(["hosts", "list"]) == 0  # not "python hosts list"


def test_usage_error_of_a_command_named_like_a_file_says_how_to_run_the_file(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").write_text("print(1)\n")
    assert cli.main(["hosts", "frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "see dsrun hosts --help" in err
    assert "'dsrun ./hosts' or 'dsrun run hosts'" in err


def test_help_lists_every_registered_command(monkeypatch, capsys):
    @click.command("zzz-extra")
    def extra() -> None:
        """A command another module registers."""

    monkeypatch.setitem(cli.SUBCOMMANDS, "zzz-extra", f"{__name__}:_EXTRA")
    monkeypatch.setitem(globals(), "_EXTRA", extra)
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    commands = out.split("Commands:", 1)[1]
    for name in ("run", "hosts", "doctor", "stack", "zzz-extra"):
        assert f"  {name} " in commands, name
    assert "A command another module registers." in commands
    assert "./hosts" in " ".join(commands.split())  # the naming rule, where users look


def test_version(capsys):
    from dsrun import DSRUN_VERSION

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dsrun {DSRUN_VERSION}"


@pytest.mark.parametrize("argv", [["-h"], ["hosts", "-h"], ["hosts", "add", "-h"],
                                  ["hosts", "list", "-h"], ["hosts", "fmt", "-h"],
                                  ["doctor", "-h"], ["stack", "-h"], ["run", "-h"]])
def test_dash_h_works_on_every_command(argv, capsys):
    assert cli.main(argv) == 0
    assert "Usage:" in capsys.readouterr().out


def test_usage_error_of_a_subcommand_points_to_its_own_help(capsys):
    assert cli.main(["hosts", "add", "worker-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dsrun: error: Missing option '--slots'")
    assert err.endswith("(see dsrun hosts add --help)")


def test_broken_subcommand_import_is_reported_not_taken_for_a_script(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "dsrun.launcher.hosts_cli", None)  # import fails
    assert cli.main(["hosts", "list"]) == 1
    err = capsys.readouterr().err
    assert "the 'hosts' command cannot be loaded: ModuleNotFoundError" in err
    assert "does not exist" not in err


@pytest.mark.parametrize("argv,message", [
    (["--no_local_rank", "--local_rank_arg", "t.py"], "--no_local_rank contradicts"),
    (["--timeout", "0", "t.py"], "--timeout must be > 0"),
    (["--heartbeat_timeout", "-1", "t.py"], "--heartbeat_timeout must be >= 0"),
    (["--heartbeat_timeout", "0.2", "t.py"], "too short"),
])
def test_new_option_values_are_checked(argv, message):
    with pytest.raises(DsrunUsageError, match=message):
        cli.parse_spec(argv)


def test_new_options_parse():
    spec = cli.parse_spec(["--no_local_rank", "--timeout", "90", "--heartbeat_timeout", "0",
                           "t.py"])
    assert (spec.no_local_rank, spec.timeout, spec.heartbeat_timeout) == (True, 90.0, 0.0)
    assert cli.parse_spec(["t.py"]).heartbeat_timeout == 15.0


@pytest.mark.parametrize("argv,expected", [
    (["--local_rank_arg", "t.py"], "--local_rank"),
    (["--local-rank-arg", "t.py"], "--local-rank"),
    (["t.py"], None),
])
def test_local_rank_arg_option(argv, expected):
    spec = cli.parse_spec(argv)
    assert spec.local_rank_arg == expected and spec.script == "t.py"


def test_config_option_must_exist(tmp_path):
    with pytest.raises(click.UsageError, match="does not exist"):
        cli.parse_spec(["--config", str(tmp_path / "nope.json"), "t.py"])
    cfg = tmp_path / "c.json"
    cfg.write_text("{}")
    assert cli.parse_spec(["--config", str(cfg), "t.py"]).config == str(cfg)


def test_dry_run_names_the_hostfile_it_uses(tmp_path, monkeypatch, capsys):
    from dsrun.launcher import hostfile as hf

    monkeypatch.setattr(hf, "DEFAULT_JOB_HOSTFILE", str(tmp_path / "no-job-hostfile"))
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    assert cli.main(["--dry-run", "--cpu", str(script)]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(
        "no hostfile: this host only")
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    assert cli.main(["--dry-run", "--cpu", str(script)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"hostfile: {tmp_path / 'hostfile'} (found in the working "
                            f"directory; -H names another")
    other = tmp_path / "other"
    other.write_text("localhost slots=1\n")
    assert cli.main(["--dry-run", "--cpu", "-H", str(other), str(script)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"hostfile: {other} (-H)"


def test_dev_null_runs_here_despite_a_hostfile_found_here(tmp_path, monkeypatch, capsys):
    from dsrun.launcher import hostfile as hf

    monkeypatch.setattr(hf, "DEFAULT_JOB_HOSTFILE", str(tmp_path / "no-job-hostfile"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hostfile").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    (tmp_path / "t.py").write_text("pass\n")
    assert cli.main(["--dry-run", "--cpu", "-H", "/dev/null", "t.py"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "no hostfile: this host only (-H /dev/null)"
    assert "worker-0" not in "\n".join(out)
    assert cli.main(["--dry-run", "--cpu", "-H", "none", "t.py"]) == 2  # only /dev/null
    assert "none' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_ssh_launcher_without_a_hostfile_is_a_local_job(launcher, tmp_path, monkeypatch):
    """DeepSpeed's ``--launcher pdsh`` on one host runs locally: a shared
    launch script keeps working on a single box."""
    from dsrun.launcher import hostfile as hf

    monkeypatch.setattr(hf, "DEFAULT_JOB_HOSTFILE", str(tmp_path / "no-job-hostfile"))
    monkeypatch.chdir(tmp_path)
    from dsrun.launcher.cluster import resolve_cluster

    spec = cli.parse_spec(["--cpu", "--launcher", launcher, "t.py"])
    cluster, backend = resolve_cluster(spec.hosts, str(tmp_path))
    assert backend.name == "local" and len(cluster.hosts) == 1
    (tmp_path / "hostfile").write_text("localhost slots=2\n")  # with one: over ssh
    assert resolve_cluster(spec.hosts, str(tmp_path))[1].name == "ssh"


def test_a_group_named_alone_prints_its_help(capsys):
    assert cli.main(["hosts"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("Usage: dsrun hosts") and "add" in captured.out
    assert captured.err == ""


def test_deepspeeds_cpu_variable_asks_for_cpu_ranks(tmp_path, monkeypatch, capsys):
    """``DS_ACCELERATOR=cpu dsrun ...`` on a GPU host: CPU ranks, as with --cpu."""
    from dsrun.launcher import hostfile as hf

    monkeypatch.setattr(hf, "DEFAULT_JOB_HOSTFILE", str(tmp_path / "no-job-hostfile"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSRUN_FAKE_GPUS", "1")
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    assert cli.main(["--dry-run", "--num_gpus", "1", str(script)]) == 0
    assert "DSRUN_ACCELERATOR=cpu" not in capsys.readouterr().out
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert cli.main(["--dry-run", "--num_gpus", "2", str(script)]) == 0
    out = capsys.readouterr().out
    assert "devices [cpu]" in out and "    DSRUN_ACCELERATOR=cpu" in out


@pytest.mark.parametrize("option", ["--kill_grace", "--timeout", "--heartbeat_timeout",
                                    "--ssh_timeout"])
@pytest.mark.parametrize("value,message", [
    ("nan", "must be a finite number of seconds, got nan"),
    ("inf", "must be a finite number of seconds, got inf"),
    ("-inf", "must be a finite number of seconds, got -inf"),
    ("-1", "must be (>=|>) 0 seconds, got -1"),
    ("1e300", "must be at most 1e\\+08 seconds"),
])
def test_every_seconds_option_refuses_nan_infinite_negative_and_huge(option, value, message):
    """A NaN grace never expires (every comparison with NaN is false): a job
    whose ranks ignore SIGTERM would never be stopped."""
    with pytest.raises(DsrunUsageError, match=f"^{option} {message}"):
        cli.parse_spec([option, value, "t.py"])


def test_every_float_option_of_run_is_checked():
    """A new float option must join the test above."""
    floats = {p.opts[0] for p in cli.run_command.params
              if isinstance(p, click.Option) and p.type is click.FLOAT}
    assert floats == {"--kill_grace", "--timeout", "--heartbeat_timeout", "--ssh_timeout"}


@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_straggler_interval_variable_is_checked_before_anything_starts(value, tmp_path,
                                                                       monkeypatch, capsys):
    from dsrun.launcher import launch

    monkeypatch.setenv("DSRUN_STRAGGLER_INTERVAL", value)
    monkeypatch.setattr(launch, "resolve_cluster", pytest.fail)  # nothing may be started
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    assert cli.main(["--cpu", str(script)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("dsrun: error: DSRUN_STRAGGLER_INTERVAL (environment) must be")
    assert launch.straggler_interval({"DSRUN_STRAGGLER_INTERVAL": "0"}) is None
    assert launch.straggler_interval({}) == 30.0


@pytest.mark.parametrize("addr,message", [
    ("192.0.2.1", "--master_addr '192.0.2.1' is not an address of"),
    ("no-such-host.invalid", "--master_addr 'no-such-host.invalid' does not resolve"),
])
def test_a_master_addr_of_another_host_is_an_error_before_anything_starts(
        addr, message, tmp_path, monkeypatch, capsys):
    from dsrun.launcher import hostfile as hf

    monkeypatch.setattr(hf, "DEFAULT_JOB_HOSTFILE", str(tmp_path / "no-job-hostfile"))
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    for dry in ([], ["--dry-run"]):
        monkeypatch.setattr("dsrun.launcher.launch.ControlServer", pytest.fail)
        assert cli.main([*dry, "--cpu", "--master_addr", addr, str(script)]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"dsrun: error: {message}")
    assert cli.main(["--dry-run", "--cpu", "--master_addr", "localhost", str(script)]) == 0


def test_env_of_a_variable_dsrun_sets_is_an_error_even_in_a_dry_run(tmp_path, monkeypatch,
                                                                     capsys):
    from dsrun.launcher import hostfile as hf

    monkeypatch.setattr(hf, "DEFAULT_JOB_HOSTFILE", str(tmp_path / "no-job-hostfile"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("pass\n")
    assert cli.main(["--dry-run", "--cpu", "--env", "MASTER_ADDR=10.1.1.1", "t.py"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "dsrun: error: --env sets MASTER_ADDR, which dsrun sets for each rank: use "
        "--master_addr"]


#: Every option of DeepSpeed 0.19.8's launcher (deepspeed/launcher/runner.py).
DEEPSPEED_FLAGS = (
    "-H", "--hostfile", "-i", "--include", "-e", "--exclude", "--num_nodes", "--num_gpus",
    "--num_accelerators", "--master_port", "--master_addr", "--node_rank", "--launcher",
    "--launcher_args", "--module", "--no_python", "--no_local_rank", "--no_ssh",
    "--no_ssh_check", "--force_multi", "--save_pid", "--enable_each_rank_log", "--autotuning",
    "--bind_cores_to_rank", "--bind_core_list", "--ssh_port", "--venv_script", "--log_level",
    "-q", "--quiet")


def test_every_deepspeed_launcher_flag_is_taken_or_explained():
    taken = {opt for p in cli.run_command.params if isinstance(p, click.Option)
             for opt in p.opts}
    missing = [f for f in DEEPSPEED_FLAGS
               if f not in taken and f not in cli_hints.DEEPSPEED_ONLY_FLAGS]
    assert missing == []
    assert cli.parse_spec(["--num_accelerators", "3", "t.py"]).num_gpus == 3


def test_the_flag_list_is_deepspeeds(request):
    """Against DeepSpeed's runner.py where the benchmark venv has it."""
    import re

    runner = (request.config.rootpath / "bench" / ".venv-ds" / "lib" / "python3.11" /
              "site-packages" / "deepspeed" / "launcher" / "runner.py")
    if not runner.exists():
        pytest.skip("no DeepSpeed in bench/.venv-ds")
    source = runner.read_text()
    parser = source[source.index("def parse_args"):source.index("def fetch_hostfile")]
    found = set(re.findall(r"""["'](-{1,2}[A-Za-z][a-z_]*)["']""", parser))
    assert found == set(DEEPSPEED_FLAGS)


@pytest.mark.parametrize(("flag", "advice"), [
    ("--node_rank", "--include HOST runs on one host"), ("--no_ssh", "run dsrun once"),
    ("--venv_script", "Not needed"), ("--log_level", "no log levels"),
    ("-q", "no quiet mode"), ("--quiet", "no quiet mode")])
def test_deepspeed_flags_dsrun_lacks_say_what_to_use(flag, advice, capsys):
    assert cli.main([flag, "1", "train.py"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"dsrun: error: No such option '{flag}' (a DeepSpeed launcher flag)")
    assert advice in line and "Did you mean" not in line


@pytest.mark.parametrize("name,backend", [("SSH", "ssh"), ("Local", "local"),
                                          ("pdsh", "ssh"), ("PDSH", "ssh"),
                                          ("MPIRUN", "openmpi"), ("OpenMPI", "openmpi")])
def test_launcher_names_in_any_case_and_deepspeeds_pdsh(name, backend):
    assert cli.parse_spec(["--launcher", name, "t.py"]).backend == backend


@pytest.mark.parametrize("name", ["mvapich", "IMPI", "mpich"])
def test_deepspeeds_other_mpi_launchers_say_what_is_supported(name):
    with pytest.raises(DsrunUsageError, match=f"^--launcher '{name}' is not supported: dsrun "
                                              f"drives Open MPI's mpirun .*--launcher slurm"):
        cli.parse_spec(["--launcher", name, "t.py"])


def test_no_python_with_a_bare_name_in_the_cwd_but_not_on_path(tmp_path, monkeypatch, capsys):
    """The shell does not run ./run.sh for 'run.sh' either: it failed at launch with 127."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    run = tmp_path / "run.sh"
    run.write_text("#!/bin/sh\necho hi\n")
    run.chmod(0o755)
    assert cli.main(["--no_python", "--dry-run", "run.sh"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "dsrun: error: --no_python: 'run.sh' is not on PATH (a bare name is looked up there, "
        "as the shell does); did you mean ./run.sh?"]
    assert cli.main(["--no_python", "--dry-run", "nothere"]) == 2
    assert "--no_python: 'nothere' is not on PATH" in capsys.readouterr().err
    (tmp_path / "bin").mkdir()
    run.rename(tmp_path / "bin" / "run.sh")
    assert cli.main(["--no_python", "--dry-run", "--cpu", "run.sh"]) == 0


def test_a_directory_with_a_main_file_is_a_script(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("print(1)\n")
    assert cli.main(["--dry-run", "--cpu", "app"]) == 0


def test_stack_into_a_closed_pipe_exits_quietly_with_141(monkeypatch, capsys):
    """`dsrun stack | head -1` said "error: job ...: Broken pipe" and exited 1."""
    from dsrun.launcher import cli as cli_mod
    from dsrun.launcher import control

    def stream(path, write, timeout=30.0, note=None):
        write("[node1:0] first line")
        raise BrokenPipeError(32, "Broken pipe")

    discarded = []
    monkeypatch.setattr(control, "running_jobs", lambda: [])
    monkeypatch.setattr(control, "choose_job", lambda jobs, job: {"socket": "s",
                                                                  "job_id": "f" * 32})
    monkeypatch.setattr(control, "stream_stacks", stream)
    monkeypatch.setattr(cli_mod, "_discard_output", lambda: discarded.append(True))
    assert cli_mod.main(["stack"]) == 141
    assert discarded and "Broken pipe" not in capsys.readouterr().err


def test_stack_with_a_host_that_did_not_answer_says_so_and_exits_1(monkeypatch, capsys):
    """A script collecting stacks must be able to tell an incomplete answer."""
    import socket

    from dsrun.launcher import control

    ours, theirs = socket.socketpair()
    theirs.sendall(b"[node1:0] File 'train.py', line 3\n"
                   + f"{control.NO_ANSWER}node2 (host down or unreachable?)\n".encode())
    theirs.close()
    monkeypatch.setattr(control, "_request", lambda path, cmd, timeout: ours)
    monkeypatch.setattr(control, "running_jobs", lambda: [])
    monkeypatch.setattr(control, "choose_job", lambda jobs, job: {"socket": "s",
                                                                  "job_id": "f" * 32})
    assert cli.main(["stack"]) == 1
    out, err = capsys.readouterr()
    assert out == "[node1:0] File 'train.py', line 3\n"
    assert err == "dsrun: no stacks in time from node2 (host down or unreachable?)\n"


def test_an_option_before_a_command_name_says_commands_come_first(capsys, tmp_path,
                                                                  monkeypatch):
    """`dsrun --ssh_config X doctor -H hf` said "script 'doctor' does not exist"."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--ssh_config", "my cfg", "doctor", "-H", "hf"]) == 2
    err = capsys.readouterr().err
    assert ("'doctor' is a dsrun command, and commands come first: "
            "`dsrun doctor --ssh_config 'my cfg' -H hf`") in err


@pytest.mark.parametrize("argv,fixed,left_out", [
    (["--num_gpus", "2", "hosts", "list"], "`dsrun hosts list`", "--num_gpus"),
    (["--num_gpus=2", "-H", "hf", "--cpu", "hosts", "list"], "`dsrun hosts -H hf list`",
     "--num_gpus, --cpu"),
    (["--num_gpus", "2", "stack"], "`dsrun stack`", "--num_gpus"),
    (["--launcher", "openmpi", "--log_dir", "d", "doctor"],  # doctor takes a job's options
     "`dsrun doctor --launcher openmpi --log_dir d`", None),
    (["--cpu", "-Hhf", "run", "x.py", "--num_gpus", "1"],
     "`dsrun run --cpu -Hhf x.py --num_gpus 1`", None),
    # abbreviations are written out first (`dsrun doctor 2 doctor`)
    (["--num_gpu", "2", "doctor"], "`dsrun doctor --num_gpus 2`", None),
    (["--num_gpu=2", "--inc", "localhost", "doctor"],
     "`dsrun doctor --num_gpus=2 --include localhost`", None),
    (["--num_gpu", "2", "hosts", "list"], "`dsrun hosts list`", "--num_gpus"),
])
def test_the_commands_first_hint_moves_only_the_options_the_command_takes(
        capsys, tmp_path, monkeypatch, argv, fixed, left_out):
    """`dsrun --num_gpus 2 hosts list` suggested `dsrun hosts --num_gpus 2
    list`, which fails too: options the command does not take are left out
    of the suggestion, and named."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"commands come first: {fixed}" in err, err
    if left_out is None:
        assert "left out" not in err
    else:
        assert f"(left out: {left_out}, which" in err, err
    words = shlex.split(fixed.strip("`"))
    cli.load_command(words[1]).make_context(f"dsrun {words[1]}", words[2:])  # it parses


@pytest.mark.parametrize("launcher", [[], ["--launcher", "local"], ["--launcher", "ssh"],
                                      ["--launcher", "pdsh"]])
def test_mpi_backend_without_mpirun_or_srun_is_refused_before_anything_starts(
        launcher, tmp_path, monkeypatch, capsys):
    """torch's MPI backend takes rank and world size from MPI: under the local
    or ssh launcher every rank would be a world of 1."""
    from dsrun.launcher import hostfile as hf

    monkeypatch.setattr(hf, "DEFAULT_JOB_HOSTFILE", str(tmp_path / "no-job-hostfile"))
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    monkeypatch.setattr("dsrun.launcher.launch.ControlServer", pytest.fail)
    for dry in ([], ["--dry-run"]):
        assert cli.main([*dry, *launcher, "--cpu", "--dist_backend", "mpi", str(script)]) == 2
        out, err = capsys.readouterr()
        (line,) = err.splitlines()
        assert line.startswith("dsrun: error: --dist_backend mpi needs --launcher openmpi or "
                               "slurm, not ")
        assert "world of 1" in line and out == ""


@pytest.mark.parametrize("launcher", ["openmpi", "mpirun", "slurm"])
def test_mpi_backend_is_taken_under_mpirun_and_srun(launcher):
    spec = cli.parse_spec(["--launcher", launcher, "--dist_backend", "mpi", "t.py"])
    assert spec.dist_backend == "mpi" and spec.backend in ("openmpi", "slurm")


# --------------------------------------------------------------------------
# abbreviated long options (DeepSpeed's argparse allow_abbrev)


@pytest.mark.parametrize(("argv", "field", "value"), [
    (["--num_gpu", "2", "t.py"], "num_gpus", 2),
    (["--num_node", "1", "t.py"], "num_nodes", 1),
    (["--master_p=1234", "t.py"], "master_port", 1234),
    (["--num_acc", "3", "t.py"], "num_gpus", 3),
    (["--dry", "t.py"], "dry_run", True),  # --dry-run and --dry_run: one option
    (["-H", "--num_gpus", "--incl", "w", "t.py"], "hostfile", "--num_gpus"),  # a value
    (["--env", "A=1", "--ssh_t", "4", "t.py"], "ssh", 4.0),
])
def test_unique_prefixes_of_long_options_are_taken(argv, field, value):
    spec = cli.parse_spec(argv)
    got = getattr(spec, field) if field != "ssh" else spec.ssh.timeout
    assert got == value


def test_prefixes_after_the_script_go_to_the_script_untouched():
    spec = cli.parse_spec(["--num_gpu", "1", "t.py", "--num_gpu", "3", "--dry"])
    assert spec.num_gpus == 1 and spec.script_args == ("--num_gpu", "3", "--dry")
    spec = cli.parse_spec(["-m", "--", "pkg", "--num_gpu"])
    assert spec.script == "pkg" and spec.script_args == ("--num_gpu",)


@pytest.mark.parametrize(("argv", "matches"), [
    (["--num", "2", "t.py"], "--num_nodes, --num-nodes, --num_gpus, --num-gpus, "
                             "--num_accelerators, --num-accelerators"),
    (["--local", "t.py"], "--local_rank_arg, --local-rank-arg"),
])
def test_ambiguous_prefixes_are_one_error_listing_the_candidates(argv, matches, capsys):
    assert cli.main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"dsrun: error: ambiguous option: {argv[0]} could match {matches} "
                    f"(see dsrun --help)")


@pytest.mark.parametrize(("argv", "matches", "deepspeed"), [
    (["--max", "2", "t.py"], "--max_restarts, --max-restarts", "--max_elastic_nodes"),
    (["--log", "INFO", "t.py"], "--log_dir, --log-dir", "--log_level"),
    (["--co", "x", "t.py"], "--config", "--comment"),
    (["--ve", "x", "t.py"], "--version", "--venv_script"),
])
def test_a_prefix_of_a_dsrun_option_and_a_deepspeed_only_flag_is_ambiguous(
        argv, matches, deepspeed, capsys):
    """DeepSpeed's `--max 2` (--max_elastic_nodes) silently
    became dsrun's --max_restarts 2; it is ambiguous, and says so."""
    assert cli.main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"dsrun: error: ambiguous option: {argv[0]} could match {matches}, or "
                    f"DeepSpeed's {deepspeed}, which dsrun does not take (write the option "
                    f"out) (see dsrun --help)")
    # the full names: dsrun's is taken, DeepSpeed's gets its advice
    assert cli.parse_spec(["--max_restarts", "2", "t.py"]).max_restarts == 2
    assert cli.main([deepspeed, "x", "t.py"]) == 2
    assert f"No such option '{deepspeed}' (a DeepSpeed launcher flag)" in \
        capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--local_rank=0", "t.py"], ["--local_rank", "0", "t.py"],
                                  ["--local-rank=1", "t.py"]])
def test_local_rank_given_to_dsrun_says_what_it_is(argv, capsys):
    """`--local_rank=0` said "Option '--local_rank_arg' does not
    take a value" (an option never typed); `--local_rank 0 t.py` ran the
    script "0" with --local_rank_arg."""
    assert cli.main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    name = argv[0].split("=")[0]
    assert line.startswith(f"dsrun: error: No such option '{name}': {name} is what "
                           f"DeepSpeed's launcher (and torch.distributed.launch) gives each "
                           f"rank's script, not a launcher option: dsrun fills it in itself")
    assert "--local_rank_arg" in line and "does not take a value" not in line
    assert cli.parse_spec(["--local_rank_a", "t.py"]).local_rank_arg == "--local_rank"


def test_a_value_in_a_short_option_cluster_is_never_rewritten():
    """in `-mH --num_gpu`, click gives -H the value --num_gpu;
    the pre-parse read only `-m` and wrote the value out as --num_gpus."""
    assert cli.parse_spec(["-mH", "--num_gpu", "pkg"]).hostfile == "--num_gpu"
    spec = cli.parse_spec(["-mH", "hf", "--num_gpu", "2", "pkg", "--num_gpu"])
    assert (spec.hostfile, spec.num_gpus, spec.script_args) == ("hf", 2, ("--num_gpu",))
    spec = cli.parse_spec(["-mHhf", "--num_gpu", "2", "pkg"])
    assert (spec.hostfile, spec.num_gpus, spec.module) == ("hf", 2, True)


def test_doctor_takes_prefixes_too():
    ctx = cli.doctor_command.make_context("dsrun doctor", ["--num_gpu", "1", "--ssh_t", "3"])
    assert ctx.params["num_gpus"] == 1 and ctx.params["ssh_timeout"] == 3.0


def test_a_prefix_of_a_deepspeed_only_flag_gets_its_advice(capsys):
    assert cli.main(["--enable_each", "logs", "t.py"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("dsrun: error: No such option '--enable_each' (a DeepSpeed "
                           "launcher flag = --enable_each_rank_log). DeepSpeed's")


@pytest.mark.parametrize("value, cpu", [("cpu", True), ("CPU ", True), ("cuda", False),
                                        (None, False)])
def test_doctor_honours_ds_accelerator_cpu_with_and_without_a_script(
        value, cpu, tmp_path, monkeypatch):
    """`DS_ACCELERATOR=cpu dsrun doctor -H hf` checked GPU slots,
    `... doctor -H hf train.py` CPU ranks."""
    from dsrun.launcher import doctor

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("pass\n")
    if value is None:
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    else:
        monkeypatch.setenv("DS_ACCELERATOR", value)
    checked = []
    monkeypatch.setattr(doctor, "run_doctor",
                        lambda hosts, cwd, job=None: checked.append(hosts.cpu) or 0)
    for script in ([], ["t.py", "--lr", "1"]):
        assert cli.main(["doctor", "-H", "hf", *script]) == 0
    assert checked == [cpu, cpu]



@pytest.mark.parametrize(("value", "problem"), [("s3cr3tvalue", "no '=' in it"),
                                                 ("=s3cr3tvalue", "no name before '='")])
def test_a_bad_env_pair_does_not_echo_its_value(capsys, value: str, problem: str):
    assert cli.main(["--env", value, "s.py"]) == 2
    err = capsys.readouterr().err
    assert f"expected KEY=VALUE ({problem})" in err and "s3cr3t" not in err
