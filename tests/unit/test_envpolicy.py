"""Environment propagation policy (pure): defaults, prefixes, env files, precedence."""

from __future__ import annotations

import pytest

from dsrun.errors import DsrunUsageError
from dsrun.launcher.envpolicy import (
    EnvEntry,
    check_ds_env_file,
    env_file_paths,
    forward_defaults,
    forward_prefixes,
    job_env,
    parse_env_file,
    read_env_files,
)

LAUNCHER = {
    "NCCL_DEBUG": "INFO", "CUDA_HOME": "/cuda", "CUDA_VISIBLE_DEVICES": "0,1",
    "OMP_NUM_THREADS": "4", "GLOO_SOCKET_IFNAME": "ib0", "TORCH_HOME": "/t",
    "DSRUN_X": "1", "DSRUN_JOB_ID": "parent", "PYTHONPATH": "/src", "PYTHONHOME": "/h",
    "PATH": "/usr/bin", "HOME": "/root", "MYAPP_TOKEN": "tok", "MYAPPLE": "a",
    "LD_LIBRARY_PATH": "/lib",
}


def test_default_forwarding_by_prefix_and_name():
    keys = [e.key for e in forward_defaults(LAUNCHER)]
    assert keys == ["CUDA_HOME", "DSRUN_X", "GLOO_SOCKET_IFNAME", "NCCL_DEBUG",
                    "OMP_NUM_THREADS", "PYTHONPATH", "TORCH_HOME"]
    # DeepSpeed's EXPORT_ENVS (MLFLOW, PYTHON, MV2, UCX) and NCCL are plain prefixes
    more = {"MLFLOW_TRACKING_URI": "http://x", "PYTHONNOUSERSITE": "1", "NCCLX": "1",
            "UCXX": "1", "MV2X": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONEXECUTABLE": "/py", "VIRTUAL_ENV": "/v"}
    keys = [e.key for e in forward_defaults({**LAUNCHER, **more})]
    assert {"MLFLOW_TRACKING_URI", "PYTHONNOUSERSITE", "NCCLX", "UCXX", "MV2X",
            "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV"} <= set(keys)
    assert "PYTHONEXECUTABLE" not in keys
    # host-specific or job-specific values never travel by prefix
    assert "CUDA_VISIBLE_DEVICES" not in keys and "DSRUN_JOB_ID" not in keys
    assert {"PATH", "HOME", "PYTHONHOME", "LD_LIBRARY_PATH"}.isdisjoint(keys)


def test_user_prefixes_match_by_prefix_only():
    entries = forward_prefixes(LAUNCHER, ["MYAPP_"])
    assert [(e.key, e.source) for e in entries] == [("MYAPP_TOKEN", "--env_prefix MYAPP_")]
    assert [e.key for e in forward_prefixes(LAUNCHER, ["MYAPP"])] == ["MYAPPLE", "MYAPP_TOKEN"]


def test_env_file_syntax():
    text = ("# comment\n\n  export A=1\nB = two words \nC='quoted # not a comment'\n"
            'D="x"\nE=\nF=a=b\nexportG=3\n')
    entries = parse_env_file(text, "/w/.dsrun_env")
    assert [(e.key, e.value) for e in entries] == [
        ("A", "1"), ("B", "two words"), ("C", "quoted # not a comment"), ("D", "x"),
        ("E", ""), ("F", "a=b"), ("exportG", "3")]
    assert entries[1].source == "/w/.dsrun_env:4"


@pytest.mark.parametrize("line,message", [
    ("JUSTAWORD", r"/f:2: expected KEY=VALUE \(no '=' on this line\)"),
    ("=value", r"/f:2: expected KEY=VALUE \(no name before '='\)"),
    ("1ABC=x", r"/f:2: invalid environment variable name: the name starts with a digit"),
    ("MY-VAR=x", r"/f:2: invalid environment variable name: a punctuation character"),
])
def test_malformed_env_file_line_names_file_and_line(line, message):
    with pytest.raises(DsrunUsageError, match=message):
        parse_env_file(f"OK=1\n{line}\n", "/f")


def test_malformed_line_error_never_shows_the_value():
    with pytest.raises(DsrunUsageError) as info:
        parse_env_file("BAD KEY=hunter2\n", "/f")
    assert "hunter2" not in str(info.value)


def test_env_files_home_then_cwd_deepspeed_then_dsrun(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    assert env_file_paths(str(cwd), str(home)) == [
        f"{home}/.deepspeed_env", f"{home}/.dsrun_env",
        f"{cwd}/.deepspeed_env", f"{cwd}/.dsrun_env"]
    assert env_file_paths(str(home), str(home)) == [f"{home}/.deepspeed_env",
                                                    f"{home}/.dsrun_env"]
    # a job on this host alone: dsrun's own files only (DeepSpeed's multi-node rule)
    assert env_file_paths(str(cwd), str(home), multi_host=False) == [
        f"{home}/.dsrun_env", f"{cwd}/.dsrun_env"]
    (home / ".dsrun_env").write_text("A=home\nB=home\n")
    (cwd / ".deepspeed_env").write_text("B=ds\nC=ds\n")
    entries = read_env_files(env_file_paths(str(cwd), str(home)))  # missing files skipped
    env = job_env({}, remote=True, file_entries=entries).as_dict()
    assert env == {"A": "home", "B": "ds", "C": "ds"}


def test_unreadable_env_file_is_an_error(tmp_path):
    (tmp_path / ".dsrun_env").mkdir()
    with pytest.raises(DsrunUsageError, match="cannot read env file .*\\.dsrun_env"):
        read_env_files([str(tmp_path / ".dsrun_env")])


def test_precedence_forwarded_then_prefix_then_files_then_cli():
    files = [EnvEntry("OMP_NUM_THREADS", "2", "f:1"), EnvEntry("MYAPP_TOKEN", "file", "f:2"),
             EnvEntry("ONLY_FILE", "x", "f:3")]
    env = job_env(LAUNCHER, remote=True, env_prefixes=["MYAPP_"], file_entries=files,
                  cli_env=[("OMP_NUM_THREADS", "8"), ("NEW", "n")])
    values = env.as_dict()
    assert values["OMP_NUM_THREADS"] == "8"  # --env beats file beats forwarded
    assert values["MYAPP_TOKEN"] == "file"  # file beats --env_prefix
    assert values["NCCL_DEBUG"] == "INFO" and values["ONLY_FILE"] == "x"
    sources = {e.key: e.source for e in env.entries}
    assert sources["OMP_NUM_THREADS"] == "--env" and sources["NCCL_DEBUG"] == "forwarded"
    assert list(env.keys()) == sorted(env.keys())


def test_local_jobs_do_not_forward_what_they_inherit():
    env = job_env(LAUNCHER, remote=False, env_prefixes=["MYAPP_"], cli_env=[("A", "1")])
    assert env.as_dict() == {"A": "1"}


def test_describe_and_repr_show_keys_only():
    env = job_env({}, remote=True, cli_env=[("SECRET", "hunter2")])
    assert env.describe() == ["SECRET=<value not shown> (--env)"]
    assert "hunter2" not in repr(env)


@pytest.mark.parametrize("prefix", ["", "1X", "A-B", "A B"])
def test_bad_prefix_is_a_usage_error(prefix):
    with pytest.raises(DsrunUsageError, match="--env_prefix: invalid prefix"):
        job_env({}, remote=True, env_prefixes=[prefix])


def test_an_agents_connect_back_variables_are_never_forwarded():
    from dsrun.launcher.protocol import AGENT_BOOTSTRAP_VARS

    environ = {name: "x" for name in AGENT_BOOTSTRAP_VARS}
    assert job_env(environ, remote=True).keys() == ()


def test_ds_env_file_names_deepspeeds_env_file(tmp_path):
    """DeepSpeed reads os.getenv("DS_ENV_FILE", ".deepspeed_env") from ~ and ."""
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    environ = {"DS_ENV_FILE": "custom_env"}
    assert env_file_paths(str(cwd), str(home), environ) == [
        f"{home}/custom_env", f"{home}/.dsrun_env", f"{cwd}/custom_env", f"{cwd}/.dsrun_env"]
    (cwd / "custom_env").write_text("MYV=custom\n")
    (cwd / ".deepspeed_env").write_text("MYV=ignored\nOTHER=ignored\n")
    check_ds_env_file(str(cwd), str(home), environ)
    entries = read_env_files(env_file_paths(str(cwd), str(home), environ))
    assert job_env({}, remote=False, file_entries=entries).as_dict() == {"MYV": "custom"}
    absolute = {"DS_ENV_FILE": str(cwd / "custom_env")}
    assert env_file_paths(str(cwd), str(home), absolute) == [
        str(cwd / "custom_env"), f"{home}/.dsrun_env", f"{cwd}/.dsrun_env"]
    check_ds_env_file(str(cwd), str(home), {"DS_ENV_FILE": ""})  # unset: no check
    with pytest.raises(DsrunUsageError, match=r"^DS_ENV_FILE='typo' \(environment\) names no "
                                              rf"file: looked for {home}/typo, {cwd}/typo$"):
        check_ds_env_file(str(cwd), str(home), {"DS_ENV_FILE": "typo"})


def test_dsrun_reads_the_file_ds_env_file_names(tmp_path, monkeypatch, capsys):
    """On a job of several hosts, as DeepSpeed (which reads it only there)."""
    from dsrun.launcher import cli
    from dsrun.launcher import hostfile as hf

    monkeypatch.setattr(hf, "DEFAULT_JOB_HOSTFILE", str(tmp_path / "no-job-hostfile"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("pass\n")
    (tmp_path / "hf").write_text("localhost slots=1\nnode-x slots=1\n")
    (tmp_path / "custom_env").write_text("MYV9=fromcustom\n")
    monkeypatch.setenv("DS_ENV_FILE", "custom_env")
    assert cli.main(["--dry-run", "--cpu", "-H", "hf", "t.py"]) == 0
    assert f"MYV9=<value not shown> ({tmp_path}/custom_env:1)" in capsys.readouterr().out
    monkeypatch.setenv("DS_ENV_FILE", "nope_env")
    assert cli.main(["--dry-run", "--cpu", "-H", "hf", "t.py"]) == 2
    assert capsys.readouterr().err.startswith("dsrun: error: DS_ENV_FILE='nope_env'")
    # a job on this host alone reads no DeepSpeed env file, so a wrong name is no error
    assert cli.main(["--dry-run", "--cpu", "t.py"]) == 0


def test_an_env_file_may_start_with_a_byte_order_mark(tmp_path):
    path = tmp_path / ".dsrun_env"
    path.write_bytes("\ufeffFIRST=1\nSECOND=ü\n".encode())
    entries = read_env_files([str(path)])
    assert [(e.key, e.value) for e in entries] == [("FIRST", "1"), ("SECOND", "ü")]
