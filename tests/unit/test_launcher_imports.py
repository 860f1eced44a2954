"""The launcher and the agent stay light: no torch ever, paramiko only for SSH."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import dsrun.launcher.cli, dsrun.launcher.launch, dsrun.launcher.agent
import dsrun.launcher.doctor, dsrun.launcher.netinfo, dsrun.launcher.envpolicy
import dsrun.launcher.cluster, dsrun.launcher.rankenv, dsrun.launcher.callback
import dsrun.launcher.backends.openmpi, dsrun.launcher.backends.slurm
from dsrun.launcher import cli
code = cli.main(["--dry-run", "--num_gpus", "1", "--dist_backend", "none", {script!r}])
assert code == 0, code
heavy = sorted(m for m in ("torch", "paramiko") if m in sys.modules)
print("HEAVY", heavy)
"""


def test_local_launch_imports_neither_torch_nor_paramiko(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    res = subprocess.run([sys.executable, "-c", CHECK.format(script=str(script))],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "HEAVY []" in res.stdout


def test_ssh_backend_imports_paramiko_but_not_torch():
    code = ("import sys; from dsrun.launcher.backends import get_backend; get_backend('ssh');"
            "print('torch' in sys.modules, 'paramiko' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert res.stdout.split() == ["False", "True"], res.stderr
