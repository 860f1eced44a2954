"""On the first attempt rank 1 SIGKILLs its node agent and the agent's
guard together (as srun does to its step), so that nothing removes the
agent's temporary directory; later attempts exit 0. No torch."""

import os
import signal
import time

import psutil


def _guards(agent: psutil.Process) -> list[psutil.Process]:
    """The agent's forked guard: a child that runs the agent's command line."""
    found = []
    for child in agent.children():
        try:
            if child.cmdline() == agent.cmdline():
                found.append(child)
        except psutil.Error:
            pass
    return found


if os.environ["DSRUN_RESTART_COUNT"] == "0":
    if os.environ["RANK"] == "1":
        time.sleep(0.5)  # the other rank is up too
        agent = psutil.Process(int(os.environ["DSRUN_AGENT_PID"]))
        for proc in [*_guards(agent), agent]:
            os.kill(proc.pid, signal.SIGKILL)
    time.sleep(30)  # dies with the agent
print(f"tmpdir {os.path.dirname(os.environ['DSRUN_ERROR_FILE'])}", flush=True)
