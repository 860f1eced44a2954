"""scripts/install.sh's last line says which dsrun it installed: dsrun's own
release (``dsrun --version``, the package metadata), not the
DeepSpeed-compatible ``dsrun.__version__``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import dsrun

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_message_names_dsruns_own_version():
    text = (ROOT / "scripts" / "install.sh").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith('echo "install.sh: dsrun ')]
    # the version the message prints: its $(.venv/bin/python -c '...') part
    (code,) = re.findall(r"\$\(\.venv/bin/python -c '([^']*)'\)", line)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip()
    assert out == dsrun.DSRUN_VERSION != dsrun.__version__
