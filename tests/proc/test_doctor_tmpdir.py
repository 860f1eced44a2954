"""``dsrun doctor`` on this host names a TMPDIR that does not exist, with
its fix, and still checks the host (the agent falls back to /tmp)."""

from __future__ import annotations

from tests.conftest import run_dsrun


def test_doctor_warns_of_a_missing_tmpdir(tmp_path):
    gone = tmp_path / "no-such-dir"
    res = run_dsrun("doctor", "--cpu", "--num_gpus", "1", env={"TMPDIR": str(gone)},
                    timeout=90)
    assert f"this host: warning: TMPDIR={gone} does not exist" in res.stdout, \
        res.stdout + res.stderr
    assert f"mkdir -p {gone}" in res.stdout
    assert res.returncode == 0, res.stdout + res.stderr  # a warning, not a failed host
