"""What a rank's environment takes from the job (explore20-env findings):

- an env-file ``$NAME`` sees the job's forwarded, ``--env_prefix`` and
  ``--env`` values, exported before the file lines as DeepSpeed does, so a
  local and a remote agent expand it alike;
- a job with a remote host gets the launcher's working directory first on
  PYTHONPATH (DeepSpeed's multi-node runner); a job on this host does not;
- a malformed env-file line or ``--env`` name never quotes its text;
- the variables a launcher sets per job are never inherited or forwarded
  (a dsrun run inside a rank of another job).
"""

from __future__ import annotations

import os

import pytest

from dsrun.errors import DsrunUsageError
from dsrun.launcher import launch
from dsrun.launcher.envlayers import LAUNCHER_OWNED, apply_layers
from dsrun.launcher.envpolicy import (
    NEVER_FORWARDED,
    forward_defaults,
    job_env,
    parse_env_file,
)
from dsrun.launcher.rankenv import AGENT_VARS, INSTEAD
from dsrun.launcher.spec import LaunchSpec

LAUNCHER = {"NCCL_HOME": "/opt/nccl", "PYTHONXHOME": "/opt/x", "HOME": "/home/me",
            "PATH": "/usr/bin"}
LOGIN = {"HOME": "/home/me", "PATH": "/usr/bin"}  # a remote host's: no NCCL_HOME


def _rank_env(text: str, inherited: dict[str, str], cli=()) -> dict[str, str]:
    """What a rank of a remote-forwarding job gets from an agent that
    started in ``inherited``, with ``text`` as ./.deepspeed_env."""
    env = job_env(LAUNCHER, remote=True, file_entries=parse_env_file(text, "/w/.deepspeed_env"),
                  cli_env=cli)
    return apply_layers({}, inherited, env.as_dict(), {}, env.files)


@pytest.mark.parametrize("inherited", [LOGIN, LAUNCHER], ids=["remote", "local"])
def test_a_reference_to_a_forwarded_variable_is_its_forwarded_value(inherited):
    got = _rank_env("XLIB=$PYTHONXHOME/lib\nNCCL_LIB=${NCCL_HOME}/lib\n", inherited)
    assert got["XLIB"] == "/opt/x/lib"
    assert got["NCCL_LIB"] == "/opt/nccl/lib"


@pytest.mark.parametrize("inherited", [LOGIN, LAUNCHER], ids=["remote", "local"])
def test_a_forwarded_variable_a_file_sets_again_is_set_first_as_in_deepspeed(inherited):
    # DeepSpeed's exports dict keeps a forwarded key in its first place:
    # `export NCCL_HOME=/other; ...; export A="$NCCL_HOME/lib"`
    got = _rank_env("A=$NCCL_HOME/lib\nNCCL_HOME=/other\n", inherited)
    assert got["A"] == "/other/lib" and got["NCCL_HOME"] == "/other"


def test_a_reference_to_an_env_value_is_its_value():
    got = _rank_env("DATA=$ROOT/data\n", LOGIN, cli=(("ROOT", "/srv"),))
    assert got["DATA"] == "/srv/data"


def test_a_files_own_pythonpath_reference_is_still_the_hosts(tmp_path):
    # as DeepSpeed: `PYTHONPATH=$PYTHONPATH:/x` drops the launcher's value
    environ = {**LAUNCHER, "PYTHONPATH": "/launcher"}
    env = job_env(environ, remote=True, cwd_first=str(tmp_path),
                  file_entries=parse_env_file("PYTHONPATH=$PYTHONPATH:/x\n", "/f"))
    got = apply_layers({}, {**LOGIN, "PYTHONPATH": "/login"}, env.as_dict(), {}, env.files)
    assert got["PYTHONPATH"] == "/login:/x"


def _spec(tmp_path) -> LaunchSpec:
    script = tmp_path / "s.py"
    script.write_text("")
    return LaunchSpec(script=str(script))


@pytest.mark.parametrize("was", [None, "", "/a:/b"])
def test_a_job_with_a_remote_host_gets_the_working_directory_first(tmp_path, monkeypatch,
                                                                    was):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if was is None:
        monkeypatch.delenv("PYTHONPATH", raising=False)
    else:
        monkeypatch.setenv("PYTHONPATH", was)
    work = tmp_path / "work"
    work.mkdir()
    env = launch.user_env(_spec(tmp_path), str(work), remote=True, multi_host=True)
    # DeepSpeed: abspath('.') + ":" + env['PYTHONPATH'] when it is set
    assert env.as_dict()["PYTHONPATH"] == str(work) + ("" if was is None else f":{was}")
    assert "working directory" in next(e.source for e in env.entries if e.key == "PYTHONPATH")


def test_a_job_on_this_host_keeps_its_pythonpath(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PYTHONPATH", "/a")
    env = launch.user_env(_spec(tmp_path), str(tmp_path), remote=False, multi_host=False)
    assert "PYTHONPATH" not in env.as_dict()


SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"


@pytest.mark.parametrize("line,problem", [
    (f"API_KEY {SECRET}==", "a space before '='"),
    (f'TOKEN: "{SECRET}=abc"', "a ':' in the name"),
    (f"export API-{SECRET}=x", "a punctuation character in the name"),
])
def test_a_malformed_line_names_the_problem_and_none_of_the_text(line, problem):
    with pytest.raises(DsrunUsageError) as info:
        parse_env_file(f"OK=1\n{line}\n", "/w/.dsrun_env")
    message = str(info.value)
    assert message.startswith("/w/.dsrun_env:2: ") and problem in message
    assert SECRET[:6] not in message and "EXAMPLE" not in message


def test_an_env_name_that_is_no_name_is_not_echoed():
    with pytest.raises(DsrunUsageError, match="--env: .*a space before '='") as info:
        job_env({}, remote=False, cli_env=((f"KEY {SECRET}", "x"),))
    assert SECRET[:6] not in str(info.value)


def test_every_variable_the_launcher_sets_per_job_is_launcher_owned():
    per_job = {k for k in INSTEAD if k.startswith("DSRUN_")} | set(AGENT_VARS) | {
        "DSRUN_JOB_ID", "DSRUN_RESTART_COUNT"}
    assert per_job <= LAUNCHER_OWNED <= NEVER_FORWARDED


def test_a_parent_jobs_variables_are_neither_inherited_nor_forwarded():
    parent = {k: "parent" for k in LAUNCHER_OWNED} | {"DSRUN_TRACE": "1", "HOME": "/h"}
    assert [e.key for e in forward_defaults(parent)] == ["DSRUN_TRACE"]
    got = apply_layers({"dsrun": {"RANK": "0"}}, parent, {}, {})
    assert not LAUNCHER_OWNED & set(got)
    assert got["DSRUN_TRACE"] == "1" and got["HOME"] == "/h"


def test_the_working_directory_check_names_a_deleted_directory(tmp_path, monkeypatch):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    monkeypatch.setenv("PWD", str(gone))
    os.rmdir(gone)
    with pytest.raises(DsrunUsageError, match=f"the working directory {gone} no longer exists"):
        launch.run(_spec(tmp_path))
