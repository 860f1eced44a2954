"""A child the script makes with os.fork() and that leaves through Python
(end of its code, sys.exit, an exception) inside a rank with a gloo group:
it ends as multiprocessing's fork children do, without tearing down the
group it inherited (which would wait forever for the parent's threads), and
its error is not the rank's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_dsrun

FORKS = """
import os, sys, time
t0 = time.monotonic()
pid = os.fork()
if pid == 0:
    print("child leaving", flush=True)
    {leave}
else:
    _, status = os.waitpid(pid, 0)
    print(f"child reaped, status {{os.waitstatus_to_exitcode(status)}}", flush=True)
"""


@pytest.mark.parametrize(("leave", "status"), [
    ("pass", 0), ("sys.exit(3)", 3), ("raise ValueError('the child failed')", 1),
    ("sys.exit('the child says why')", 1),
    ("import threading; threading.Thread(target=lambda: (time.sleep(0.5), "
     "print('child thread done', flush=True))).start()", 0)])
def test_a_forked_child_leaving_through_python_ends(tmp_path: Path, leave: str,
                                                      status: int) -> None:
    script = tmp_path / "forks.py"
    script.write_text(FORKS.format(leave=leave))
    res = run_dsrun("--cpu", "--num_gpus", "1", "--dist_backend", "gloo", "--timeout", "60",
                    str(script), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"child reaped, status {status}" in res.stdout
    if "ValueError" in leave:
        assert "ValueError: the child failed" in res.stdout + res.stderr  # printed, as python
    if "says why" in leave:
        assert "the child says why" in res.stdout + res.stderr
    if "threading" in leave:  # the child waited for its own thread, as python does
        assert "child thread done" in res.stdout


HELPER_FAILS = """
import os, sys, time
marker = sys.argv[1]
if os.environ["RANK"] == "1":
    if os.fork() == 0:
        open(marker, "w").close()
        raise ValueError("rank 1's forked helper failed")
    time.sleep(60)
else:
    while not os.path.exists(marker):
        time.sleep(0.05)
    time.sleep(0.5)
    raise RuntimeError("the real failure on rank 0")
"""


def test_a_forked_childs_error_is_not_blamed_on_its_rank(tmp_path: Path) -> None:
    script = tmp_path / "helper.py"
    script.write_text(HELPER_FAILS)
    res = run_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "gloo", "--timeout", "60",
                    str(script), str(tmp_path / "helper-failed"), timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "rank 0 on host" in res.stderr and "failed first" in res.stderr, res.stderr
    assert "rank 1 on host" not in res.stderr.split("failed first")[0], res.stderr
