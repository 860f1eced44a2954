"""A ``--log_dir`` file that cannot be written mid-job (a full disk, a
quota) fails its host: the agent keeps reading the ranks' pipes (a rank
never blocks on a full pipe), says which file, stops its ranks, sends
``done`` and leaves nothing behind (temporary directory, processes).

The full disk is a 64 KiB tmpfs mounted for the test (root only)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import run_dsrun

SPAM = """\
import os, sys, time
open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pid"), "w").write(str(os.getpid()))
for i in range(4000):
    print(f"line {i:05d} " + "x" * 100, flush=True)
time.sleep(60)  # a job that would go on: only the host's failure ends it
"""


@pytest.fixture
def full_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a 64 KiB tmpfs, unmounted at the end."""
    if os.geteuid() != 0 or not sys.platform.startswith("linux"):
        pytest.skip("mounting a tmpfs needs root on Linux")
    where = tmp_path / "full"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_log_file_that_fills_the_disk_fails_the_host_and_leaves_nothing(tmp_path, full_dir):
    script = tmp_path / "spam.py"
    script.write_text(SPAM)
    pids, tmp = tmp_path / "pids", tmp_path / "tmp"
    pids.mkdir()
    tmp.mkdir()
    res = run_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "none", "--log_dir",
                    str(full_dir / "logs"), str(script), str(pids), timeout=60,
                    env={"TMPDIR": str(tmp)})
    ranks = [int(p.read_text()) for p in pids.glob("*.pid")]
    try:
        assert res.returncode == 1, res.stderr[-3000:]
        own = [ln for ln in res.stderr.splitlines() if not ln.startswith("[")]
        assert any("cannot write the --log_dir file" in ln and "rank_" in ln and
                   "[Errno 28] No space left on device" in ln for ln in own), own
        assert not any("Traceback" in ln for ln in own), own
        left = [p.name for p in tmp.iterdir()
                if re.fullmatch(r"dsrun-[0-9a-f]{8}-\w+", p.name)]  # not the launcher's
        assert left == [], "the agent's temporary directory was left behind"
        assert ranks, "no rank started"
        assert not [p for p in ranks if psutil.pid_exists(p) and
                    psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    finally:
        for pid in ranks:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
