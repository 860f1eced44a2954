"""Real processes: files in the job's working directory named like stdlib
modules do not reach the node agent or the rank bootstrap, which run with
``python -m`` (that puts the working directory first on sys.path), while
the user's code keeps the sys.path that plain python gives it.

One CPU rank or two, each test about one job start.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.proc
#: the installed console script: ``python -m dsrun.launcher.cli`` (the
#: tests' usual way) would put the cwd first on the launcher's own sys.path
CONSOLE = Path(sys.executable).with_name("dsrun")

#: stdlib modules the agent, the bootstrap or torch import (``import dsrun``,
#: which runs before either can drop the cwd, imports none of them)
SHADOWED = ("json", "queue", "subprocess", "signal", "random", "tempfile", "socket", "email",
            "csv", "shutil")
SHOW_PATH = ("import json as j, sys\n"
             "print('PATH ' + j.dumps(sys.path))\n")


def run_dsrun(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    if not CONSOLE.exists():
        pytest.skip(f"no dsrun console script beside {sys.executable} (pip install -e .)")
    return subprocess.run([str(CONSOLE), *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd, env={**os.environ, **(env or {})})


def _shadowing_cwd(tmp_path: Path) -> Path:
    cwd = tmp_path / "work"
    cwd.mkdir()
    for name in SHADOWED:
        (cwd / f"{name}.py").write_text(f"raise SystemExit('the cwd {name}.py was imported')\n")
    return cwd


def _paths(stdout: str) -> list[list[str]]:
    return [json.loads(line.split("PATH ", 1)[1]) for line in stdout.splitlines()
            if "PATH " in line]


def test_stdlib_named_files_in_the_cwd_reach_neither_agent_nor_bootstrap(tmp_path):
    cwd = _shadowing_cwd(tmp_path)
    app = tmp_path / "app"
    app.mkdir()
    (app / "show.py").write_text(SHOW_PATH)
    res = run_dsrun("--cpu", "--num_gpus", "2", str(app / "show.py"), cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "was imported" not in res.stdout + res.stderr
    paths = _paths(res.stdout)
    assert len(paths) == 2 and all(p[0] == str(app) for p in paths), res.stdout
    assert all(str(cwd) not in p for p in paths)  # as `python app/show.py`


def test_a_script_gets_the_sys_path_of_plain_python_with_the_cwd_on_pythonpath(tmp_path):
    """A PYTHONPATH entry equal to the working directory stays (only the
    entry that -m added goes), after the script's own directory."""
    cwd = tmp_path / "work"
    (cwd / "app").mkdir(parents=True)
    (cwd / "app" / "show.py").write_text(SHOW_PATH)
    env = {"PYTHONPATH": str(cwd)}
    plain = subprocess.run([sys.executable, "app/show.py"], cwd=cwd, capture_output=True,
                           text=True, env={**os.environ, **env})
    res = run_dsrun("--cpu", "--num_gpus", "1", "--dist_backend", "none", "app/show.py",
                    cwd=cwd, env=env)
    assert plain.returncode == res.returncode == 0, res.stderr[-3000:]
    (seen,) = _paths(res.stdout)
    assert seen[:2] == [str(cwd / "app"), str(cwd)]
    assert seen == _paths(plain.stdout)[0]


def test_module_mode_still_imports_from_the_cwd_first(tmp_path):
    cwd = _shadowing_cwd(tmp_path)
    (cwd / "mymod.py").write_text("import sys\nprint('MOD', __name__, sys.path[0])\n")
    res = run_dsrun("--cpu", "--num_gpus", "1", "--dist_backend", "none", "-m", "mymod",
                    cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"MOD __main__ {cwd}" in res.stdout


def test_import_dsrun_imports_no_stdlib_module_a_cwd_file_could_replace():
    """``python -m dsrun.…`` imports the dsrun package before the module can
    take the cwd off sys.path: it must stay that light (typing aside)."""
    code = ("import sys; before = set(sys.modules); import dsrun.runtime, dsrun.launcher; "
            "print(sorted(m for m in set(sys.modules) - before "
            "if '.' not in m and not m.startswith(('dsrun', '_'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert set(ast.literal_eval(out.strip())) <= {"typing"}, out  # (3.12+ loads it earlier)
