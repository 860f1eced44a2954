"""CLI parsing: options before the script, everything after it untouched."""

from __future__ import annotations

import click
import pytest

from dsrun.errors import DsrunUsageError
from dsrun.launcher import cli
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


def test_dashed_spellings_are_accepted():
    spec = cli.parse_spec(["--num-gpus", "2", "--master-port", "99", "s.py"])
    assert (spec.num_gpus, spec.master_port) == (2, 99)


@pytest.mark.parametrize("argv,message", [
    (["--num_gpus", "0", "s.py"], "--num_gpus must be at least 1, got 0"),
    (["--num_gpus", "-2", "s.py"], "--num_gpus must be at least 1, got -2"),
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


def test_main_missing_script_exits_2(tmp_path, capsys):
    assert cli.main([str(tmp_path / "nope.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main([str(tmp_path)]) == 2
    assert "is not a file" in capsys.readouterr().err


def test_warns_about_dsrun_flags_after_the_script(capsys):
    seen = cli.warn_flags_after_script(["--lr", "1", "--num_gpus", "2", "--num_gpus=3",
                                        "--master_port=5"])
    assert seen == ["--num_gpus", "--master_port"]
    err = capsys.readouterr().err
    assert err.count("warning") == 2 and "passed to the script" in err


def test_subcommand_dispatch_prefers_existing_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli._dispatch(["run", "x.py"])[0] is cli.run_command
    assert cli._dispatch(["run", "x.py"])[1] == ["x.py"]
    (tmp_path / "run").write_text("print(1)\n")
    assert cli._dispatch(["run", "x.py"]) == (cli.run_command, ["run", "x.py"])


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
