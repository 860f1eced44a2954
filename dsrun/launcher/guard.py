"""Watchdog that outlives a node agent killed without warning.

The agent starts one guard per attempt, in its own session, and tells it
each rank's process group over a pipe. If the pipe closes without the
final ``done`` line, the agent died (SIGKILL, OOM killer) before it could
tear its ranks down, so the guard kills every process of the job: the
ranks' groups and anything carrying the job's environment marker.
Usage: ``python -m dsrun.launcher.guard JOB_ID`` with the pipe on stdin.
"""

from __future__ import annotations

import signal
import sys

from dsrun.launcher.procs import kill_job


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    job_id = args[0]
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    pgids: set[int] = set()
    for line in sys.stdin:
        word = line.strip()
        if word == "done":
            return 0
        if word.isdigit():
            pgids.add(int(word))
    kill_job(pgids, job_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
