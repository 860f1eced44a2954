"""Failures of the node agent itself (not of a rank): a --log_dir file it
cannot open, or its own error after a rank started. Each is reported as a
failure of the host (a ``fail`` event, a non-zero exit), the ranks it
started are stopped, and it is never a clean ``done``. Real processes."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.conftest import WORKERS, alive, run_agent, run_dsrun


def _agent(payload: dict, timeout: float = 30) -> tuple[list[dict], int]:
    return run_agent(payload, timeout, stderr=subprocess.DEVNULL)


def _rank(rank: int, argv: list[str], env: dict | None = None) -> dict:
    return {"rank": rank, "local_rank": rank, "argv": argv, "runtime": True,
            "env": env or {"dsrun": {"RANK": str(rank)}, "defaults": {}, "path_prepend": []}}


def _sleeper(flag) -> list[str]:  # noqa: ANN001 - a path
    return [sys.executable, "-c",
            f"import os, time; open({str(flag)!r}, 'w').write(str(os.getpid())); "
            "time.sleep(60)"]


def test_a_log_file_that_cannot_be_opened_fails_the_host_before_any_rank(tmp_path):
    logs = tmp_path / "logs"
    (logs / "rank_1.log").mkdir(parents=True)  # a directory where the file should be
    flag = tmp_path / "rank0_ran"
    payload = {"job_id": "c" * 32, "kill_grace": 1, "cwd": str(tmp_path), "env": {},
               "log_dir": str(logs),
               "ranks": [_rank(0, _sleeper(flag)), _rank(1, _sleeper(flag))]}
    events, status = _agent(payload)
    fails = [e for e in events if e.get("ev") == "fail"]
    assert len(fails) == 1, events
    assert f"{logs / 'rank_1.log'}: [Errno 21] Is a directory" in fails[0]["message"]
    assert not [e for e in events if e.get("ev") == "started"], events
    assert events[-1]["ev"] == "done" and status == 1
    time.sleep(0.3)
    assert not flag.exists(), "a rank started although its host's log file could not open"


def test_an_agent_error_after_a_rank_started_stops_it_and_fails_the_host(tmp_path):
    flag = tmp_path / "rank0_pid"
    broken = {"dsrun": {"RANK": "1"}, "defaults": {}, "path_prepend": 5}  # not a list
    payload = {"job_id": "d" * 32, "kill_grace": 1, "cwd": str(tmp_path), "env": {},
               "ranks": [_rank(0, _sleeper(flag)), _rank(1, ["true"], broken)]}
    events, status = _agent(payload)
    kinds = [e.get("ev") for e in events]
    assert "started" in kinds and "fail" in kinds, events
    assert kinds.index("fail") < kinds.index("done") and status == 1
    fail = next(e for e in events if e.get("ev") == "fail")
    assert fail["message"].startswith("its own error: TypeError"), fail
    pid = next(e["pid"] for e in events if e.get("ev") == "started")
    assert not alive(pid), "the rank the agent had started was left running"


def test_dsrun_fails_naming_the_log_file_when_one_cannot_be_opened(tmp_path):
    logs = tmp_path / "logs"
    (logs / "rank_1.log").mkdir(parents=True)
    res = run_dsrun("--cpu", "--num_gpus", "2", "--log_dir", str(logs), "--dist_backend",
                    "none", str(WORKERS / "hang.py"), "--pid_dir", str(tmp_path),
                    "--finish", "none", timeout=60)
    assert res.returncode == 1, res.stderr
    assert f"cannot open the --log_dir file {logs / 'rank_1.log'}: [Errno 21] Is a " \
        "directory" in res.stderr
    assert not list(tmp_path.glob("*.pid")), "a rank started"
