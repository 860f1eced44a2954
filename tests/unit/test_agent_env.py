"""The PYTHONPATH a node agent starts with (backends/agent_env.py): the
ranks' one, for local and remote agents alike, whether the launcher's,
--env's or an env file's (expanded on the host as the ranks get it); the
remote line works for any interpreter path; --dry-run does not show it; the
ranks' environment is still built from the agent's login environment."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dsrun.launcher import agent_os
from dsrun.launcher.backends.agent_env import local_agent_env, remote_assignments
from dsrun.launcher.backends.ssh import remote_command
from dsrun.launcher.envlayers import expand_file_values
from dsrun.launcher.envpolicy import EnvEntry, JobEnv
from dsrun.launcher.protocol import PYTHONPATH_WAS

SHELLS = [sh for sh in ("sh", "bash", "dash") if shutil.which(sh)]


def _env(value: str, expand: bool = False, source: str = "--env") -> JobEnv:
    files = (("PYTHONPATH", expand),) if source != "--env" else ()
    return JobEnv((EnvEntry("PYTHONPATH", value, source, expand),), files)


def _run_line(shell: str, tmp_path: Path, python_dir: str, user_env: JobEnv,
              environ: dict[str, str]) -> str:
    """What a stand-in interpreter sees when the login shell runs the line."""
    where = tmp_path / python_dir
    where.mkdir(parents=True, exist_ok=True)
    python = where / "python"
    python.write_text('#!/bin/sh\nprintf "%s|%s|%s" "$PYTHONPATH" '
                      f'"${{{PYTHONPATH_WAS}-unset}}" "$*"\n')
    python.chmod(0o755)
    line = remote_command(str(python), str(tmp_path), remote_assignments(user_env))
    res = subprocess.run([shell, "-c", line], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], **environ}, timeout=10)
    assert res.returncode == 0, (line, res.stderr)
    return res.stdout


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("python_dir", ["venv/bin", "opt/x=y/bin"])
def test_a_remote_agent_gets_the_value_byte_exact(tmp_path, shell, python_dir):
    value = "/my lib:/it's $HOME `x` \\\\ \"q\"\n-x"
    out = _run_line(shell, tmp_path, python_dir, _env(value), {"PYTHONPATH": "/login"})
    assert out == f"{value}|:/login|-m dsrun.launcher.agent"


@pytest.mark.parametrize("shell", SHELLS)
def test_a_remote_agent_gets_an_env_file_value_expanded_on_its_host(tmp_path, shell):
    value = "$HOME/lib:${TOOLS}/py:$1:$$:`x`:${A:-b}:\\\\:\"\\n"
    out = _run_line(shell, tmp_path, "bin", _env(value, expand=True, source="~/.deepspeed_env"),
                    {"HOME": "/h", "TOOLS": "/t"})
    # (the login environment had no PYTHONPATH: set and empty)
    assert out == "/h/lib:/t/py:$1:$$:`x`:${A:-b}:\\\\:\"\\n||-m dsrun.launcher.agent"


@pytest.mark.parametrize("shell", SHELLS)
def test_a_remote_agent_expands_a_forwarded_variable_to_its_forwarded_value(tmp_path, shell):
    """`PYTHONPATH=$NCCL_HOME/py` with NCCL_HOME forwarded: the remote agent
    got the login environment's NCCL_HOME (empty), its ranks the forwarded
    one; a value with quotes or `$` is written in literally."""
    home = "/opt/n $x 'q' \"d\" `c`"
    env = JobEnv((EnvEntry("NCCL_HOME", home, "forwarded"),
                  EnvEntry("PYTHONPATH", "$NCCL_HOME/py:${HOME}/l", "~/.deepspeed_env", True)),
                 (("PYTHONPATH", True),))
    out = _run_line(shell, tmp_path, "bin", env, {"HOME": "/h", "NCCL_HOME": "/login"})
    assert out == f"{home}/py:/h/l||-m dsrun.launcher.agent"
    assert expand_file_values(env.as_dict(), env.files, {"HOME": "/h"})["PYTHONPATH"] \
        == f"{home}/py:/h/l"


def test_a_value_that_refers_to_another_env_file_variable_stays_off_the_line():
    env = JobEnv((EnvEntry("BASE", "/b", "f", False),
                  EnvEntry("PYTHONPATH", "$BASE/lib", "f", True)),
                 (("BASE", False), ("PYTHONPATH", True)))
    assert remote_assignments(env) is None


def test_dry_run_does_not_show_the_value():
    words = remote_assignments(_env("/secret/path"), shown=True)
    assert words is not None and "/secret" not in words
    assert "PYTHONPATH=<value not shown>" in words


def test_a_local_agent_gets_the_ranks_pythonpath(monkeypatch):
    launcher = {"PATH": "/bin", "HOME": "/h", "PYTHONPATH": "/launcher"}
    assert local_agent_env(JobEnv(), launcher) is None  # it inherits the launcher's
    env = local_agent_env(_env("/from --env"), launcher)
    assert env is not None and env["PYTHONPATH"] == "/from --env"
    assert env[PYTHONPATH_WAS] == ":/launcher" and env["HOME"] == "/h"
    expanded = local_agent_env(_env("$HOME/lib:$PYTHONPATH", True, ".dsrun_env"), launcher)
    assert expanded is not None and expanded["PYTHONPATH"] == "/h/lib:/launcher"


def test_the_ranks_inherit_the_login_environments_pythonpath(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/h/lib:/launcher")  # as the agent was started
    monkeypatch.setenv(PYTHONPATH_WAS, ":/launcher")
    assert agent_os.login_environ()["PYTHONPATH"] == "/launcher"
    assert PYTHONPATH_WAS not in agent_os.login_environ()
    monkeypatch.setenv(PYTHONPATH_WAS, "")  # it had none
    assert "PYTHONPATH" not in agent_os.login_environ()
    monkeypatch.delenv(PYTHONPATH_WAS)  # started without one: as it is
    assert agent_os.login_environ()["PYTHONPATH"] == "/h/lib:/launcher"
